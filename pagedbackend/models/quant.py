"""Weight-only quantised linear layers: int8 per output channel, int4 per group.

Only the weights are stored narrow; they are widened inside torch's CPU
kernels. The activations (residual stream, norms, attention) stay float32, but
enter these two kernels as bfloat16 and leave them as float32: torch 2.13's CPU
kernels are vectorised for bfloat16 inputs only, and take a scalar path 10-100x
slower than fp32 ``F.linear`` for float32 inputs (``loadtest.bench
quant_kernels``; ``act_dtype=torch.float32`` keeps that path for comparison).

- int8: ``w ~= q * s`` with ``q`` int8 and one scale ``s`` per output row
  (symmetric, ``s = max|w_row| / 127``); ``torch.ops.aten._weight_int8pack_mm``
  up to ``INT8_KERNEL_MAX_ROWS`` rows. That kernel costs about one pass over
  the weight per row of x, so larger steps (prefills) compute
  ``(x q^T) * s`` with ``F.linear`` on ``q`` widened to float32 instead.
  (These are the torch-backend layers; on CPU the engine serves int8 through
  ``models.packed_linear``'s ``PackedInt8Linear``, whose steps of 9 rows or
  more round x to bfloat16 on AMD CPUs with AVX512_BF16, where that is faster.)
- int4: ``w ~= (q - 8) * s + z`` with ``q`` in 0..15 and a scale ``s`` and
  offset ``z`` per row and group of ``group_size`` input columns (asymmetric
  min/max); ``torch.ops.aten._weight_int4pack_mm_for_cpu`` for every step
  (widening the weight in torch ops costs more than the kernel at any size
  measured). GGUF's Q4_1 (``w = d * q + m`` per 32 columns) is this format
  with ``s = d`` and ``z = m + 8 d``, so the default model keeps its shipped
  4-bit values (``gguf_q4``); ``s`` and ``z`` are held in bfloat16, as the
  kernel takes them in the input's dtype.
- w8a8: the int8 weights of int8, and the activations rounded to int8 too,
  per row at each matmul (symmetric, dynamic: ``x ~= a * t`` with
  ``t = max|x_row| / 127``). ``torch._int_mm`` multiplies the two in int32
  (oneDNN's int8 GEMM: VNNI dot products where the CPU has them), and
  ``(a q^T) * t * s`` gives the float32 result. The int32 sums are exact, so
  a row's result does not depend on how many rows share the step.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATION_MODES = ("none", "int8", "int4", "w8a8")
INT4_GROUP_SIZES = (32, 64, 128, 256)
# Rows of x up to which the int8 kernel beats widening q for F.linear (about
# even between 32 and 128 rows here; loadtest.bench quant_kernels).
INT8_KERNEL_MAX_ROWS = 64


def quantize_int8(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[N, K]``, float32 scales ``[N]``) with ``weight ~= q * scale[:, None]``."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        from pagedbackend.models import packed_linear
        self.native = packed_linear._decide_native_ops()   # False where the C++ operators cannot build

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


def quantized_linear(weight: torch.Tensor, mode: str, group_size: int = 32,
                     int4: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> nn.Module:
    """The module for ``mode`` (int8, int4 or w8a8); ``int4`` gives ready (q, scale, minimum)."""
    if mode == "int8":
        return Int8Linear(weight)
    if mode == "w8a8":
        return W8A8Linear(weight)
    if mode == "int4":
        return Int4Linear(*int4) if int4 is not None else Int4Linear.from_float(weight, group_size)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {mode!r}")


def quantize_model(model: nn.Module, config, device: torch.device, packed: bool = False) -> None:
    """Apply ``config.quantization`` to a loaded model; the default model's
    int4 comes from its GGUF's Q4_1 blocks (cached once beside the prepared
    model). ``packed``: int8 layers through the packed C kernel
    (``models.packed_linear.PackedInt8Linear``, the same int8 values)."""
    mode = config.quantization
    if device.type != "cpu":
        raise ValueError(f"quantization={mode} runs on CPU only (torch's weight-only kernels used "
                         f"here are CPU kernels); got device {device.type}: use quantization=none")
    int4_weights = None
    if mode == "int4" and config.model == "default":
        from pagedbackend.models import default_model
        from pagedbackend.models.gguf_q4 import cached_q4_1_weights
        args = model.args
        int4_weights = cached_q4_1_weights(
            default_model.gguf_path(),
            default_model.cache_root() / f"{default_model.DEFAULT_MODEL_NAME}.Q4_1-int4.safetensors",
            args.num_heads, args.num_kv_heads)
    model.quantize(mode, int4_weights, packed=packed)
