"""The CPU's fused mixture-of-experts kernel (``csrc/fused_moe.c``), float32.

A step's (token, slot) pairs are grouped by expert in C and each active
expert multiplies its rows once, through the packed GEMM of
``csrc/packed_gemm.c``: a decode step of one sequence reads its top-k experts
and nothing else. Expert weights are packed once, at load (``pack_gate_up``, ``pack_down``),
in float32 or, where every weight is a bfloat16 value (a checkpoint published
in bfloat16), in bfloat16 (``exact_in_bfloat16``): the kernel widens them
exactly in registers, so its sums are the float32 kernel's, bit for bit, for
half the bytes that a step bound by memory bandwidth reads.
The call is a ``torch.library`` operator, so a compiled step keeps it as one
opaque call. Each call adds the bytes of expert weights it read to
``bytes_read`` (a benchmark's count against the active-parameter floor).
"""
import ctypes
import threading
from typing import Optional

import torch

from pagedbackend.kernels import native

ACTIVATIONS = {"silu": 0, "swigluoai": 1}   # csrc/fused_moe.c's ACT_* codes



class ReadCounter:
    """Bytes of expert weights read by the kernel's calls since ``reset``."""

    def __init__(self):
        self.bytes, self.calls = 0, 0
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.bytes += count
            self.calls += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes, self.calls = 0, 0


bytes_read = ReadCounter()


def load_library() -> ctypes.CDLL:
    """The compiled kernel, declared (``native``); raises RuntimeError saying why not."""
    return native.load("fused_moe")


def exact_in_bfloat16(*weights: torch.Tensor) -> bool:
    """Whether every value of ``weights`` is a bfloat16 value (widening the
    bfloat16 copy gives it back exactly)."""
    return all(torch.equal(w, w.to(torch.bfloat16).to(w.dtype)) for w in weights)


def _pack(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """``[E, N, K]`` (N a multiple of ``cols``) as ``[E, N / cols, K, cols]`` column blocks."""
    experts, rows, k = weight.shape
    return weight.reshape(experts, rows // cols, cols, k).transpose(2, 3).contiguous()


def padded_intermediate(intermediate: int) -> int:
    """The intermediate size rounded up to whole packed column blocks."""
    cols = load_library().fused_moe_block_cols()
    return -(-intermediate // cols) * cols


def pack_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, H]`` (gate rows, then up rows) as column blocks, gate block j
    followed by up block j, each half zero-padded to ``padded_intermediate(I)`` rows."""
    cols = load_library().fused_moe_block_cols()
    experts, rows, hidden = w13.shape
    inter = rows // 2
    padded = padded_intermediate(inter)
    halves = w13.new_zeros(experts, 2, padded, hidden)
    halves[:, 0, :inter], halves[:, 1, :inter] = w13[:, :inter], w13[:, inter:]
    interleaved = halves.view(experts, 2, padded // cols, cols, hidden).transpose(1, 2)
    return _pack(interleaved.reshape(experts, 2 * padded, hidden), cols)


def pack_down(w2: torch.Tensor) -> torch.Tensor:
    """``[E, H, I]`` as column blocks of H, I zero-padded to ``padded_intermediate(I)``."""
    cols = load_library().fused_moe_block_cols()
    experts, hidden, inter = w2.shape
    padded = w2.new_zeros(experts, -(-hidden // cols) * cols, padded_intermediate(inter))
    padded[:, :hidden, :inter] = w2
    return _pack(padded, cols)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    experts, blocks, k, cols = packed.shape
    return packed.transpose(2, 3).reshape(experts, blocks * cols, k)


def unpack_gate_up(packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """The ``[E, 2I, H]`` weights held in ``pack_gate_up(w13)``."""
    cols = packed.shape[3]
    flat = _unpack(packed)
    experts, rows, hidden = flat.shape
    halves = flat.view(experts, rows // (2 * cols), 2, cols, hidden).transpose(1, 2)
    halves = halves.reshape(experts, 2, rows // 2, hidden)[:, :, :intermediate]
    return halves.reshape(experts, 2 * intermediate, hidden)


def unpack_down(packed: torch.Tensor, hidden: int, intermediate: int) -> torch.Tensor:
    """The ``[E, H, I]`` weights held in ``pack_down(w2)``."""
    return _unpack(packed)[:, :hidden, :intermediate]


_ops = torch.library.Library("pagedbackend", "FRAGMENT")
_ops.define("fused_moe_cpu(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2, Tensor? b13, "
            "Tensor? b2, int intermediate, int activation, float alpha, float limit) -> Tensor")


def _fused_moe_cpu(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
                   intermediate: int, activation: int, alpha: float, limit: float) -> torch.Tensor:
    """``x`` ``[T, H]`` float32 through the experts ``ids`` ``[T, k]`` (int32,
    outside ``[0, E)``: skipped) weighted by ``weights`` ``[T, k]`` float32."""
    tokens, hidden = x.shape
    experts = w13.shape[0]
    padded = padded_intermediate(intermediate)
    if (x.dtype != torch.float32 or ids.dtype != torch.int32 or weights.dtype != torch.float32
            or w13.dtype not in (torch.float32, torch.bfloat16) or w2.dtype != w13.dtype
            or ids.shape != weights.shape or ids.shape[0] != tokens or w13.shape[2] != hidden
            or w13.shape[1] * w13.shape[3] != 2 * padded or w2.shape[2] != padded):
        raise ValueError(f"fused_moe_cpu: float32 x [T, {w13.shape[2]}], int32 ids and float32 weights "
                         f"[T, k] expected, experts float32 or bfloat16 (both alike); got x {x.dtype} "
                         f"{tuple(x.shape)}, ids {ids.dtype} {tuple(ids.shape)}, weights {weights.dtype} "
                         f"{tuple(weights.shape)}, experts {w13.dtype} and {w2.dtype}")
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    out = x.new_empty((tokens, hidden))
    read = ctypes.c_longlong(0)
    status = load_library().fused_moe(
        x.data_ptr(), tokens, hidden, intermediate, ids.data_ptr(), weights.data_ptr(), ids.shape[1],
        experts, w13.data_ptr(), w2.data_ptr(), None if b13 is None else b13.data_ptr(),
        None if b2 is None else b2.data_ptr(), activation, alpha, limit, out.data_ptr(),
        torch.get_num_threads(), ctypes.byref(read), int(w13.dtype == torch.bfloat16))
    if status:
        raise MemoryError("fused_moe_cpu: no memory for the step's scratch rows")
    bytes_read.add(read.value)
    return out


_ops.impl("fused_moe_cpu", _fused_moe_cpu, "CPU")


@torch.library.register_fake("pagedbackend::fused_moe_cpu")
def _fused_moe_cpu_fake(x, ids, weights, w13, w2, b13, b2, intermediate, activation, alpha, limit):
    return x.new_empty(x.shape)


def fused_moe_cpu(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
                  intermediate: int, activation: str = "silu", alpha: float = 1.702,
                  limit: float = 7.0) -> torch.Tensor:
    """The experts' weighted sum for every token of ``x`` ``[T, H]``: ``w13``
    packed by ``pack_gate_up`` from ``[E, 2I, H]`` (gate rows, then up rows),
    ``w2`` by ``pack_down`` from ``[E, H, I]``, both float32 or both bfloat16; biases ``[E, 2I]`` and
    ``[E, H]`` (unpacked) or None."""
    return torch.ops.pagedbackend.fused_moe_cpu(x, ids, weights, w13, w2, b13, b2, intermediate,
                                                ACTIVATIONS[activation], alpha, limit)
