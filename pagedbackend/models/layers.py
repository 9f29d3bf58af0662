"""The layers decoder families share: RMSNorm, the gated MLP, grouped-query
attention over the paged cache, and the pre-norm decoder layer.

A family composes these and says only what differs: Qwen3 passes a q/k norm
to ``Attention``, Gemma its ``(1 + w)`` norm and GELU, an MoE family another
module as the layer's ``mlp``. Every projection is a tensor-parallel linear
layer (``linear.py``) that quantisation and adapters reach through the
model's ``hf_projections``. Each layer's forward takes ``(x, positions,
ropes)``: ``ropes`` holds the step's cos/sin per distinct RoPE setting,
looked up once per step (``CausalLM.forward``).
"""
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.models.attention import PagedAttention
from pagedbackend.models.linear import ColumnParallelLinear, QKVParallelLinear, Reduce, RowParallelLinear
from pagedbackend.models.model_args import ModelArgs
from pagedbackend.models.rotary import CosSin, apply_rotary


class RMSNorm(nn.Module):
    """``w * x / rms(x)``, normalised in fp32, scaled in the compute dtype (HF Llama, Qwen, Phi-3)."""

    def __init__(self, size: int, eps: float, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    @torch.no_grad()
    def divide_gain_(self, s: torch.Tensor) -> None:
        """Divide the output channels by ``s`` (folding a smoothing factor in)."""
        self.weight.div_(s.to(self.weight.dtype))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, gate and up in one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp_rank: int, tp_size: int,
                 reduce: Optional[Reduce], dtype: torch.dtype,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.act = act
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias,
                                                 tp_rank, tp_size, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp_rank, tp_size, reduce, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Attention(nn.Module):
    """Grouped-query attention: q/k/v in one column-parallel matmul, an
    optional per-head RMSNorm of q and k (``qk_norm``: a norm class, built
    over ``head_dim``), RoPE (none on a NoPE layer), paged attention with the
    layer's window, then the row-parallel output projection."""

    def __init__(self, args: ModelArgs, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                 dtype: torch.dtype, qk_norm: Optional[Callable[..., nn.Module]] = None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads,
                                          args.attention_bias, tp_rank, tp_size, dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = args.head_dim
        self.o_proj = RowParallelLinear(args.num_heads * args.head_dim, args.hidden_size, args.output_bias,
                                        tp_rank, tp_size, reduce, dtype, in_slice=self.qkv_proj.rank_slices[0])
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(args.head_dim, args.rms_norm_eps, dtype)
            self.k_norm = qk_norm(args.head_dim, args.rms_norm_eps, dtype)
        self.rope = args.layer_ropes[layer]   # index into the step's ropes; None: NoPE
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, args.head_dim, args.softmax_scale, layer,
                                   sliding_window=args.layer_windows[layer])

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ropes: List[CosSin]) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes_per_rank, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = apply_rotary(q, k, ropes[self.rope])
        q = self.scale_queries(q, positions)
        out = self.attn(q, k, v)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))

    def scale_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A position-dependent query scale before attention (none here; Ministral 3 has one)."""
        return q


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    @property
    def pre_mlp_norm(self) -> nn.Module:
        """The norm whose output the MLP reads (w8a8 smoothing folds into it)."""
        return self.post_attention_layernorm

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ropes: List[CosSin]) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, ropes)
        return h + self.mlp(self.post_attention_layernorm(h))


def llama_layer(args: ModelArgs, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                dtype: torch.dtype, qk_norm: Optional[Callable[..., nn.Module]] = None) -> DecoderLayer:
    """The Llama decoder layer: RMSNorm, attention, RMSNorm, SwiGLU MLP."""
    return DecoderLayer(Attention(args, layer, tp_rank, tp_size, reduce, dtype, qk_norm),
                        GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, tp_rank, tp_size,
                                 reduce, dtype),
                        RMSNorm(args.hidden_size, args.rms_norm_eps, dtype),
                        RMSNorm(args.hidden_size, args.rms_norm_eps, dtype))
