"""Triton-lang kernels for the paged KV cache, each with a torch reference twin.

``import kernels`` stays cheap: the kernel modules (and with them ``triton``)
load on first use, through :func:`get_attention_ops` or attribute access.
"""
import importlib
import os
from typing import Callable, Tuple, Union

import torch

# Without a GPU the Triton-lang kernels run through the interpreter, which must
# be chosen before `triton` is imported anywhere in the process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ("triton", "torch", "auto")

_LAZY = {
    "write_kv": "kv_write",
    "write_kv_ref": "kv_write",
    "paged_attention": "paged_attention",
    "paged_attention_ref": "paged_attention",
}

__all__ = ["BACKENDS", "get_attention_ops", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_attention_ops(backend: str, device: Union[str, torch.device]) -> Tuple[Callable, Callable]:
    """Return ``(write_kv_fn, paged_attention_fn)`` for ``backend``.

    ``"triton"``: the Triton-lang kernels (interpreted on CPU tensors, slow);
    ``"torch"``: the reference twins; ``"auto"``: triton when ``device`` is
    CUDA, the torch twins otherwise.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend == "triton":
        return __getattr__("write_kv"), __getattr__("paged_attention")
    return __getattr__("write_kv_ref"), __getattr__("paged_attention_ref")
