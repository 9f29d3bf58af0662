"""int8 weights: ``w ~= q * s`` with ``q`` int8 and one scale ``s`` per output
row (symmetric, ``s = max|w_row| / 127``); only the weights are narrow.

Two layers hold the same values. ``Int8Linear`` (torch's kernels) runs
``torch.ops.aten._weight_int8pack_mm`` up to ``INT8_KERNEL_MAX_ROWS`` rows of
x, whose rows enter as bfloat16 and leave as float32: torch's CPU kernels are
vectorised for bfloat16 inputs only, and take a scalar path 10-100x slower than
fp32 ``F.linear`` for float32 ones (``loadtest.bench quant_kernels``;
``act_dtype=torch.float32`` keeps that path for comparison). That kernel costs
about one pass over the weight per row of x, so larger steps (prefills) compute
``(x q^T) * s`` with ``F.linear`` on ``q`` widened to float32 instead.
``PackedInt8Linear`` (the packed C kernel, ``kernels.packed_linear``) serves
int8 on CPU wherever that kernel builds, in any model dtype: a bfloat16 or
float16 model's rows are widened to float32 (exactly) and the result rounded
back. Over Llama-3.2-1B's four layer shapes on an AMD Zen 4 (2 threads) that
took 0.54x, 0.62x and 0.37x the time of torch's kernel on bfloat16 rows at 1,
8 and 32 rows, and 1.03-1.04x that of float32 rows. Its steps of
``INT8_BF16_ROWS`` rows or more round x to bfloat16 on AMD CPUs with
AVX512_BF16, where that is faster (for a bfloat16 model, nothing is lost).
A bfloat16 model's steps of more rows than the kernel takes (prefills) pair
the int8 weight as bfloat16 for the call (exact) and run the paired bfloat16
kernel (``bf16_linear``), where the CPU has it, instead of float32 products.
"""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.kernels import packed_linear
from pagedbackend.models import bf16_linear

# Inputs PackedInt8Linear widens to float32 for its kernel (every value exact
# there): a bfloat16 or float16 model's int8 layers run the float32-input kernel.
WIDENED_INPUTS = (torch.bfloat16, torch.float16)

# Rows of x up to which the int8 kernel beats widening q for F.linear (about
# even between 32 and 128 rows here; loadtest.bench quant_kernels).
INT8_KERNEL_MAX_ROWS = 64


def quantize_int8(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[N, K]``, float32 scales ``[N]``) with ``weight ~= q * scale[:, None]``."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """``x W^T`` with W int8 per output channel (no bias: the caller adds it)."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16,
                 kernel_max_rows: int = INT8_KERNEL_MAX_ROWS):
        super().__init__()
        q, scales = quantize_int8(weight)
        self.act_dtype, self.kernel_max_rows = act_dtype, kernel_max_rows
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("kernel_scales", scales.to(act_dtype))

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > self.kernel_max_rows:   # one widening pass, then a GEMM
            y = F.linear(flat, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat.to(self.act_dtype), self.qweight,
                                                   self.kernel_scales).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``q * scale`` (the reference of the kernel)."""
        return self.qweight.float() * self.scales[:, None]


class PackedInt8Linear(nn.Module):
    """``x W^T`` (no bias) with W int8 per output channel (``quantize_int8``:
    the same values as ``Int8Linear``), held packed for the C kernel."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"PackedInt8Linear takes a 2-D CPU weight; got {tuple(weight.shape)} "
                             f"on {weight.device}")
        self.out_features, self.in_features = weight.shape
        q, scales = quantize_int8(weight.detach())
        packed = packed_linear.pack(q)
        padded = scales.new_zeros(packed.shape[0] * packed.shape[2])
        padded[:self.out_features] = scales
        self.register_buffer("qpacked", packed)
        self.register_buffer("scales", padded)
        self.ops = packed_linear.native_ops()
        self.ops.decide()
        # bfloat16 rows of a prefill: bfloat16 products of the weight paired per call
        self.bf16_prefill = self.in_features % 2 == 0 and bf16_linear.pairs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if (self.bf16_prefill and flat.dtype == torch.bfloat16
                and flat.shape[0] > packed_linear.KERNEL_MAX_ROWS):
            y = torch.ops.pagedbackend.int8_rows_bf16(flat, self.qpacked, self.scales, self.out_features)
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if flat.dtype in WIDENED_INPUTS:   # exact in float32; the result is rounded back
            flat = flat.float()
        if self.ops.use_native_ops:
            y = torch.ops.pagedbackend.packed_linear_int8_native(flat, self.qpacked, self.scales,
                                                                 self.out_features)
        else:
            y = torch.ops.pagedbackend.packed_linear_int8(flat, self.qpacked, self.scales, self.out_features)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``q * scale`` (the reference of the kernel)."""
        return packed_linear.unpack(self.qpacked, self.out_features).float() * self.scales[:self.out_features, None]
