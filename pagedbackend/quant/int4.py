"""int4 weights: ``w ~= (q - 8) * s + z`` with ``q`` in 0..15 and a scale
``s`` and offset ``z`` per row and group of ``group_size`` input columns
(asymmetric min/max). ``torch.ops.aten._weight_int4pack_mm_for_cpu`` serves
every step (widening the weight in torch ops costs more than the kernel at any
size measured); x enters it as bfloat16, as for ``int8``. GGUF's Q4_1
(``w = d * q + m`` per 32 columns) is this format with ``s = d`` and
``z = m + 8 d``, so the default model keeps its shipped 4-bit values
(``models.default_model.q4_1_weights``); ``s`` and ``z`` are held in
bfloat16, as the kernel takes them in the input's dtype.
"""
from typing import Dict, Optional, Tuple

import torch
from torch import nn

INT4_GROUP_SIZES = (32, 64, 128, 256)

Int4Weight = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (q, scale, minimum)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric min/max int4 per group: (q int32 ``[N, K]`` in 0..15, scale and
    minimum float32 ``[N, K / group_size]``) with ``w ~= scale * q + minimum``."""
    rows, cols = weight.shape
    _check_group(cols, group_size)
    w = weight.float().reshape(rows, cols // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(rows, cols), scale, low


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``scale * q + minimum`` (the reference of the int4 kernel)."""
    rows, cols = q.shape
    groups = scale.shape[1]
    w = q.float().reshape(rows, groups, cols // groups) * scale[..., None] + minimum[..., None]
    return w.reshape(rows, cols)


def _check_group(cols: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES or cols % group_size:
        raise ValueError(f"int4 quantization needs input features ({cols}) divisible by a group "
                         f"size in {INT4_GROUP_SIZES}, got {group_size}")


class Int4Linear(nn.Module):
    """``x W^T`` with W int4 in groups along the input features (no bias)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 act_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.act_dtype = act_dtype
        rows, cols = q.shape
        self.group_size = cols // scale.shape[1]
        _check_group(cols, self.group_size)
        if q.min() < 0 or q.max() > 15:
            raise ValueError("int4 values must lie in 0..15")
        # The kernel's layout: packed nibbles [N, K / 2] and [K / group, N, 2]
        # holding (scale, zero) with w = (q - 8) * scale + zero.
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        zero = minimum.float() + 8.0 * scale.float()
        scale_zero = torch.stack([scale.float(), zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("qweight", packed)
        self.register_buffer("scale_zero", scale_zero.to(act_dtype))
        self.in_features, self.out_features = cols, rows

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int, **options) -> "Int4Linear":
        """Round ``weight`` in groups (``quantize_int4``); ``options`` as for the constructor."""
        return cls(*quantize_int4(weight, group_size), **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.act_dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size,
                                                        self.scale_zero)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by (its packing is private
        to torch, so it is read back through the kernel, x = identity, in fp32:
        slow, for tests)."""
        eye = torch.eye(self.in_features)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size,
                                                          self.scale_zero.float()).t().contiguous()


def int4_layer(weight: torch.Tensor, hf_names: Tuple[str, ...], group_size: int,
               ready: Optional[Dict[str, Int4Weight]]) -> Int4Linear:
    """The int4 layer of a (merged) projection: its shards' ready (q, scale,
    minimum) from ``ready`` by Hugging Face name when given, else ``weight``
    rounded in groups of ``group_size``."""
    if ready is None:
        return Int4Linear.from_float(weight, group_size)
    given = tuple(torch.cat(pieces) for pieces in zip(*(ready[name] for name in hf_names)))
    if given[0].shape != weight.shape:
        raise ValueError(f"int4 weights for {', '.join(hf_names)} have shape "
                         f"{tuple(given[0].shape)}, the model {tuple(weight.shape)}")
    return Int4Linear(*given)
