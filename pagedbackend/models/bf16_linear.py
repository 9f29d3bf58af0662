"""bfloat16 linear layers on CPU: bfloat16 x bfloat16 products summed in float32.

A model run in bfloat16 (``dtype="bfloat16"``, or ``"auto"`` for a bfloat16
checkpoint on a CPU that multiplies bfloat16 natively) multiplies its
bfloat16 activations by its bfloat16 weights. ``kernels/csrc/bf16_gemm.c``
multiplies them, holding one copy of each weight:

- with AVX512-BF16 and no tiles (AMD Zen 4, Intel Cooper Lake), in the
  kernel's paired layout (``pair``: each output's k two by two, as
  ``vdpbf16ps`` takes them), at every row count: at Llama-3.2-1B's widths
  on a Zen 4 it ran 32-row steps at 384-443 GFLOP/s where torch's GEMM
  (oneDNN) on the loaded layout ran 294-319, and matched it at 128-2048 rows;
- with AMX-BF16 tiles (Sapphire and Emerald Rapids), as loaded (row-major
  ``[N, K]``): the tiles up to ``AMX_MAX_ROWS`` rows, torch's GEMM above
  (long prefills);
- elsewhere (widened FMAs, or an odd K), as loaded: the kernel up to
  ``DOT_MAX_ROWS`` rows, torch's GEMM above.

Measured per shape, paired: BENCHMARKS.md, "cpu_kernels" (``bf16`` rows).

The call is a ``torch.library`` operator, so a compiled step keeps it as one
opaque call, as it keeps torch's own GEMM.
"""
import ctypes
import threading
from typing import Optional

import torch
from torch import nn

from pagedbackend.kernels import hugepages, native, packed_linear

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
            library.bf16_gemm_paired.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
            library.bf16_gemm_paired.restype = ctypes.c_int
            library.bf16_gemm_paired_available.restype = ctypes.c_int
            library.bf16_gemm_set_amx_rows(AMX_MIN_ROWS)
            _library = library
    return library


def isa() -> str:
    """Which products the kernel uses here: ``amx``, ``avx512_bf16`` or ``fma`` (widened)."""
    return ("fma", "avx512_bf16", "amx")[load_library().bf16_gemm_isa()]


def kernel_max_rows() -> int:
    """Rows up to which the kernel serves a step here (torch's GEMM above)."""
    return AMX_MAX_ROWS if isa() == "amx" else DOT_MAX_ROWS


def pairs() -> bool:
    """Whether layers hold their weights paired here (AVX512-BF16 without tiles)."""
    library = load_library()
    return bool(library.bf16_gemm_paired_available()) and library.bf16_gemm_isa() == 1


PAIR = 16   # outputs per block of the paired layout


def pair(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` (K even) as ``[ceil(N / 16), K / 2, 16, 2]``: each block of 16
    outputs, two k at a time (rows past N zero)."""
    n, k = weight.shape
    padded = -(-n // PAIR) * PAIR
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    blocks = weight.reshape(padded // PAIR, PAIR, k // 2, 2).transpose(1, 2)
    if weight.device.type != "cpu":
        return blocks.contiguous()
    paired = hugepages.empty(blocks.shape, weight.dtype)   # streamed every step: on 2 MiB pages
    return paired.copy_(blocks)


def unpair(paired: torch.Tensor, out_features: int) -> torch.Tensor:
    """``pair``'s inverse: the ``[N, K]`` weight."""
    blocks, half, _, _ = paired.shape
    return paired.transpose(1, 2).reshape(blocks * PAIR, half * 2)[:out_features]


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


_ops.define("bf16_linear_paired(Tensor x, Tensor paired, int out_features) -> Tensor")


def _bf16_linear_paired_cpu(x: torch.Tensor, paired: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W^T`` for 2-D bfloat16 ``x`` and ``W`` held as ``pair(W)``, in bfloat16 (float32 sums)."""
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or paired.shape[1] * 2 != k:
        raise ValueError(f"bf16_linear takes bfloat16 [rows, {paired.shape[1] * 2}] inputs for this "
                         f"weight; got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    y = x.new_empty((rows, out_features))
    library = _library or load_library()
    if library.bf16_gemm_paired(x.data_ptr(), paired.data_ptr(), y.data_ptr(), 1, rows, k, out_features,
                                torch.get_num_threads()):
        raise RuntimeError("bf16_linear: this build has no paired kernel")
    return y


_ops.impl("bf16_linear_paired", _bf16_linear_paired_cpu, "CPU")


@torch.library.register_fake("pagedbackend::bf16_linear_paired")
def _bf16_linear_paired_fake(x: torch.Tensor, paired: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


_ops.define("int8_rows_bf16(Tensor x, Tensor qpacked, Tensor scales, int out_features) -> Tensor")


def _int8_rows_bf16_cpu(x: torch.Tensor, qpacked: torch.Tensor, scales: torch.Tensor,
                        out_features: int) -> torch.Tensor:
    """``x @ (q * scales)^T`` in float32 for bfloat16 rows ``x`` and the int8
    weight ``q`` held as ``packed_linear.pack(q)``: q's values are exact in
    bfloat16, so it is paired for this call and multiplied by the paired
    kernel (exact products, float32 sums), then each output scaled. For the
    long steps (prefills) of a bfloat16 model's int8 layers: the pairing
    costs a pass over the weight, the products run at the bfloat16 rate."""
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or qpacked.shape[1] != k or k % 2:
        raise ValueError(f"int8_rows_bf16 takes bfloat16 [rows, {qpacked.shape[1]}] inputs (an even width) "
                         f"for this weight; got {x.dtype} {tuple(x.shape)}")
    paired = pair(packed_linear.unpack(qpacked, out_features).to(torch.bfloat16))
    x = x.contiguous()
    y = torch.empty((rows, out_features), dtype=torch.float32)
    library = _library or load_library()
    if rows and library.bf16_gemm_paired(x.data_ptr(), paired.data_ptr(), y.data_ptr(), 0, rows, k, out_features,
                                         torch.get_num_threads()):
        raise RuntimeError("int8_rows_bf16: this build has no paired kernel")
    return y.mul_(scales[:out_features])


_ops.impl("int8_rows_bf16", _int8_rows_bf16_cpu, "CPU")


@torch.library.register_fake("pagedbackend::int8_rows_bf16")
def _int8_rows_bf16_fake(x: torch.Tensor, qpacked: torch.Tensor, scales: torch.Tensor,
                         out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32)


class Bf16Linear(nn.Module):
    """``x W^T`` (no bias: the caller adds it) for bfloat16 x and W: W held
    paired where ``pairs()`` (every row count in the kernel), else as loaded."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"Bf16Linear takes a 2-D bfloat16 CPU weight; got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.paired = self.in_features % 2 == 0 and pairs()
        self.register_buffer("weight", pair(weight.detach()) if self.paired else weight.detach().contiguous())
        self.max_rows = kernel_max_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.paired:
            y = torch.ops.pagedbackend.bf16_linear_paired(flat, self.weight, self.out_features)
        else:
            y = torch.ops.pagedbackend.bf16_linear(flat, self.weight, self.max_rows)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (same name as the quantised layers' for tests)."""
        weight = unpair(self.weight, self.out_features) if self.paired else self.weight
        return weight.float()
