"""int4 weights as GGUF's Q4_1 blocks: ``w = d * q + m`` with ``q`` in 0..15
and a scale ``d`` and minimum ``m`` (float16 values) per row and group of 32
input features (asymmetric min/max), 20 bytes a group (``d``, ``m``, 16 bytes
of nibbles: values 0-15 in the low nibbles, 16-31 in the high ones).

The layer (``Int4Linear``) is ``models.gguf_linear.GGUFLinear`` over blocks
packed once at load, so ``kernels/csrc/gguf_gemm.c`` multiplies: each block
widened in registers to exactly the float32 weights ``dequantize_int4`` gives
(``d * q``, then ``+ m``, each rounded alone), times x in the run's dtype
(float32 products; bfloat16 rows widen exactly). With ``int8_activations``
(``EngineConfig.int4_activations``: "int8", or "auto" where the CPU has
AVX-512 VNNI) x is rounded to int8 per group of
32 as llama.cpp rounds it and the products are integer dot products read from
panels of 16 rows (AVX-512 VNNI; ``gguf_linear``'s docstring). The default
model's shipped Q4_1 values (``models.default_model.q4_1_weights``) are packed
as they are, never rounded again.
"""
from typing import Dict, Optional, Tuple

import torch

from pagedbackend.models import gguf_linear
from pagedbackend.models.gguf_linear import GGUFLinear

INT4_GROUP_SIZE = 32   # a Q4_1 block's values: the only group size served
Q4_1_BYTES = gguf_linear.BLOCK_BYTES["Q4_1"]

Int4Weight = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (q, scale d, minimum m)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    """Asymmetric min/max int4 per group of 32: (q uint8 ``[N, K]`` in 0..15,
    d and m float32 ``[N, K / 32]`` holding float16 values) with
    ``w ~= d * q + m``: m is the group's minimum and d its range / 15, both
    rounded to float16, and q the nearest step of that grid (a group of equal
    values: d = 0, q = 0)."""
    rows, cols = weight.shape
    _check_group(cols, group_size)
    w = weight.float().reshape(rows, cols // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    m = low.half().float()
    d = ((high - m) / 15.0).half().float()
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError("int4 (Q4_1) needs weights within float16's range")
    steps = torch.where(d[..., None] > 0, (w - m[..., None]) / d[..., None], torch.zeros_like(w))
    q = torch.round(steps).clamp(0, 15).to(torch.uint8)
    return q.reshape(rows, cols), d, m


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``scale * q + minimum`` (each operation rounded
    alone, as the kernel widens a block: the reference of ``Int4Linear``)."""
    rows, cols = q.shape
    groups = scale.shape[1]
    w = q.float().reshape(rows, groups, cols // groups) * scale.float()[..., None] + minimum.float()[..., None]
    return w.reshape(rows, cols)


def pack_q4_1(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks, uint8 ``[N, K / 32 * 20]``, of (q, d, m) as ``quantize_int4``
    gives them (ValueError where d or m is not a float16 value or q is past 0..15)."""
    rows, cols = q.shape
    groups = scale.shape[-1] if scale.dim() == 2 else 0
    _check_group(cols, cols // groups if groups else 0)
    if scale.shape != (rows, groups) or minimum.shape != (rows, groups):
        raise ValueError(f"int4 scales and minimums are [{rows}, {groups}]; got {tuple(scale.shape)} "
                         f"and {tuple(minimum.shape)}")
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError("int4 values must lie in 0..15")
    d, m = scale.half(), minimum.half()
    if not (torch.equal(d.float(), scale.float()) and torch.equal(m.float(), minimum.float())):
        raise ValueError("int4 (Q4_1) scales and minimums must be float16 values (quantize_int4 rounds them)")
    values = q.to(torch.uint8).reshape(rows, groups, INT4_GROUP_SIZE)
    nibbles = values[..., :16] | (values[..., 16:] << 4)
    dm = torch.stack([d, m], dim=-1).view(torch.uint8).reshape(rows, groups, 4)
    return torch.cat([dm, nibbles], dim=-1).reshape(rows, groups * Q4_1_BYTES).contiguous()


def _check_group(cols: int, group_size: int) -> None:
    if group_size != INT4_GROUP_SIZE:
        raise ValueError(f"int4 layers are Q4_1 blocks of {INT4_GROUP_SIZE} input features "
                              f"(kernels/csrc/gguf_gemm.c); group size {group_size} is not served")
    if cols % INT4_GROUP_SIZE:
        raise ValueError(f"int4 quantization needs input features ({cols}) divisible by "
                              f"{INT4_GROUP_SIZE}")


def unavailable(int8_activations: bool = False) -> Optional[str]:
    """Why int4 layers (with int8 activations) cannot run here (None: they can)."""
    if int8_activations:
        return gguf_linear.int8_activations_unavailable()
    try:
        gguf_linear.load_library()
    except RuntimeError as exc:
        return str(exc)
    return None


class Int4Linear(GGUFLinear):
    """``x W^T`` with W int4 in groups of 32 along the input features (no
    bias): one Q4_1 part of ``GGUFLinear``, its blocks owned by the layer."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 int8_activations: bool = False):
        super().__init__([pack_q4_1(q, scale, minimum)], ["Q4_1"], q.shape[1])
        self.group_size = INT4_GROUP_SIZE
        if int8_activations:
            self.int8_activations = True

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE, **options) -> "Int4Linear":
        """Round ``weight`` in groups (``quantize_int4``); ``options`` as for the constructor."""
        return cls(*quantize_int4(weight, group_size), **options)


def int4_layer(weight: torch.Tensor, hf_names: Tuple[str, ...], ready: Optional[Dict[str, Int4Weight]],
               int8_activations: bool = False) -> Int4Linear:
    """The int4 layer of a (merged) projection: its shards' ready (q, d, m)
    from ``ready`` by Hugging Face name when given, else ``weight`` rounded in
    groups of 32."""
    if ready is None:
        return Int4Linear.from_float(weight, int8_activations=int8_activations)
    given = tuple(torch.cat(pieces) for pieces in zip(*(ready[name] for name in hf_names)))
    if given[0].shape != weight.shape:
        raise ValueError(f"int4 weights for {', '.join(hf_names)} have shape "
                         f"{tuple(given[0].shape)}, the model {tuple(weight.shape)}")
    return Int4Linear(*given, int8_activations=int8_activations)
