"""float32 linear layers with weights packed for decode-sized steps (CPU).

A decode step multiplies a few dozen rows by every weight matrix of the model.
At 4 to 64 rows torch's ``F.linear`` (MKL sgemm) reaches a fraction of the
machine's peak: each call repacks the weight and the weight streams from
memory while the cores wait. ``csrc/packed_gemm.c`` reads a weight
packed once, at load, in blocks of output columns, keeps each block in L2
while every chunk of rows multiplies it, prefetches the next one, and splits
the blocks over torch's OpenMP threads (BENCHMARKS.md, "cpu_kernels"). It is
compiled on this machine at first use and loaded by ``native``, which also
says whether it can serve (``native.unavailable``). Above
``KERNEL_MAX_ROWS`` rows (long prefills) oneDNN's GEMM wins even after
unpacking the weight for the call (``onednn_linear.dense_linear``; torch's
``F.linear`` where torch lacks oneDNN), so it is used there and one packed
copy serves every step.

The call is a ``torch.library`` operator, so a compiled step keeps it in its
graph as an opaque call, as it keeps torch's own GEMM. Two versions of each
operator do the same: ``packed_linear`` (and ``packed_linear_int8``) has a
Python kernel that calls the C function through ctypes; ``packed_linear_native``
(and ``packed_linear_int8_native``) has a C++ kernel
(``csrc/packed_ops.cpp``, built at first use against the installed
torch) that calls the same C function. A compiled step calls the C++ kernel
straight from its C++ wrapper, without entering Python: a step makes 121 such
calls for SmolLM2. The layers use the C++ operators wherever they build
(``EngineConfig.native_ops`` false keeps the Python ones).

A weight whose values are all bfloat16 values (a bfloat16 checkpoint) is held
in bfloat16, widened exactly in registers: the float32 sums bit for bit, from
half the bytes (BENCHMARKS.md, "moe").
"""
import ctypes
import logging
import threading
from typing import Optional

import torch
from torch import nn

from pagedbackend.config import EngineConfig
from pagedbackend.kernels import native, onednn_linear
from pagedbackend.kernels.moe_cpu import exact_in_bfloat16

logger = logging.getLogger("pagedbackend")

# Rows above which torch's GEMM on a weight unpacked for the call is the
# faster of the two: over SmolLM2's 120 layer weights the kernel is faster up
# to 640 rows and slower from 768 (BENCHMARKS.md, "cpu_kernels",
# KERNEL_MAX_ROWS).
KERNEL_MAX_ROWS = 640

# Rows up to which quantization=w8a8's matmul runs w8a8_gemm.c's VNNI kernel
# rather than torch._int_mm (the C++ operator decides per call).
W8A8_KERNEL_MAX_ROWS = 16

# int8 steps of at least INT8_BF16_ROWS rows can multiply in bfloat16
# (vdpbf16ps) where the CPU has AVX512_BF16: their rows of x are rounded to
# bfloat16, the int8 weights are exact in it. Over SmolLM2's int8 weights the
# path is faster than float32 rows from 9 rows on an AMD Zen 4 machine, but
# slower at every row count on an Intel Emerald Rapids one, where vdpbf16ps
# issues slower than FMAs and the conversions cost more than the bfloat16
# products gain (BENCHMARKS.md, "quant_kernels"). So it is on by default on
# AMD CPUs only; ``EngineConfig.int8_bf16`` turns it on or off on any CPU.
INT8_BF16_ROWS = 9


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``; '' where unknown)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def int8_bf16_rows(setting: Optional[bool]) -> int:
    """From how many rows int8 steps take the bfloat16 path (0: none), for
    ``EngineConfig.int8_bf16`` (None: by the CPU's vendor)."""
    if setting is None:
        setting = cpu_vendor() == "AuthenticAMD"
    return INT8_BF16_ROWS if setting else 0


