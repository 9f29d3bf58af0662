"""Attention over the paged KV cache: store the step's K/V, then attend.

Each layer calls one custom op, ``pagedbackend::paged_attention(q, k, v,
layer, scale)``, registered with ``torch.library`` so that ``torch.compile``
keeps the whole forward in one graph and treats the op as opaque. The op finds
the layer's KV cache, the step's metadata and the attention kernels in the
step context (``step_context``) that the model runner opens around each
forward, as vLLM's ``unified_attention`` does: the cache is never a graph
input, so the graph has no mutation to functionalise (and no cache copy), and
the metadata's per-step shapes never trigger a recompile. The context is per
thread, so tensor-parallel ranks running as threads of one process do not mix.
"""
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

KVCache = Tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, block_size, kv_heads, head_dim]


@dataclass
class AttentionMetadata:
    """The flat batch's layout, shared by every layer of one forward step.

    ``slot_mapping`` (int64 ``[num_tokens]``): cache slot of each new token;
    ``block_tables`` (int32 ``[num_seqs, max_blocks]``, 0-padded);
    ``cu_seqlens_q`` (int32 ``[num_seqs + 1]``): query rows of each sequence;
    ``seq_lens`` (int32 ``[num_seqs]``): cached + new tokens of each sequence;
    ``plan``: the attention backend's per-step layout (``AttentionOps.plan``),
    built once per step on the host.
    """
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    plan: Optional[Any] = None


@dataclass
class StepContext:
    """What the attention op of every layer reads during one forward."""
    kv_caches: List[KVCache]
    meta: AttentionMetadata
    ops: Any   # pagedbackend.kernels.AttentionOps
    fast: Optional[Callable] = None   # the backend's per-step function (AttentionOps.step), if any


_local = threading.local()


@contextlib.contextmanager
def step_context(kv_caches: List[KVCache], meta: AttentionMetadata, ops) -> Iterator[StepContext]:
    """Make the caches, metadata and kernels of one step visible to the attention op."""
    previous = getattr(_local, "step", None)
    make_fast = getattr(ops, "step", None)
    fast = make_fast(meta.plan, kv_caches) if make_fast is not None and meta.plan is not None else None
    _local.step = step = StepContext(kv_caches, meta, ops, fast)
    try:
        yield step
    finally:
        _local.step = previous


def current_step() -> StepContext:
    step = getattr(_local, "step", None)
    if step is None:
        raise RuntimeError("paged attention ran outside a model step: open step_context() first")
    return step


# A plain ``torch.library`` definition with one kernel for every device (the
# per-call cost of ``torch.library.custom_op``'s wrapper is about twice this,
# and a step pays it once per layer).
_ops = torch.library.Library("pagedbackend", "FRAGMENT")
_ops.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    scale: float) -> torch.Tensor:
    """Write ``k``/``v`` ``[T, kv_heads, d]`` into layer ``layer``'s cache
    slots, then attend with ``q`` ``[T, heads, d]``; returns ``[T, heads, d]``
    (contiguous). The cache write is a side effect on the step context's
    cache, which is not an argument (see the module docstring)."""
    step = current_step()
    if step.fast is not None:
        out = step.fast(q, k, v, layer, scale)
        if out is not None:
            return out
    k_cache, v_cache = step.kv_caches[layer]
    meta = step.meta
    out = step.ops.forward(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                           meta.cu_seqlens_q, meta.seq_lens, scale, meta.plan)
    return out.contiguous()


_ops.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedbackend::paged_attention")
def _paged_attention_fake(q, k, v, layer, scale):
    return q.new_empty(q.shape)


class PagedAttention(nn.Module):
    """Writes the new tokens' K/V into their slots, then runs causal attention
    of the queries against everything cached for their sequence.

    ``sliding_window``: the layer's window (a query at position p sees keys at
    q with p - q < window), None for full attention. Held for the attention
    paths; sequences are served up to the narrowest window
    (``ModelArgs.served_positions``), where both attend alike."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer: int,
                 sliding_window: Optional[int] = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer = layer
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, heads, d]``, ``k``/``v`` ``[T, kv_heads, d]`` -> ``[T, heads, d]``."""
        return torch.ops.pagedbackend.paged_attention(q, k, v, self.layer, self.scale)
