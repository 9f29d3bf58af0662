"""BERT and XLM-RoBERTa encoders (bge, gte-base, bge-m3 style embedders; BERT
cross-encoders): token, position and segment embeddings, then post-norm
layers of bidirectional self-attention and a GELU MLP.

The module tree uses Hugging Face's parameter names (``embeddings.*``,
``encoder.layer.N.attention.self.query``, ...) so a checkpoint loads by
name once its ``bert.`` / ``roberta.`` prefix is taken off. The forward runs
on whole inputs packed one after another, without padding (a batch padded
to its longest input computed up to twice the tokens on mixed lengths), each
input attending to itself only: an encoder has no KV cache
(``worker.encoder_runner`` says why). XLM-RoBERTa differs only in its
position ids, which count from ``pad_token_id + 1`` over the non-padding
tokens, as RoBERTa's do.
"""
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.kernels import onednn_linear
from pagedbackend.models.model_args import UnsupportedModelError

ENCODER_TYPES = ("bert", "xlm-roberta")   # model_type values served by this module
_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# the same, as oneDNN's post-ops (kernels.onednn_linear.ACTIVATIONS)
_ONEDNN_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass(frozen=True)
class EncoderArgs:
    """The architecture of an encoder's config.json."""
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    num_labels: int          # outputs of a sequence-classification head (cross-encoders)
    classifier: bool         # the checkpoint is a *ForSequenceClassification

    @property
    def served_positions(self) -> int:
        """Positions an input may use: RoBERTa's start past the padding index."""
        if self.model_type == "xlm-roberta":
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings


def parse_encoder_config(cfg: dict) -> EncoderArgs:
    """An encoder's config.json; what is not served is refused by field name."""
    model_type = cfg.get("model_type")
    if model_type not in ENCODER_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not an encoder ({', '.join(ENCODER_TYPES)})")
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {act!r} is not served (served: {', '.join(_ACTIVATIONS)})")
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise UnsupportedModelError(f"position_embedding_type {kind!r} is not served (absolute is)")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise UnsupportedModelError("is_decoder / add_cross_attention: only encoders are served")
    architectures = cfg.get("architectures") or []
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 1))
    if classifier and num_labels != 1:
        raise UnsupportedModelError(f"num_labels {num_labels}: a cross-encoder with one label (a score) is served")
    return EncoderArgs(model_type, cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"],
                       cfg["num_attention_heads"], cfg["intermediate_size"], act, cfg["max_position_embeddings"],
                       cfg.get("type_vocab_size", 2), cfg.get("layer_norm_eps", 1e-12),
                       cfg.get("pad_token_id", 0) or 0, num_labels, classifier)