class NativeOps:
    """What this process knows of its native operators: whether layers call
    the C++ ones, why they or w8a8's kernel are not used, the int8 bfloat16
    setting. One per process (``native_ops()``), made at first use.

    Both settings are process-wide (compiled steps call the operators by
    name; the bfloat16 row count is one global of the C kernel), so the first
    engine whose layers use them sets them (``configure``) and a later engine
    asking otherwise is served the same, with a warning. Until then they are
    ``EngineConfig``'s defaults."""

    def __init__(self):
        # (native_ops, int8_bf16) in force; fixed by the first configure or packed layer
        self.settings = (EngineConfig.native_ops, EngineConfig.int8_bf16)
        self.fixed = False
        self.int8_bf16_min_rows = int8_bf16_rows(EngineConfig.int8_bf16)   # reads /proc/cpuinfo
        self.gemm = self.gemm_bf16 = self.gemm_i8 = None   # the kernel's functions, once loaded
        self.use_native_ops: Optional[bool] = None   # whether layers call the C++ operators (decided at first layer)
        self.native_ops_failure: Optional[str] = None   # why they could not be built, when they could not
        self.w8a8_kernel_failure: Optional[str] = None   # why w8a8's small-step kernel is not used, when it is not
        self.w8a8_kernel = None   # w8a8_gemm.c's build, where it has the VNNI kernel
        self.w8a8_library = None   # that build, wherever it loads
        self.registered = False   # the C++ operators have their kernels and fakes
        self.register_lock, self.decide_lock = threading.Lock(), threading.Lock()

    def configure(self, native_ops: bool, int8_bf16: Optional[bool]) -> None:
        """An engine's ``EngineConfig.native_ops`` and ``int8_bf16``, taken
        when nothing has fixed them yet (else a warning if they differ)."""
        with self.decide_lock:
            wanted = (native_ops, int8_bf16)
            if not self.fixed:
                self.settings, self.fixed = wanted, True
                rows = int8_bf16_rows(int8_bf16)
                if rows != self.int8_bf16_min_rows:
                    self.int8_bf16_min_rows = rows
                    if self.gemm is not None:   # the kernel is loaded already: hand it over now
                        load_library().packed_gemm_set_bf16_rows(rows)
            elif wanted != self.settings:
                logger.warning("pagedbackend: this process's packed layers run with native_ops=%s, int8_bf16=%s "
                               "(set by its first engine, one setting per process); this engine's "
                               "native_ops=%s, int8_bf16=%s are not applied", *self.settings, *wanted)

    def decide(self) -> bool:
        """Whether layers call the C++ operators: yes where they build, unless
        the setting (``configure``) says no. Decided once, at the first packed layer."""
        with self.decide_lock:
            self.fixed = True
            if self.use_native_ops is None:
                use = False
                if self.settings[0]:
                    try:
                        load_native_ops()
                        use = True
                    except RuntimeError as exc:
                        self.native_ops_failure = str(exc)
                self.use_native_ops = use
        return self.use_native_ops


_state: Optional[NativeOps] = None
_state_lock = threading.Lock()


def native_ops() -> NativeOps:
    """This process's ``NativeOps``, made on the first call."""
    global _state
    if _state is None:
        with _state_lock:
            if _state is None:
                _state = NativeOps()
    return _state


def load_library() -> ctypes.CDLL:
    """The compiled kernel (``csrc/packed_gemm.c``), its bfloat16 row setting
    handed over; raises RuntimeError saying why not."""
    state = native_ops()
    library = native.load("packed_gemm")
    if state.gemm is None:
        hand_over_settings(library)
        state.gemm, state.gemm_bf16, state.gemm_i8 = (library.packed_gemm, library.packed_gemm_bf16,
                                                      library.packed_gemm_i8)
    return library


def hand_over_settings(library: ctypes.CDLL) -> ctypes.CDLL:
    """Give a build of ``packed_gemm.c`` (declared by ``native``) this
    process's int8 bfloat16 row setting, where it has one (builds of older trees lack it)."""
    if hasattr(library, "packed_gemm_set_bf16_rows"):
        library.packed_gemm_set_bf16_rows(native_ops().int8_bf16_min_rows)
    return library


def int8_bf16_available() -> bool:
    """Whether this machine's build of the kernel has the bfloat16 path of
    int8 steps (AVX512_BF16; not where ``ATEN_CPU_CAPABILITY`` narrows the
    instruction set)."""
    return bool(load_library().packed_gemm_has_bf16())


def int8_rounds_to_bf16(rows: int) -> bool:
    """Whether an int8 step of ``rows`` rows through the packed kernel rounds
    its inputs to bfloat16 (the path there, at least its rows, and no more than
    ``KERNEL_MAX_ROWS``)."""
    least = load_library().packed_gemm_set_bf16_rows(-1)
    return 0 < least <= rows <= KERNEL_MAX_ROWS


