"""Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache.

embedding -> N x [RMSNorm -> GQA attention (RoPE, paged kernels) -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (tied or not).

Tensor parallelism: q/k/v and gate/up are column-parallel (heads and
intermediate features split across ranks), o_proj and down_proj row-parallel
with one reduction each. A rank holds whole KV heads and the query heads that
read them (``kv_heads_of_rank``: uneven shares when the ranks do not divide the
KV heads, replicated KV heads when there are fewer KV heads than ranks). The
embedding and LM head stay replicated; only rank 0 computes logits. Parameter
names follow Hugging Face after merging q/k/v into ``qkv_proj`` and gate/up
into ``gate_up_proj``; ``load_weights`` takes the original HF tensors.
"""
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.models.attention import PagedAttention, layer_windows_of
from pagedbackend.models.linear import (ColumnParallelLinear, QKVParallelLinear, Reduce,
                                        RowParallelLinear)
from pagedbackend.models.rotary import (CosSin, RotaryEmbedding, apply_rotary, inverse_frequencies,
                                        rope_parameters)


@dataclass
class LlamaArgs:
    """The architecture fields of a Hugging Face config.json that the forward uses."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: dict
    layer_windows: List[Optional[int]] = field(default_factory=list)   # per layer; None: full attention

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArgs":
        model_type = cfg.get("model_type")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (SwiGLU needs silu)")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            # HF's LlamaConfig, MistralConfig and Qwen2Config all default to untied.
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama declares them in attention_bias.
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            mlp_bias=cfg.get("mlp_bias", False),
            rope=rope_parameters(cfg),
            layer_windows=sliding_windows(cfg),
        )


def sliding_windows(cfg: dict) -> List[Optional[int]]:
    """Each layer's sliding window (None: full attention), as Hugging Face
    reads the config: Mistral windows every layer (``sliding_window``);
    Qwen2 only with ``use_sliding_window``, the layers ``layer_types`` names
    ``sliding_attention`` (by default those from ``max_window_layers`` on);
    Llama has none."""
    layers, model_type = cfg["num_hidden_layers"], cfg.get("model_type")
    window = cfg.get("sliding_window")
    if model_type == "llama" or (model_type == "qwen2" and not cfg.get("use_sliding_window", False)):
        window = None
    if window is None:
        return [None] * layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive number of positions, got {window!r}")
    types = cfg.get("layer_types") if model_type == "qwen2" else None
    if types is None:
        first = cfg.get("max_window_layers", 28) if model_type == "qwen2" else 0
        return [window if i >= first else None for i in range(layers)]
    kinds = {"sliding_attention": window, "full_attention": None}
    if len(types) != layers or any(t not in kinds for t in types):
        raise ValueError(f"layer_types must name {layers} layers, each 'sliding_attention' or "
                         f"'full_attention', got {types!r}")
    return [kinds[t] for t in types]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32, scaled in the compute dtype (as HF Llama does).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int, tp_rank: int, tp_size: int,
                 reduce: Optional[Reduce], dtype: torch.dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(args.hidden_size, args.head_dim, args.num_heads,
                                          args.num_kv_heads, args.attention_bias,
                                          tp_rank, tp_size, dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = args.head_dim
        self.o_proj = RowParallelLinear(args.num_heads * args.head_dim, args.hidden_size, False,
                                        tp_rank, tp_size, reduce, dtype,
                                        in_slice=self.qkv_proj.rank_slices[0])
        windows = args.layer_windows
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, args.head_dim,
                                   args.head_dim ** -0.5, layer, windows[layer] if windows else None)

    def forward(self, cos_sin: CosSin, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes_per_rank, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, cos_sin)
        out = self.attn(q, k, v)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, args: LlamaArgs, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                 dtype: torch.dtype):
        super().__init__()
        size = args.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(args.hidden_size, [size, size], args.mlp_bias,
                                                 tp_rank, tp_size, dtype)
        self.down_proj = RowParallelLinear(size, args.hidden_size, args.mlp_bias,
                                           tp_rank, tp_size, reduce, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int, tp_rank: int, tp_size: int,
                 reduce: Optional[Reduce], dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(args, layer, tp_rank, tp_size, reduce, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(args, tp_rank, tp_size, reduce, dtype)

    def forward(self, cos_sin: CosSin, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(cos_sin, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


# HF projection -> (our merged projection, shard index inside it).
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_STACKED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")
# Our projection inside a decoder layer -> the HF projections merged into it.
_MERGED = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn.o_proj", ("o_proj",)),
           ("mlp.gate_up_proj", ("gate_proj", "up_proj")), ("mlp.down_proj", ("down_proj",)))


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head; one instance per tensor-parallel rank.

    ``reduce`` sums row-parallel partial outputs across ranks (identity for
    ``tp_size == 1``). Build it on the target device (``with
    torch.device(...)``), then call ``load_weights``. Attention reads its KV
    cache, metadata and kernels from the step context (``models.attention``).
    """

    def __init__(self, args: LlamaArgs, dtype: torch.dtype,
                 max_positions: Optional[int] = None, tp_rank: int = 0, tp_size: int = 1,
                 reduce: Optional[Reduce] = None):
        super().__init__()
        self.args = args
        max_positions = max_positions or args.max_position_embeddings
        inv_freq = inverse_frequencies(args.rope, args.head_dim, args.max_position_embeddings)
        self.rotary = RotaryEmbedding(args.head_dim, max_positions, inv_freq, dtype)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, i, tp_rank, tp_size, reduce, dtype)
            for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.lm_head = None
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, dtype=dtype)
            self.lm_head.weight.requires_grad_(False)
        self.lm_head_matmul: Optional[nn.Module] = None   # set by use_head_matmul()

    @property
    def layer_windows(self) -> List[Optional[int]]:
        """Each layer's sliding window (None: full attention)."""
        return layer_windows_of(self)

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (the KV cache's third dimension)."""
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` before the final norm; runs
        inside the step context of ``models.attention.step_context``."""
        h = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions)   # once per step, shared by every layer
        for layer in self.layers:
            h = layer(cos_sin, h)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, for the rows that need logits only."""
        hidden = self.norm(hidden)
        if self.lm_head_matmul is not None:
            return self.lm_head_matmul(hidden)
        return F.linear(hidden, self.head_weight())

    def hf_projections(self) -> Iterator[Tuple[Tuple[str, ...], nn.Module]]:
        """Every linear projection of the decoder layers (not the LM head), with
        the Hugging Face names of the weights merged into it, in shard order."""
        for i, layer in enumerate(self.layers):
            for merged, parts in _MERGED:
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

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, each rank keeping its slice; every parameter must be set."""
        params = dict(self.named_parameters())
        # Tensors still to come per parameter: merged ones take one per shard.
        pending = {name: len(getattr(self.get_submodule(name.rsplit(".", 1)[0]), "rank_slices", [0]))
                   for name in params}
        for hf_name, tensor in tensors:
            name = hf_name.removeprefix("model.")
            if _IGNORED_RE.search(name) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            stacked = _STACKED_RE.match(name)
            if stacked:
                prefix, proj, kind = stacked.groups()
                merged, shard = _STACKED[proj]
                name = f"{prefix}.{merged}.{kind}"
                self.get_submodule(f"{prefix}.{merged}").load(shard, kind, tensor)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "down_proj.bias")):
                module, kind = name.rsplit(".", 1)
                self.get_submodule(module).load(kind, tensor)
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(params[name].shape)}")
                params[name].copy_(tensor)
            else:
                raise ValueError(f"unexpected checkpoint tensor {hf_name}")
            pending[name] -= 1
        unset = sorted(name for name, count in pending.items() if count > 0)
        if unset:
            raise ValueError(f"checkpoint lacks tensors for {len(unset)} parameter(s), e.g. {unset[:3]}")
