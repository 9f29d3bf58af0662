"""Attention over the paged KV cache: store the step's K/V, then attend.

Each layer calls one custom op, ``pagedbackend::paged_attention(q, k, v,
layer, scale, window, sinks)``, registered with ``torch.library`` so that ``torch.compile``
keeps the whole forward in one graph and treats the op as opaque. The op finds
the layer's KV cache, the step's metadata and the attention kernels in the
step context (``step_context``) that the model runner opens around each
forward, as vLLM's ``unified_attention`` does: the cache is never a graph
input, so the graph has no mutation to functionalise (and no cache copy), and
the metadata's per-step shapes never trigger a recompile. The context is per
thread, so tensor-parallel ranks running as threads of one process do not mix.

A layer with a sliding window (``PagedAttention(..., sliding_window=N)``)
passes N to the op, a constant of the graph; the kernels then read only
its last N positions per query. Layers are grouped by attention kind (KV
groups, ``core.kv_groups``): each group has its own block tables, slots and
plan in the step context, and the op reads its layer's group's.

Bidirectional blocks (Gemma 3's images: ``ImageBlock``, listed in the step
context) are rows of one sequence that see each other: after the backend's
causal attention, their rows are attended again over every key up to the
block's last position (``kernels.block_attention``).
"""
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from pagedbackend.kernels.block_attention import block_attention

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


class ImageBlock(NamedTuple):
    """Query rows ``rows_start:rows_end`` of the step's sequence ``seq``
    (its index in the block tables), at positions ``first_pos`` on, inside a
    bidirectional block whose last position is ``last_pos`` (computed in
    this step or before)."""
    seq: int
    rows_start: int
    rows_end: int
    first_pos: int
    last_pos: int


@dataclass
class StepContext:
    """What the attention op of every layer reads during one forward: the
    metadata (and the backend's per-step function) of KV group 0, the only
    group of a model whose layers all attend alike; with several groups,
    ``layer_group`` names each layer's and ``metas`` / ``fasts`` hold every
    group's."""
    kv_caches: List[KVCache]
    meta: AttentionMetadata
    ops: Any   # pagedbackend.kernels.AttentionOps
    fast: Optional[Callable] = None   # the backend's per-step function (AttentionOps.step), if any
    layer_group: Optional[Sequence[int]] = None
    metas: Sequence[AttentionMetadata] = ()
    fasts: Sequence[Optional[Callable]] = ()
    image_blocks: Sequence[ImageBlock] = ()
    kv_scales: Optional[Any] = None   # an fp8 cache's per-layer scales (models.fp8_scales.KVScales; None: 1)


_local = threading.local()


@contextlib.contextmanager
def step_context(kv_caches: List[KVCache], meta: Union[AttentionMetadata, Sequence[AttentionMetadata]],
                 ops, layer_group: Optional[Sequence[int]] = None,
                 image_blocks: Sequence[ImageBlock] = (),
                 kv_scales=None) -> Iterator[StepContext]:
    """Make the caches, metadata and kernels of one step visible to the
    attention op. ``meta``: the step's metadata, or one per KV group with
    ``layer_group`` giving each layer's group; ``image_blocks``: the step's
    bidirectional blocks (none: every row is causal); ``kv_scales``: an fp8
    cache's per-layer scales (``models.fp8_scales``)."""
    previous = getattr(_local, "step", None)
    metas = [meta] if isinstance(meta, AttentionMetadata) else list(meta)
    make_fast = getattr(ops, "step", None)
    fasts = [make_fast(m.plan, kv_caches) if make_fast is not None and m.plan is not None else None
             for m in metas]
    if layer_group is not None and len(metas) == 1:
        layer_group = None   # every layer reads group 0's
    _local.step = step = StepContext(kv_caches, metas[0], ops, fasts[0], layer_group, metas, fasts,
                                     tuple(image_blocks), kv_scales)
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
# ``window`` has no default: inductor's C++ wrapper passes the arguments a
# call spells out, and the dispatcher then misses a defaulted one.
_ops.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int window, "
            "Tensor? sinks) -> Tensor")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    scale: float, window: int, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Write ``k``/``v`` ``[T, kv_heads, d]`` into layer ``layer``'s cache
    slots, then attend with ``q`` ``[T, heads, d]`` over each query's last
    ``window`` positions (0: all of them), ``sinks`` (float32 ``[heads]`` or
    None) one more logit per head in each softmax; returns ``[T, heads, d]``
    (contiguous). The cache write is a side effect on the step context's
    cache, which is not an argument (see the module docstring)."""
    step = current_step()
    if step.layer_group is None:
        meta, fast = step.meta, step.fast
    else:
        group = step.layer_group[layer]
        meta, fast = step.metas[group], step.fasts[group]
    v_scale = 1.0
    if step.kv_scales is not None:   # store k / k_scale, v / v_scale; k_scale joins the softmax scale
        k, v, scale, v_scale = step.kv_scales.apply(layer, k, v, scale)
    out = fast(q, k, v, layer, scale, window, sinks) if fast is not None else None
    k_cache, v_cache = step.kv_caches[layer]
    if out is None:
        out = step.ops.forward(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                               meta.cu_seqlens_q, meta.seq_lens, scale, meta.plan, window or None, sinks)
    if step.image_blocks:
        if sinks is not None:
            raise ValueError("bidirectional image blocks do not combine with attention sinks")
        out = out.clone()
        for b in step.image_blocks:
            out[b.rows_start:b.rows_end] = block_attention(q[b.rows_start:b.rows_end], k_cache, v_cache,
                                                           meta.block_tables[b.seq], b.first_pos, b.last_pos,
                                                           scale, window or None)
    return out.contiguous() if v_scale == 1.0 else (out * v_scale).contiguous()   # v_scale: the output's


_ops.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedbackend::paged_attention")
def _paged_attention_fake(q, k, v, layer, scale, window, sinks):
    return q.new_empty(q.shape)


class PagedAttention(nn.Module):
    """Writes the new tokens' K/V into their slots, then runs causal attention
    of the queries against everything cached for their sequence, or with a
    ``sliding_window`` of N against its last N positions: a query at
    position p sees keys q with ``p - N < q <= p``, as Hugging Face's
    sliding-window mask. ``sinks`` (gpt-oss's attention sinks): float32
    ``[num_heads]``, a learned logit per head that joins every softmax with
    no value row, so it takes a share of the weight (None: no sinks)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer: int,
                 sliding_window: Optional[int] = None, sinks: Optional[torch.Tensor] = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive number of positions or None, "
                             f"got {sliding_window!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer = layer
        self.sliding_window = sliding_window
        self.sinks = sinks
        # An fp8 cache's scales from the checkpoint (models.fp8_scales; 1: none).
        self.k_scale = self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, heads, d]``, ``k``/``v`` ``[T, kv_heads, d]`` -> ``[T, heads, d]``."""
        return torch.ops.pagedbackend.paged_attention(q, k, v, self.layer, self.scale,
                                                      self.sliding_window or 0, self.sinks)


def layer_windows_of(model: nn.Module) -> List[Optional[int]]:
    """Each layer's sliding window (None: full attention), read from the
    model's ``PagedAttention`` modules in layer order."""
    found = sorted((m.layer, m.sliding_window) for m in model.modules() if isinstance(m, PagedAttention))
    return [window for _, window in found]