class _Embeddings(nn.Module):
    def __init__(self, a: EncoderArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.position_embeddings = nn.Embedding(a.max_position_embeddings, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size)
        self.LayerNorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        h = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(token_types)
        return self.LayerNorm(h)


class _SelfAttention(nn.Module):
    def __init__(self, a: EncoderArgs):
        super().__init__()
        self.query = nn.Linear(a.hidden_size, a.hidden_size)
        self.key = nn.Linear(a.hidden_size, a.hidden_size)
        self.value = nn.Linear(a.hidden_size, a.hidden_size)
        self.num_heads = a.num_heads
        self.qkv = None   # query, key and value as one layer (Encoder.use_onednn)


class _DenseNorm(nn.Module):
    """A projection, its residual and a LayerNorm (BERT's ``*Output`` blocks)."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, a: EncoderArgs):
        super().__init__()
        setattr(self, "self", _SelfAttention(a))
        self.output = _DenseNorm(a.hidden_size, a.hidden_size, a.layer_norm_eps)

    def forward(self, h: torch.Tensor, lengths: List[int]) -> torch.Tensor:
        """``h``: the inputs' tokens one after another ``[tokens, hidden]``;
        each input attends to all of itself (bidirectional) and nothing else."""
        sa = getattr(self, "self")
        d, heads = h.shape[-1], sa.num_heads
        q, k, v = sa.qkv(h).split(d, dim=-1) if sa.qkv is not None else (sa.query(h), sa.key(h), sa.value(h))
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            n = qi.shape[0]
            qi, ki, vi = (x.view(1, n, heads, d // heads).transpose(1, 2) for x in (qi, ki, vi))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1).reshape(n, d))
        return self.output(torch.cat(outs) if len(outs) > 1 else outs[0], h)


class _Intermediate(nn.Module):
    def __init__(self, a: EncoderArgs):
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.intermediate_size)
        self.act = _ACTIVATIONS[a.hidden_act]   # identity once the dense layer applies it (use_onednn)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(h))


class _Layer(nn.Module):
    def __init__(self, a: EncoderArgs):
        super().__init__()
        self.attention = _Attention(a)
        self.intermediate = _Intermediate(a)
        self.output = _DenseNorm(a.intermediate_size, a.hidden_size, a.layer_norm_eps)

    def forward(self, h: torch.Tensor, lengths: List[int]) -> torch.Tensor:
        h = self.attention(h, lengths)
        return self.output(self.intermediate(h), h)


class _Encoder(nn.Module):
    def __init__(self, a: EncoderArgs):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(a) for _ in range(a.num_layers))


class _Pooler(nn.Module):
    """BERT's pooler: the first token through a dense layer and tanh (a classifier's input)."""

    def __init__(self, a: EncoderArgs):
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class _RobertaHead(nn.Module):
    """XLM-RoBERTa's classification head: the first token through dense, tanh, out_proj."""

    def __init__(self, a: EncoderArgs):
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size)
        self.out_proj = nn.Linear(a.hidden_size, a.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class Encoder(nn.Module):
    """An encoder and, for a cross-encoder, its pooler and classifier."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.embeddings = _Embeddings(args)
        self.encoder = _Encoder(args)
        # BERT: pooler then a linear classifier; XLM-RoBERTa: its own head, no pooler.
        roberta = args.model_type == "xlm-roberta"
        self.pooler = _Pooler(args) if args.classifier and not roberta else None
        self.classifier = None
        if args.classifier:
            self.classifier = _RobertaHead(args) if roberta else nn.Linear(args.hidden_size, args.num_labels)
        self.requires_grad_(False)

    def use_onednn(self) -> None:
        """Every projection through ``onednn_linear`` (weights in oneDNN's
        layout): each layer's query, key and value as one product, the MLP's
        activation inside its up projection; the rest one layer each."""
        for layer in self.encoder.layer:
            sa = getattr(layer.attention, "self")
            sa.qkv = onednn_linear.OneDnnLinear([sa.query, sa.key, sa.value])
            del sa.query, sa.key, sa.value
            mlp = layer.intermediate
            mlp.dense = onednn_linear.OneDnnLinear(mlp.dense, _ONEDNN_ACTIVATIONS[self.args.hidden_act])
            mlp.act = nn.Identity()
        onednn_linear.use_in(self)

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Position ids of one input: 0.. (BERT), or RoBERTa's past the padding index."""
        if self.args.model_type == "xlm-roberta":
            pad = self.args.pad_token_id
            real = (ids != pad).long()
            return torch.cumsum(real, dim=0) * real + pad
        return torch.arange(ids.shape[0], device=ids.device)

    def forward(self, ids: torch.Tensor, lengths: List[int],
                token_types: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Last hidden states ``[tokens, hidden]`` of whole inputs packed one
        after another (``lengths``: each input's tokens; no padding, so the
        projections and MLPs compute real tokens only); ``token_types``: the
        segment of each token (a cross-encoder's query 0, document 1; default 0)."""
        if token_types is None:
            token_types = torch.zeros_like(ids)
        positions = torch.cat([self.positions(part) for part in ids.split(lengths)])
        h = self.embeddings(ids, positions, token_types)
        for layer in self.encoder.layer:
            h = layer(h, lengths)
        return h

    def classify(self, hidden: torch.Tensor, lengths: List[int]) -> torch.Tensor:
        """A cross-encoder's logits ``[inputs, num_labels]`` from the packed last hidden states."""
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        first = hidden[torch.tensor(starts, device=hidden.device)]
        return self.classifier(first if self.pooler is None else self.pooler(first))

    def load_weights(self, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Hugging Face tensors (``BertModel``, ``XLMRobertaModel`` or
        ``BertForSequenceClassification`` names); a missing one is refused by name."""
        own: Dict[str, torch.Tensor] = dict(self.state_dict())
        seen = set()
        for name, tensor in tensors:
            for prefix in ("bert.", "roberta.", "model."):
                name = name.removeprefix(prefix)
            if name in own:
                if own[name].shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(own[name].shape)}")
                own[name].copy_(tensor)
                seen.add(name)
        missing = sorted(n for n in own if n not in seen and not n.endswith("position_ids"))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