def set_int8_bf16_rows(rows: int) -> int:
    """int8 steps of at least ``rows`` rows take the bfloat16 path from now on
    (0: none; for comparisons), through the C++ and the Python operators alike;
    the setting now (0 where the path is not built)."""
    return load_library().packed_gemm_set_bf16_rows(max(0, int(rows)))


def load_native_ops() -> None:
    """Build and register the C++ operators (``packed_linear_native`` and
    ``packed_linear_int8_native``) and hand them the C kernels; raises
    RuntimeError saying why they cannot be."""
    state = native_ops()
    library = load_library()
    ops = native.load_op_library("packed_ops")
    with state.register_lock:
        if not state.registered:
            ops.packed_ops_set_kernels(ctypes.cast(library.packed_gemm, ctypes.c_void_p),
                                       ctypes.cast(library.packed_gemm_bf16, ctypes.c_void_p),
                                       ctypes.cast(library.packed_gemm_i8, ctypes.c_void_p), KERNEL_MAX_ROWS)
            ops.packed_ops_set_prefill(int(onednn_linear.unavailable() is None))
            torch.library.register_fake("pagedbackend::packed_linear_native")(_packed_linear_fake)
            torch.library.register_fake("pagedbackend::packed_linear_int8_native")(_packed_linear_int8_fake)
            torch.library.register_fake("pagedbackend::w8a8_linear_native")(_w8a8_linear_fake)
            _hand_over_w8a8_kernel(ops)
            state.registered = True


def _hand_over_w8a8_kernel(ops: ctypes.CDLL) -> None:
    """Give the C++ w8a8 operator the VNNI kernel, where it builds and this CPU
    has AVX-512 VNNI; otherwise every step goes to torch._int_mm."""
    state = native_ops()
    try:
        library = native.load("w8a8_gemm")
        state.w8a8_library = library   # its w8a8_rescale serves every CPU
        if not library.w8a8_gemm_available():
            raise RuntimeError("w8a8_gemm.c was built without AVX-512 VNNI (this CPU, or "
                               "ATEN_CPU_CAPABILITY, lacks it)")
        state.w8a8_kernel = library
    except RuntimeError as exc:
        state.w8a8_kernel_failure = str(exc)
    set_w8a8_kernel_rows(W8A8_KERNEL_MAX_ROWS, ops)


def set_w8a8_kernel_rows(rows: int, ops: Optional[ctypes.CDLL] = None) -> int:
    """Steps of up to ``rows`` rows take the VNNI kernel from now on (0: none,
    for comparisons); the number it was set to, capped by the kernel's own."""
    ops = ops or native.load_op_library("packed_ops")
    kernel, library = native_ops().w8a8_kernel, native_ops().w8a8_library
    rows = max(0, min(rows, kernel.w8a8_gemm_max_rows() if kernel is not None else 0))
    rescale = ctypes.cast(library.w8a8_rescale, ctypes.c_void_p) if library is not None else None
    kernel = ctypes.cast(kernel.w8a8_gemm, ctypes.c_void_p) if kernel is not None else None
    ops.packed_ops_set_w8a8(kernel, rescale, rows)
    return rows


def _w8a8_linear_fake(a, row_scales, qweight, colsum, scales):
    return a.new_empty((a.shape[0], qweight.shape[0]), dtype=torch.float32)


def _decide_native_ops() -> bool:
    """``native_ops().decide()`` (the name callers used before ``NativeOps``)."""
    return native_ops().decide()


def block_cols() -> int:
    """Output columns per packed block (32 with AVX-512, 16 with AVX2)."""
    return load_library().packed_gemm_block_cols()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as ``[ceil(N / cols), K, cols]`` column blocks (zero-padded)."""
    cols = block_cols()
    rows, k = weight.shape
    blocks = -(-rows // cols)
    padded = weight.new_zeros(blocks * cols, k)
    padded[:rows] = weight
    return padded.view(blocks, cols, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The ``[N, K]`` weight held in ``packed`` (the inverse of ``pack``)."""
    blocks, k, cols = packed.shape
    return packed.transpose(1, 2).reshape(blocks * cols, k)[:out_features]


