"""Paged attention for serving on CPU: one gather per step layout, then
PyTorch's ``scaled_dot_product_attention`` (grouped-query heads, no repeat).

The Triton-lang kernel runs on CPU only through its interpreter, and the
reference twin re-derives every sequence's block gather in every layer. Here
the host builds, once per step (``plan_sdpa_attention``), the cache slot of
every key position each sequence reads, so a layer's work is:

- decodes (one query token): one call of the C kernel
  ``csrc/paged_decode.c`` (built here at first use, ``kernels.native``), which
  reads each sequence's keys and values in place through its block table
  (float32 arithmetic: bfloat16 or float16 queries are widened on the way in
  and the output narrowed on the way out, a few rows a layer);
- decodes otherwise (no C compiler, or a cache it does not read): one ``index_select`` of
  all their keys (and one of their values) from the flat cache straight into
  ``[seqs x kv_heads, max_len, head_dim]``, then two batched matmuls around a
  softmax, each KV head's query group as the rows of one small matrix (SDPA's
  CPU kernel is built for long queries: 2-4x slower at one query token);
  padding keys get a -inf bias;
- fresh prefills (no cached prefix): causal SDPA on the step's own K/V, with no
  cache read at all;
- chunks on a cached prefix: their slots gathered, SDPA with the causal mask
  aligned to the end of the sequence.

A plan is built for one sliding ``window`` (None: full attention): every
path then reads only the key positions its queries see, so the block-table
entries of positions that left the window are never read (a KV group may
have given their blocks back), and fresh prefills longer than the window get
a banded mask.

Attention sinks (gpt-oss: one learned logit per head in every softmax, with
no value) reach the C decode kernel as one more term of its softmax, the
gather path as a last score column, and chunks through SDPA's CPU flash
kernel, whose log-sum-exp rescales its output by ``sigmoid(lse - sink)``.

The cache may hold another dtype than the model's (``kv_cache_dtype``:
bfloat16, or int8 rows with their scale, ``kv_cache_dtype.py``): the C
kernels read and write it at its own width (float32 arithmetic), the gather
paths dequantise the rows they gather. Fresh prefills attend to the step's
own K/V as computed, as they do in every dtype.

The KV write is one call of the C ``paged_write_kv`` (rows widened to
float32 first, as for decodes), else one ``index_copy_`` per cache of the rows
``kv_cache_dtype.encode`` makes. A step of decodes only gets a function of its
own (``decode_step``) that checks once what its layers share, so each layer
makes just the two C calls. Shapes and arguments follow ``paged_attention.py``.
"""
import functools
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F

from pagedbackend.kernels import native
from pagedbackend.kernels.attention_sinks import sdpa_with_sinks, softmax_with_sinks
from pagedbackend.kernels.kv_cache_dtype import FP8_DTYPES, decode, encode, head_dim_of, native_kind, row_width

# Decodes through csrc/paged_decode.c where it builds (tests turn it off to
# check the gather path).
USE_NATIVE_DECODE = True
# Steps of decodes only go through decode_step's per-step function (False:
# every layer takes the general path, for comparisons).
USE_DECODE_STEP = True
# Activation dtypes the C kernels take (widened to float32 on the way in, narrowed on the way out).
NATIVE_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
_natives = {}   # function name -> the loaded C function, or False where it cannot be built


@dataclass
class Chunk:
    """Query rows ``q_start:q_start + q_len`` of one sequence that reach
    ``kv_len`` keys; ``index``: the cache slots of the keys its queries see
    (positions ``kv_len - len(index)`` on); ``mask``: ``[q_len, len(index)]``
    visibility, None for plain causal attention; ``fresh``: the chunk is the
    whole sequence (its keys are the step's own)."""
    q_start: int
    q_len: int
    kv_len: int
    index: torch.Tensor
    mask: Optional[torch.Tensor]
    fresh: bool


