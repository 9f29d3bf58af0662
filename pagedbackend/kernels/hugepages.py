"""Large CPU tensors on transparent huge pages, where Linux offers them.

A decode step streams every weight, and every KV row its sequences read;
with 4 KiB pages that is a TLB miss every 4 KiB, and under a hypervisor each
miss walks two sets of page tables. Linux backs an anonymous range with
2 MiB pages where ``madvise(MADV_HUGEPAGE)`` asks for them (the
``transparent_hugepage`` setting "madvise", the usual default; "always"
needs no asking, "never" refuses), for pages not yet touched: so a tensor is
allocated, advised, and only then filled. torch's own ``THP_MEM_ALLOC_ENABLE``
does this for every allocation, but it is read once, when torch starts.

Where the call is refused or missing (another OS, no libc, a small tensor)
the tensor is an ordinary one: huge pages change speed, never results.
"""
import ctypes
import sys
from typing import Optional, Sequence

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14   # linux/mman.h
_madvise = None


def _libc_madvise() -> Optional[ctypes._CFuncPtr]:
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                call = ctypes.CDLL(None, use_errno=True).madvise
                call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                call.restype = ctypes.c_int
                _madvise = call
            except (OSError, AttributeError):
                pass
    return _madvise or None


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages over the whole 2 MiB pages inside ``t``'s storage
    (a CPU tensor of at least two of them); True where the kernel agreed."""
    if t.device.type != "cpu":
        return False
    storage = t.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    call = _libc_madvise()
    return call is not None and hi - lo >= HUGE_PAGE and call(lo, hi - lo, MADV_HUGEPAGE) == 0


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on CPU, advised before anything touches it."""
    t = torch.empty(tuple(shape), dtype=dtype)
    advise(t)
    return t


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros`` on CPU on huge pages (all-zero bytes: 0 in every dtype)."""
    t = empty(shape, dtype)
    if t.element_size() == 1:   # int8 and the fp8 types, as bytes
        t.view(torch.uint8).zero_()
    else:
        t.zero_()
    return t