# A plain ``torch.library`` definition: about half the per-call cost of
# ``torch.library.custom_op``'s wrapper.
_ops = torch.library.Library("pagedbackend", "FRAGMENT")
_ops.define("packed_linear(Tensor x, Tensor packed, int out_features) -> Tensor")


def _packed_linear_cpu(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W^T`` for a 2-D float32 ``x`` and ``packed = pack(W)`` (W float32 or bfloat16)."""
    rows, k = x.shape
    if x.dtype != torch.float32 or packed.dtype not in (torch.float32, torch.bfloat16) or packed.shape[1] != k:
        raise ValueError(f"packed_linear takes float32 [rows, {packed.shape[1]}] inputs for this "
                         f"weight; got {x.dtype} {tuple(x.shape)}")
    if rows > KERNEL_MAX_ROWS:   # a prefill: oneDNN's GEMM on the weight unpacked for this call
        return onednn_linear.dense_linear(x, unpack(packed, out_features).float())
    x = x.contiguous()
    y = x.new_empty((rows, out_features))
    if rows:
        state = native_ops()
        state.gemm or load_library()   # loads the kernel's functions once
        gemm = state.gemm_bf16 if packed.dtype == torch.bfloat16 else state.gemm
        gemm(x.data_ptr(), packed.data_ptr(), y.data_ptr(), rows, k, out_features,
             torch.get_num_threads())
    return y


_ops.impl("packed_linear", _packed_linear_cpu, "CPU")


@torch.library.register_fake("pagedbackend::packed_linear")
def _packed_linear_fake(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


class PackedLinear(nn.Module):
    """``x W^T`` (no bias: the caller adds it) with W held packed (``pack``):
    in bfloat16 where all of W's values are bfloat16 values (the same sums
    from half the bytes), else in float32."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear takes a 2-D float32 CPU weight; got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.register_buffer("packed", pack(weight.to(torch.bfloat16) if exact_in_bfloat16(weight) else weight))
        self.ops = native_ops()
        self.ops.decide()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.ops.use_native_ops:
            y = torch.ops.pagedbackend.packed_linear_native(flat, self.packed, self.out_features)
        else:
            y = torch.ops.pagedbackend.packed_linear(flat, self.packed, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The ``[N, K]`` float32 weight (same name as the quantised layers' for tests)."""
        return unpack(self.packed, self.out_features).float()


# ---------------------------------------------------------------- int8

_ops.define("packed_linear_int8(Tensor x, Tensor qpacked, Tensor scales, int out_features) -> Tensor")


def _packed_linear_int8_cpu(x: torch.Tensor, qpacked: torch.Tensor, scales: torch.Tensor,
                            out_features: int) -> torch.Tensor:
    """``x @ (q * scales)^T`` for a 2-D float32 ``x``, ``qpacked = pack(q)`` of int8
    ``q`` and ``scales`` per output column, zero-padded to the packed width."""
    rows, k = x.shape
    blocks, _, cols = qpacked.shape
    if (x.dtype != torch.float32 or qpacked.dtype != torch.int8 or qpacked.shape[1] != k
            or scales.dtype != torch.float32 or scales.numel() != blocks * cols):
        raise ValueError(f"packed_linear_int8 takes float32 [rows, {qpacked.shape[1]}] inputs for "
                         f"this weight; got {x.dtype} {tuple(x.shape)}")
    if rows > KERNEL_MAX_ROWS:   # a prefill: oneDNN's GEMM on the weight widened for this call
        weight = unpack(qpacked, out_features).float() * scales[:out_features, None]
        return onednn_linear.dense_linear(x, weight)
    x = x.contiguous()
    y = x.new_empty((rows, out_features))
    if rows:
        gemm = native_ops().gemm_i8 or load_library().packed_gemm_i8
        if gemm(x.data_ptr(), qpacked.data_ptr(), scales.data_ptr(), y.data_ptr(), rows, k,
                out_features, torch.get_num_threads()):
            raise MemoryError("packed_linear_int8: no memory for a widened weight block")
    return y


_ops.impl("packed_linear_int8", _packed_linear_int8_cpu, "CPU")


@torch.library.register_fake("pagedbackend::packed_linear_int8")
def _packed_linear_int8_fake(x, qpacked, scales, out_features):
    return x.new_empty((x.shape[0], out_features))
