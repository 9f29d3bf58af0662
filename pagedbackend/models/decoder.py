"""The causal decoder every family builds on: embedding -> decoder layers ->
final norm -> LM head (tied or not), one instance per tensor-parallel rank.

A family subclasses ``CausalLM`` and says what differs: how it reads its
config (``parse_config``), its decoder layer (``build_layer``), its norm,
embedding scale, logits post-processing, and how its checkpoint names map to
ours (``checkpoint_tensors``: renames, fused tensors split, vision towers
skipped). Tensor parallelism, weight loading, the projections the quant
package and adapters reach (``hf_projections``) and the LM head's matmul
are shared here. Parameter names follow Hugging Face after merging q/k/v
into ``qkv_proj`` and gate/up into ``gate_up_proj``.
"""
import logging
import re
from collections import Counter
from typing import Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.models.fp8_scales import load_scale
from pagedbackend.models.layers import RMSNorm, llama_layer
from pagedbackend.models.linear import Reduce
from pagedbackend.models.model_args import ModelArgs
from pagedbackend.models.rotary import RotaryEmbedding

logger = logging.getLogger("pagedbackend")

# HF projection -> (our merged projection, shard index inside it).
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_STACKED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW_PARALLEL = ("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")

Tensors = Iterable[Tuple[str, torch.Tensor]]