@dataclass
class SdpaPlan:
    """A step's layout for :func:`sdpa_attention`, built once on the host.

    ``decode_rows``: query rows of the single-token sequences (None when the
    step has none; ``decode_all`` when they are rows ``0..n-1``, all of the
    step); ``decode_index``: ``[n * kv_heads * max_len]`` rows of the cache
    viewed as ``[slots * kv_heads, head_dim]``, (sequence, head, position)
    in that order, padding repeating the sequence's first key; ``decode_bias``:
    fp32 ``[n * kv_heads, 1, max_len]``, -inf on padding, None when no sequence
    is shorter than ``max_len``; ``decode_tables`` (int32 ``[n, max_blocks]``)
    and ``decode_lens`` (int32 ``[n]``): the decodes' block tables and key
    counts, for the C kernel (None off CPU), and the largest block number they
    reach (the kernel reads the cache only when it holds that block).
    ``write_slots``: the new tokens' slots when every one is stored, else None
    (some negative). ``window``: the window the plan is for (None: full)."""
    decode_rows: Optional[torch.Tensor]
    decode_all: bool
    decode_index: Optional[torch.Tensor]
    decode_bias: Optional[torch.Tensor]
    decode_len: int
    chunks: List[Chunk]
    write_slots: Optional[torch.Tensor]
    decode_tables: Optional[torch.Tensor] = None
    decode_lens: Optional[torch.Tensor] = None
    decode_max_block: int = -1
    window: Optional[int] = None


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of key ``positions`` through block table rows ``tables``."""
    return tables[..., positions // block_size].long() * block_size + positions % block_size


def plan_sdpa_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, *,
                        block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                        num_heads: int = 0, num_kv_heads: int = 0,
                        device: Union[str, torch.device] = "cpu",
                        window: Optional[int] = None) -> SdpaPlan:
    """The step's gather indices and masks, from host copies of its metadata,
    for layers with sliding ``window`` (None: full attention)."""
    window = window or None
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[s + 1] - cu[s] for s in range(len(lens))]
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    rows = decode_index = decode_bias = kernel_tables = kernel_lens = None
    kernel_max_block, decode_len = -1, 0
    if decodes:
        if num_kv_heads < 1:
            raise ValueError("plan_sdpa_attention needs num_kv_heads for a step with decodes")
        seqs = torch.tensor(decodes)
        decode_lens = seq_lens[seqs].long()
        tables = block_tables[seqs].long()
        if window is None:
            decode_len = int(decode_lens.max())
            pos = torch.arange(decode_len)
            slots = _slots(tables, pos, block_size)
            visible = pos.unsqueeze(0) < decode_lens.unsqueeze(1)
        else:   # each sequence's last `window` positions, from its own first one
            first = (decode_lens - window).clamp_(min=0)
            decode_len = int((decode_lens - first).max())
            offset = torch.arange(decode_len).unsqueeze(0)
            visible = offset < (decode_lens - first).unsqueeze(1)
            pos = torch.where(visible, first.unsqueeze(1) + offset, first.unsqueeze(1))
            slots = torch.gather(tables, 1, pos // block_size) * block_size + pos % block_size
        if not bool(visible.all()):
            # A padding key repeats the sequence's first key (a slot it has
            # written, so finite) and gets a -inf score: its weight is exactly 0.
            slots = torch.where(visible, slots, slots[:, :1])
            bias = torch.zeros(len(decodes), 1, 1, decode_len).masked_fill_(~visible[:, None, None], float("-inf"))
            decode_bias = bias.expand(-1, num_kv_heads, -1, -1).reshape(-1, 1, decode_len).to(device)
        heads = torch.arange(num_kv_heads)
        decode_index = (slots.unsqueeze(1) * num_kv_heads + heads[None, :, None]).view(-1).to(device)
        rows = torch.tensor([cu[s] for s in decodes], device=device)
        if torch.device(device).type == "cpu":
            kernel_tables = block_tables[seqs].to(torch.int32).contiguous()
            kernel_lens = decode_lens.to(torch.int32).contiguous()
            used = kernel_tables[:, :-(-int(decode_lens.max()) // block_size)]
            # a negative block number counts as out of range: the gather path reports it
            kernel_max_block = int(used.max()) if int(used.min()) >= 0 else 1 << 62
    chunks = []
    for s, (q_len, kv_len) in enumerate(zip(q_lens, lens)):
        if q_len <= 1:
            continue
        # The chunk's first visible key: query i sits at kv_len - q_len + i and
        # sees keys up to it (with a window, only those after its position - window).
        first = max(0, kv_len - q_len - window + 1) if window else 0
        index = _slots(block_tables[s], torch.arange(first, kv_len), block_size).to(device)
        mask = None
        if kv_len > q_len or (window is not None and q_len > window):
            q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
            k_pos = torch.arange(first, kv_len).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            mask = mask.to(device)
        chunks.append(Chunk(cu[s], q_len, kv_len, index, mask, kv_len == q_len))
    num_tokens = cu[-1] if cu else 0
    decode_all = len(decodes) == num_tokens and decodes == list(range(len(decodes)))
    write_slots = slot_mapping.long().to(device) if bool((slot_mapping >= 0).all()) else None
    return SdpaPlan(rows, decode_all, decode_index, decode_bias, decode_len, chunks, write_slots,
                    kernel_tables, kernel_lens, kernel_max_block, window)


def write_kv_sdpa(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  plan: Optional[SdpaPlan] = None) -> None:
    """Store ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` in their
    slots (in the cache's format); negative slots are skipped. On CPU: one
    call of the C kernel's ``paged_write_kv`` (a slot out of range falls through to
    ``index_copy_``, which raises an IndexError)."""
    slots = plan.write_slots if plan is not None else None
    kind = native_kind(k_cache.dtype)
    if (slots is not None and USE_NATIVE_DECODE and key.dtype in NATIVE_ACTIVATIONS
            and kind is not None and key.device.type == "cpu" and value.dtype == key.dtype
            and v_cache.dtype == k_cache.dtype and key.shape == value.shape
            and key.shape[1] == k_cache.shape[2] and row_width(key.shape[2], k_cache.dtype) == k_cache.shape[3]
            and k_cache.shape == v_cache.shape and slots.shape == key.shape[:1]
            and slots.is_contiguous() and _rows_contiguous(key) and _rows_contiguous(value)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and native_write() is not None):
        blocks, block_size, kv_heads, _ = k_cache.shape
        key, value = key.float(), value.float()   # no copy for float32
        if native_write()(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), slots.shape[0], kv_heads, key.shape[2],
                          blocks * block_size, key.stride(0), value.stride(0), kind) == 0:
            return
    if slots is None:
        keep = slot_mapping >= 0
        slots, key, value = slot_mapping[keep].long(), key[keep], value[keep]
    for cache, rows in ((k_cache, encode(key, k_cache.dtype)), (v_cache, encode(value, v_cache.dtype))):
        if cache.dtype in FP8_DTYPES:   # torch's index_copy_ has no fp8 kernel: the same bytes as uint8
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each token's ``[kv_heads, head_dim]`` of ``t`` lies in one run
    of memory (tokens may lie apart, as in a slice of the QKV output)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= 0


def sdpa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                   scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                   plan: Optional[SdpaPlan] = None, key: Optional[torch.Tensor] = None,
                   value: Optional[torch.Tensor] = None, window: Optional[int] = None,
                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of ``q`` over the paged cache (see the module docstring).

    ``key``/``value``: the step's new K/V, already in the cache; when given,
    fresh prefills read them instead of gathering from the cache. ``plan``
    comes from :func:`plan_sdpa_attention` (computed here when absent, which
    needs host copies of the metadata and a block size from the cache), for
    the same sliding ``window``. ``sinks``: float32 ``[num_heads]``, one
    logit per head that joins each softmax with no value (gpt-oss), or None."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if plan is None:
        slots = torch.zeros(num_tokens, dtype=torch.long)
        plan = plan_sdpa_attention(cu_seqlens_q.cpu(), seq_lens.cpu(), block_tables=block_tables.cpu(),
                                   slot_mapping=slots, block_size=k_cache.shape[1],
                                   num_kv_heads=num_kv_heads, device=q.device, window=window)
    elif plan.window != (window or None):
        raise ValueError(f"the step's attention plan is for window {plan.window}, "
                         f"the layer attends with window {window or None}")
    gqa = num_heads != num_kv_heads
    if plan.decode_all and out is None:
        return _decodes(q, k_cache, v_cache, plan, scale, sinks)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = _decodes(q[plan.decode_rows], k_cache, v_cache, plan, scale, sinks)
    k_flat = k_cache.view(-1, num_kv_heads, k_cache.shape[3])
    v_flat = v_cache.view(-1, num_kv_heads, v_cache.shape[3])
    for c in plan.chunks:
        rows = slice(c.q_start, c.q_start + c.q_len)
        if c.fresh and key is not None:
            k, v = key[rows], value[rows]
        else:   # the gathered rows, dequantised (a cast, for bfloat16) to the queries' dtype
            k = decode(k_flat.index_select(0, c.index), q.dtype)
            v = decode(v_flat.index_select(0, c.index), q.dtype)
        if sinks is not None:
            out[rows] = sdpa_with_sinks(q[rows], k, v, c.mask, scale, sinks)
            continue
        # 4-D (a batch of one): on CPU that takes SDPA's flash kernel; 3-D
        # inputs take its unfused math path, slower (BENCHMARKS.md, "profile_step").
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=gqa)
        out[rows] = o[0].transpose(0, 1)
    return out


def sdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 plan: SdpaPlan, window: Optional[int] = None,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Store the step's K/V, then attend (fresh prefills on the new K/V as they are)."""
    write_kv_sdpa(k, v, k_cache, v_cache, slot_mapping, plan)
    return sdpa_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=scale,
                          plan=plan, key=k, value=v, window=window, sinks=sinks)


def _native(function: str):
    """``function`` of the C kernel's library (declared by ``native``), or None where it cannot be built."""
    if function not in _natives:
        try:
            _natives[function] = getattr(native.load("paged_decode"), function)
        except RuntimeError:
            _natives[function] = False
    return _natives[function] or None


# The C decode kernel's and KV writer's functions, or None where they cannot be built.
native_decode = functools.partial(_native, "paged_decode_kv")
native_write = functools.partial(_native, "paged_write_kv")


def _decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: SdpaPlan,
             scale: float, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Single-token queries ``[n, heads, dim]`` against their keys, in fp32 whatever the dtypes."""
    n, num_heads, head_dim = q.shape
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    kind = native_kind(k_cache.dtype)
    if (USE_NATIVE_DECODE and plan.decode_tables is not None
            and plan.decode_max_block < k_cache.shape[0] and q.dtype in NATIVE_ACTIVATIONS
            and kind is not None and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous() and native_decode() is not None):
        dtype = q.dtype
        q = q.float().contiguous()
        out = torch.empty_like(q)
        failed = native_decode()(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                 plan.decode_tables.data_ptr(), plan.decode_tables.shape[1],
                                 plan.decode_lens.data_ptr(), n, num_heads, k_cache.shape[2],
                                 head_dim, k_cache.shape[1], scale, plan.window or 0,
                                 None if sinks is None else sinks.data_ptr(), torch.get_num_threads(), kind)
        if failed:
            raise MemoryError("paged decode attention could not allocate its scratch memory")
        return out.to(dtype)
    dtype = q.dtype
    rows = n * k_cache.shape[2]   # one matrix per (sequence, KV head)
    shape = (rows, plan.decode_len, head_dim)
    k = decode(k_cache.view(-1, k_cache.shape[3]).index_select(0, plan.decode_index)).view(shape)
    v = decode(v_cache.view(-1, v_cache.shape[3]).index_select(0, plan.decode_index)).view(shape)
    q = q.reshape(rows, num_heads * n // rows, head_dim).float()
    if plan.decode_bias is None:
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
    else:
        scores = torch.baddbmm(plan.decode_bias, q, k.transpose(1, 2), alpha=scale)
    if sinks is not None:   # rows are (sequence, KV head), columns that head's query group
        sinks = sinks.view(1, k_cache.shape[2], -1, 1).expand(n, -1, -1, -1).reshape(rows, -1, 1)
    out = torch.bmm(softmax_with_sinks(scores, sinks), v)
    return out.view(n, num_heads, head_dim).to(dtype)


def decode_step(plan: SdpaPlan, kv_caches) -> Optional[Callable]:
    """For a step of decodes only, on CPU with the C kernels (a
    cache of any dtype they read): a function ``(q, k, v, layer, scale,
    window, sinks) -> out`` that stores a layer's K/V and attends with two C calls. What is the same for every layer (the plan,
    the caches' dtype, shape and layout) is checked here, once per step, not
    by each layer; a layer whose tensors do not fit gets None back and takes
    the general path (``sdpa_forward``), as does a slot out of range (which
    that path reports). None when the step does not qualify."""
    if not (USE_DECODE_STEP and USE_NATIVE_DECODE and plan.decode_all and plan.write_slots is not None
            and plan.decode_tables is not None and kv_caches and native_write() is not None
            and native_decode() is not None):
        return None
    shape, dtype = kv_caches[0][0].shape, kv_caches[0][0].dtype
    kind = native_kind(dtype)
    if kind is None or not all(c.dtype == dtype and c.device.type == "cpu" and c.shape == shape
                               and c.is_contiguous() for pair in kv_caches for c in pair):
        return None
    blocks, block_size, kv_heads, row = shape
    slots, tables, lens = plan.write_slots, plan.decode_tables, plan.decode_lens
    n = tables.shape[0]
    if (plan.decode_max_block >= blocks or slots.shape != (n,) or not slots.is_contiguous()
            or lens.shape != (n,)):
        return None
    write, attend = native_write(), native_decode()
    head_dim = head_dim_of(kv_caches[0][0])   # an int8 row holds the values and their scales
    kv_shape = (n, kv_heads, head_dim)
    num_slots, max_blocks = blocks * block_size, tables.shape[1]
    slots_ptr, tables_ptr, lens_ptr = slots.data_ptr(), tables.data_ptr(), lens.data_ptr()
    threads = torch.get_num_threads()
    window = plan.window or 0

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
             layer_window: int = 0, sinks: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if sinks is not None and not (sinks.dtype == torch.float32 and sinks.is_contiguous()
                                      and sinks.shape == q.shape[1:2]):
            return None
        if not (layer_window == window and q.dtype in NATIVE_ACTIVATIONS and k.dtype == q.dtype
                and v.dtype == q.dtype and k.shape == kv_shape and v.shape == kv_shape and q.dim() == 3
                and q.shape[0] == n and q.shape[2] == head_dim and q.shape[1] % kv_heads == 0
                and q.is_contiguous() and _rows_contiguous(k) and _rows_contiguous(v)):
            return None
        dtype = q.dtype
        if dtype != torch.float32:   # widened here, narrowed below: the kernels work in float32
            q, k, v = q.float(), k.float(), v.float()
        k_cache, v_cache = kv_caches[layer]
        if write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots_ptr, n, kv_heads,
                 head_dim, num_slots, k.stride(0), v.stride(0), kind) != 0:
            return None
        out = torch.empty_like(q)
        if attend(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables_ptr,
                  max_blocks, lens_ptr, n, q.shape[1], kv_heads, head_dim, block_size, scale, window,
                  None if sinks is None else sinks.data_ptr(), threads, kind):
            raise MemoryError("paged decode attention could not allocate its scratch memory")
        return out if dtype == torch.float32 else out.to(dtype)

    return step
