"""bfloat16 linear layers on CPU: bfloat16 x bfloat16 products summed in float32.

A model run in bfloat16 (``dtype="bfloat16"``, or ``"auto"`` for a bfloat16
checkpoint on a CPU that multiplies bfloat16 natively) multiplies its
bfloat16 activations by its bfloat16 weights. ``kernels/csrc/bf16_gemm.c``
does so on the weight as loaded (row-major ``[N, K]``, no second copy): AMX
tiles where the CPU has AMX-BF16 (Sapphire and Emerald Rapids), AVX512-BF16
dot products (``vdpbf16ps``) or widened FMAs elsewhere. torch's GEMM
(oneDNN) multiplies the same weight where it is the faster of the two: on a
CPU without tiles, above ``DOT_MAX_ROWS`` rows, and with tiles above
``AMX_MAX_ROWS`` (long prefills). Measured per shape, paired, at Llama-3.2-1B's
widths: BENCHMARKS.md, "cpu_kernels" (``bf16`` rows).

The call is a ``torch.library`` operator, so a compiled step keeps it as one
opaque call, as it keeps torch's own GEMM.
"""
import ctypes
import threading
from typing import Optional

import torch
from torch import nn

from pagedbackend.kernels import native

# Rows up to which the kernel's tiles serve a step where the CPU has AMX-BF16
# (oneDNN's GEMM above: prefills). Below AMX_MIN_ROWS rows the dot products
# read the weight faster than the tiles do.
AMX_MAX_ROWS = 256
AMX_MIN_ROWS = 4
# Rows up to which the kernel's dot products serve a step where the CPU has
# no tiles (oneDNN's GEMM above).
DOT_MAX_ROWS = 4

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None


def load_library() -> ctypes.CDLL:
    """The compiled ``bf16_gemm.c``, its tiles requested; raises RuntimeError saying why not."""
    global _library
    library = native.load("bf16_gemm")
    with _lock:
        if _library is None:
            library.bf16_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
            library.bf16_gemm.restype = ctypes.c_int
            library.bf16_gemm_set_amx_rows.argtypes = [ctypes.c_int]
            library.bf16_gemm_set_amx_rows.restype = ctypes.c_int
            library.bf16_gemm_isa.restype = ctypes.c_int
            library.bf16_gemm_set_amx_rows(AMX_MIN_ROWS)
            _library = library
    return library


def isa() -> str:
    """Which products the kernel uses here: ``amx``, ``avx512_bf16`` or ``fma`` (widened)."""
    return ("fma", "avx512_bf16", "amx")[load_library().bf16_gemm_isa()]


def kernel_max_rows() -> int:
    """Rows up to which the kernel serves a step here (torch's GEMM above)."""
    return AMX_MAX_ROWS if isa() == "amx" else DOT_MAX_ROWS


def unavailable(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why the bfloat16 layers cannot serve here (None when they can)."""
    if device.type != "cpu":
        return f"bfloat16 linear layers are a CPU kernel; the model runs on {device.type}"
    if dtype != torch.bfloat16:
        return f"bfloat16 linear layers multiply bfloat16; the model's dtype is {dtype}"
    try:
        load_library()
    except RuntimeError as exc:
        return str(exc)
    return None


_ops = torch.library.Library("pagedbackend", "FRAGMENT")
_ops.define("bf16_linear(Tensor x, Tensor weight, int max_rows) -> Tensor")


def _bf16_linear_cpu(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> torch.Tensor:
    """``x @ weight^T`` for 2-D bfloat16 ``x`` and ``weight`` ``[N, K]``, in
    bfloat16 (float32 sums); the kernel up to ``max_rows`` rows, torch's GEMM above."""
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.shape[1] != k:
        raise ValueError(f"bf16_linear takes bfloat16 [rows, {weight.shape[1]}] inputs for this "
                         f"weight; got {x.dtype} {tuple(x.shape)}")
    if rows > max_rows:
        return torch.mm(x, weight.t())
    x, weight = x.contiguous(), weight.contiguous()
    y = x.new_empty((rows, weight.shape[0]))
    library = _library or load_library()
    if library.bf16_gemm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), 1, rows, k, weight.shape[0],
                         torch.get_num_threads()):
        raise MemoryError("bf16_linear: no memory for the tiles' copy of x")
    return y


_ops.impl("bf16_linear", _bf16_linear_cpu, "CPU")


@torch.library.register_fake("pagedbackend::bf16_linear")
def _bf16_linear_fake(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class Bf16Linear(nn.Module):
    """``x W^T`` (no bias: the caller adds it) for bfloat16 x and W, W held as loaded."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"Bf16Linear takes a 2-D bfloat16 CPU weight; got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().contiguous())
        self.max_rows = kernel_max_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.pagedbackend.bf16_linear(flat, self.weight, self.max_rows)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (same name as the quantised layers' for tests)."""
        return self.weight.float()
