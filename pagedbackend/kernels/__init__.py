"""Every kernel of the package: the Triton-lang kernels for the paged KV
cache, each with a torch reference twin, and the C kernels of the CPU path
(``csrc/``, built and loaded by ``native``).

Importing it stays cheap: the kernel modules (and with them ``triton``) load
on first use, through :func:`get_attention_ops` or attribute access.
"""
import importlib
import os
from typing import Callable, NamedTuple, Optional, Union

import torch


def interpret_without_gpu() -> None:
    """Without a GPU the Triton-lang kernels run through Triton's interpreter,
    which ``triton.jit`` picks from ``TRITON_INTERPRET`` when a kernel is
    defined: the kernel modules call this before they define theirs, so only
    a process that loads them gets the setting (one that already chose keeps
    its own)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


BACKENDS = ("triton", "torch", "sdpa", "auto")

_LAZY = {
    "write_kv": "kv_write",
    "write_kv_ref": "kv_write",
    "paged_attention": "paged_attention",
    "paged_attention_ref": "paged_attention",
    "plan_paged_attention": "paged_attention",
    "plan_paged_attention_ref": "paged_attention",
    "write_kv_sdpa": "sdpa_attention",
    "sdpa_attention": "sdpa_attention",
    "plan_sdpa_attention": "sdpa_attention",
    "sdpa_forward": "sdpa_attention",
    "decode_step": "sdpa_attention",
}

__all__ = ["AttentionOps", "BACKENDS", "get_attention_ops", *_LAZY]


class AttentionOps(NamedTuple):
    """One backend's kernels: ``write_kv(k, v, k_cache, v_cache, slots)``,
    ``attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
    scale=, plan=, window=, sinks=)`` and ``plan(cu_seqlens_q, seq_lens, *,
    block_tables, slot_mapping, block_size, num_heads, num_kv_heads, device,
    window)``, which lays out a step once, from host copies of its metadata,
    for every layer of one sliding window (None: full attention).
    ``fused``: the backend's own write-then-attend, when it has one;
    ``step``: ``(plan, kv_caches)`` -> a faster write-then-attend for every
    layer of that step, or None (see ``sdpa_attention.decode_step``).
    ``graphs``: a decode step's launches depend only on its shapes (its
    plan's tensors are fixed, the kernels read every length on the device),
    so the step can be recorded once in a CUDA graph and replayed."""
    write_kv: Callable
    attention: Callable
    plan: Callable
    fused: Optional[Callable] = None
    step: Optional[Callable] = None
    graphs: bool = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                plan, window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One layer's attention: store the step's K/V, then attend over the
        cache (its last ``window`` positions per query, when set; ``sinks``:
        a logit per head in each softmax, with no value, when given)."""
        if self.fused is not None:
            return self.fused(q, k, v, k_cache, v_cache, slot_mapping, block_tables, cu_seqlens_q,
                              seq_lens, scale, plan, window, sinks)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return self.attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                              scale=scale, plan=plan, window=window, sinks=sinks)


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_attention_ops(backend: str, device: Union[str, torch.device]) -> AttentionOps:
    """The kernels of ``backend``: ``"triton"`` (the Triton-lang kernels,
    interpreted on CPU tensors, slow), ``"torch"`` (the reference twins),
    ``"sdpa"`` (gather once per step, then scaled_dot_product_attention: the
    fast path on CPU) or ``"auto"`` (triton when ``device`` is CUDA, sdpa
    otherwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "sdpa"
    if backend == "triton":
        return AttentionOps(__getattr__("write_kv"), __getattr__("paged_attention"),
                            __getattr__("plan_paged_attention"), graphs=True)
    if backend == "sdpa":
        return AttentionOps(__getattr__("write_kv_sdpa"), __getattr__("sdpa_attention"),
                            __getattr__("plan_sdpa_attention"), __getattr__("sdpa_forward"),
                            __getattr__("decode_step"))
    return AttentionOps(__getattr__("write_kv_ref"), __getattr__("paged_attention_ref"),
                        __getattr__("plan_paged_attention_ref"))
