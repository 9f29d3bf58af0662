"""w8a8: the int8 weights of ``int8``, and the activations rounded to int8
too, per row at each matmul (symmetric, dynamic: ``x ~= a * t`` with
``t = max|x_row| / 127``). ``torch._int_mm`` multiplies the two in int32
(oneDNN's int8 GEMM: VNNI dot products where the CPU has them), and
``(a q^T) * t * s`` gives the float32 result; the C++ operator runs
``w8a8_gemm.c``'s VNNI kernel for a few rows instead. The int32 sums are
exact, so a row's result does not depend on how many rows share the step.
Before rounding, the float model is smoothed (``quant.smooth``).
"""
from typing import Tuple

import torch
from torch import nn

from pagedbackend.kernels import packed_linear
from pagedbackend.quant.int8 import quantize_int8


def quantize_rows_int8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[M, K]``, float32 scales ``[M, 1]``) with ``x ~= a * scale``,
    one symmetric scale per row (a row of zeros gets zeros)."""
    scales = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / 127.0
    return torch.round(x / scales).clamp(-127, 127).to(torch.int8), scales


class W8A8Linear(nn.Module):
    """``x W^T`` (no bias) with W int8 per output channel (``quantize_int8``)
    and x rounded to int8 per row at each call, multiplied in int32."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"W8A8Linear takes a 2-D CPU weight; got {tuple(weight.shape)} "
                             f"on {weight.device}")
        q, scales = quantize_int8(weight)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.contiguous())
        # 128 * sum_k q[n, k]: the VNNI kernel's inputs are a + 128
        self.register_buffer("colsum", 128 * q.sum(dim=1, dtype=torch.int32))
        self.native = packed_linear.native_ops().decide()   # False where the C++ operators cannot build

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        a, row_scales = quantize_rows_int8(flat)
        if self.native:   # the C++ operator: the VNNI kernel for a few rows, else torch._int_mm
            y = torch.ops.pagedbackend.w8a8_linear_native(a, row_scales, self.qweight, self.colsum,
                                                          self.scales)
        else:
            y = torch._int_mm(a, self.qweight.t()).float() * row_scales * self.scales
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``q * scale`` (the activations are rounded at each call)."""
        return self.qweight.float() * self.scales[:, None]