class CausalLM(nn.Module):
    """The decoder plus LM head. ``reduce`` sums row-parallel partial outputs
    across ranks (identity for ``tp_size == 1``). Build it on the target
    device (``with torch.device(...)``), then call ``load_weights``.
    Attention reads its KV cache, metadata and kernels from the step context
    (``models.attention``). ``layer_windows``: per layer, its sliding window
    or None (full attention), for the KV cache and the attention paths."""

    # Our projection inside a decoder layer -> the HF tensors merged into it, in shard order.
    MERGED = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn.o_proj", ("o_proj",)),
              ("mlp.gate_up_proj", ("gate_proj", "up_proj")), ("mlp.down_proj", ("down_proj",)))

    def __init__(self, args: ModelArgs, dtype: torch.dtype, max_positions: Optional[int] = None,
                 tp_rank: int = 0, tp_size: int = 1, reduce: Optional[Reduce] = None):
        super().__init__()
        self.args = args
        self.layer_windows: List[Optional[int]] = list(args.layer_windows)
        max_positions = max_positions or args.served_positions
        self.rotary = nn.ModuleList(RotaryEmbedding(params, args.head_dim, args.max_position_embeddings,
                                                    max_positions, dtype) for params in args.ropes)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.build_layer(i, tp_rank, tp_size, reduce, dtype)
                                    for i in range(args.num_layers))
        self.norm = self.build_norm(args.hidden_size, dtype)
        self.lm_head = None
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, dtype=dtype)
            self.lm_head.weight.requires_grad_(False)
        self.lm_head_matmul: Optional[nn.Module] = None   # set by use_head_matmul()
        self.score = None   # a sequence classifier's head (ModelArgs.num_labels): scores from the last token
        if args.num_labels:
            self.score = nn.Linear(args.hidden_size, args.num_labels, bias=False, dtype=dtype)
            self.score.weight.requires_grad_(False)
        self.skipped: Counter = Counter()   # checkpoint tensors left out, by part (checkpoint_tensors)

    # ---- what a family says ---------------------------------------------

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        """The architecture of a config.json; raises ``UnsupportedModelError``
        naming any field this family does not serve."""
        raise NotImplementedError

    def build_layer(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                    dtype: torch.dtype) -> nn.Module:
        return llama_layer(self.args, layer, tp_rank, tp_size, reduce, dtype)

    def build_norm(self, size: int, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(size, self.args.rms_norm_eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What follows the LM head (scaling, soft-capping); nothing here."""
        return logits

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Tensors:
        """The tensors a checkpoint tensor gives, named as ours without the
        ``model.`` prefix (``layers.0.self_attn.q_proj.weight``); none to skip it."""
        yield name.removeprefix("model."), tensor

    # ---- the forward -----------------------------------------------------

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (the KV cache's third dimension)."""
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` before the final norm; runs
        inside the step context of ``models.attention.step_context``.
        ``inputs_embeds``: the rows' embeddings given (images in place of
        their placeholders, ``worker.image_rows``) instead of ``embed(input_ids)``."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = [rotary(positions) for rotary in self.rotary]   # once per step, shared by the layers
        for layer in self.layers:
            h = layer(h, positions, ropes)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, for the rows that need logits only."""
        hidden = self.norm(hidden)
        if self.lm_head_matmul is not None:
            return self.finish_logits(self.lm_head_matmul(hidden))
        return self.finish_logits(F.linear(hidden, self.head_weight()))

    # ---- the projections and the head, for quantisation and adapters -----

    def hf_projections(self) -> Iterator[Tuple[Tuple[str, ...], nn.Module]]:
        """Every linear projection of the decoder layers (not the LM head), with
        the Hugging Face names of the weights merged into it, in shard order."""
        for i, layer in enumerate(self.layers):
            for merged, parts in self.MERGED:
                block = merged.split(".")[0]
                yield (tuple(f"model.layers.{i}.{block}.{part}.weight" for part in parts),
                       layer.get_submodule(merged))

    def projections(self) -> Iterator[nn.Module]:
        """Every linear projection of the decoder layers (not the LM head)."""
        return (linear for _, linear in self.hf_projections())

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight (the embedding's, when they are tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def use_head_matmul(self, module: nn.Module) -> None:
        """Serve the LM head through ``module`` (holding its own copy of the
        weight: a tied head's embedding stays as loaded) and drop the float head."""
        self.lm_head_matmul, self.lm_head = module, None

    # ---- loading ---------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, tensors: Tensors) -> None:
        """Load HF-named tensors, each rank keeping its slice; every parameter must be set."""
        # A vision-language model's tower and projector load apart ("vision." names).
        params = {name: p for name, p in self.named_parameters() if not name.startswith("vision.")}
        if self.args.classifier_token_ids is not None:   # built from the LM head below
            params.pop("score.weight", None)
        vision = []
        # Tensors still to come per parameter: merged ones take one per shard.
        pending = {name: len(getattr(self.get_submodule(name.rsplit(".", 1)[0]), "rank_slices", [0]))
                   for name in params}
        head = None   # an LM head in a checkpoint whose config ties it to the embedding
        for hf_name, hf_tensor in tensors:
            for name, tensor in self.checkpoint_tensors(hf_name, hf_tensor):
                if _IGNORED_RE.search(name):
                    continue
                if name.startswith("vision."):
                    vision.append((name[len("vision."):], tensor))
                    continue
                if name == "lm_head.weight" and self.lm_head is None:
                    head = tensor
                    continue
                if load_scale(self, hf_name, name, tensor):   # an fp8 KV cache's k_scale / v_scale
                    continue
                name = self._load_one(hf_name, name, tensor, params)
                pending[name] -= 1
        if getattr(self, "vision", None) is not None:
            self.vision.load_weights(vision)
        unset = sorted(name for name, count in pending.items() if count > 0)
        if unset:
            raise ValueError(f"checkpoint lacks tensors for {len(unset)} parameter(s), e.g. {unset[:3]}")
        embedding = self.embed_tokens.weight
        if self.args.classifier_token_ids is not None:
            self._score_from_head(embedding if head is None else head.to(embedding))
        elif head is not None and not torch.equal(head.to(embedding), embedding):
            # As transformers does: a head the checkpoint holds apart is not tied.
            self.lm_head = nn.Linear(embedding.shape[1], embedding.shape[0], bias=False, dtype=embedding.dtype,
                                     device=embedding.device)
            self.lm_head.weight.requires_grad_(False)
            self.lm_head.weight.copy_(head)
        for part, count in sorted(self.skipped.items()):
            logger.info("pagedbackend: %d checkpoint tensors of the %s are not loaded: only the text "
                        "decoder is served", count, part)

    def _score_from_head(self, head: torch.Tensor) -> None:
        """A reranker read from its LM head (vLLM's ``classifier_from_token``):
        one token's row, or for ``[no, yes]`` the difference yes - no, so that
        the sigmoid of the one logit is softmax([no, yes])[yes]."""
        if self.score is None:
            raise ValueError("classifier_from_token needs a sequence-classification architecture "
                             "(hf_overrides architectures: [\"Qwen3ForSequenceClassification\"] or the like)")
        rows = head[self.args.classifier_token_ids]
        self.score.weight.copy_(rows[-1:] - rows[:1] if len(rows) == 2 else rows)

    def _load_one(self, hf_name: str, name: str, tensor: torch.Tensor, params: dict) -> str:
        """Copy one tensor into its parameter (or its shard); returns the parameter's name."""
        stacked = _STACKED_RE.match(name)
        if stacked:
            prefix, proj, kind = stacked.groups()
            merged, shard = _STACKED[proj]
            self.get_submodule(f"{prefix}.{merged}").load(shard, kind, tensor)
            return f"{prefix}.{merged}.{kind}"
        if name.endswith(_ROW_PARALLEL) and name in params:
            module, kind = name.rsplit(".", 1)
            self.get_submodule(module).load(kind, tensor)
            return name
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {hf_name}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(params[name].shape)}")
        params[name].copy_(tensor)
        return name
