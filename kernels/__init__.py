"""Triton-lang kernels for the paged KV cache, each with a torch reference twin.

Installed as ``pagedbackend.kernels`` (the folder stays at the top of the
repository). Importing it stays cheap: the kernel modules (and with them ``triton``)
load on first use, through :func:`get_attention_ops` or attribute access.
"""
import importlib
import os
from typing import Callable, NamedTuple, Union

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
    "plan_paged_attention": "paged_attention",
    "plan_paged_attention_ref": "paged_attention",
}

__all__ = ["AttentionOps", "BACKENDS", "get_attention_ops", *_LAZY]


class AttentionOps(NamedTuple):
    """One backend's kernels: ``write_kv(k, v, k_cache, v_cache, slots)``,
    ``attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
    scale=, plan=)`` and ``plan(cu_seqlens_q, seq_lens, num_heads,
    num_kv_heads, device)``, which lays out a step once, from host copies of
    its query layout, for every layer's ``attention`` call."""
    write_kv: Callable
    attention: Callable
    plan: Callable


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_attention_ops(backend: str, device: Union[str, torch.device]) -> AttentionOps:
    """The kernels of ``backend``: ``"triton"`` (the Triton-lang kernels,
    interpreted on CPU tensors, slow), ``"torch"`` (the reference twins) or
    ``"auto"`` (triton when ``device`` is CUDA, the torch twins otherwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend == "triton":
        return AttentionOps(__getattr__("write_kv"), __getattr__("paged_attention"),
                            __getattr__("plan_paged_attention"))
    return AttentionOps(__getattr__("write_kv_ref"), __getattr__("paged_attention_ref"),
                        __getattr__("plan_paged_attention_ref"))
