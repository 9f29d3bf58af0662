"""Causal attention over a paged KV cache for a flat, unpadded batch.

The batch mixes prefills (several query tokens per sequence, possibly on top of
cached prefix blocks) and decodes (one query token). For sequence ``s``:

- its query tokens are rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of ``q``;
- its keys are the first ``seq_lens[s]`` positions reached through
  ``block_tables[s]`` (logical block i -> physical block id);
- the query tokens are the last ``q_len`` of those positions, so query row
  ``i`` sits at position ``seq_lens[s] - q_len + i`` and sees keys ``<=`` it;
- with a sliding ``window`` of N (Mistral, Qwen2, Gemma layers), a query at
  position p sees only keys q with ``p - q < N``, its last N positions (as
  Hugging Face's sliding-window mask); the block-table entries of earlier
  positions are never read, so a KV group may have freed their blocks.

Shapes: ``q`` and ``out`` ``[num_tokens, num_heads, head_dim]``; caches
``[num_blocks, block_size, num_kv_heads, row]`` (``row``: ``head_dim``, or
``head_dim * 9 / 8`` for int8 rows with a float16 scale per 16 channels,
dequantised as they are read: ``kv_cache_dtype.py``); ``block_tables`` int32
``[num_seqs, max_blocks_per_seq]``; ``cu_seqlens_q`` int32 ``[num_seqs + 1]``;
``seq_lens`` int32 ``[num_seqs]``. ``num_heads`` is a multiple of
``num_kv_heads`` (grouped-query attention).
"""
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from pagedbackend.kernels import interpret_without_gpu
from pagedbackend.kernels.attention_sinks import softmax_with_sinks
from pagedbackend.kernels.kv_cache_dtype import decode, scale_pointers

interpret_without_gpu()   # before any kernel is defined
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

_LOG2E = 1.4426950408889634
# The kernel's window for full attention: more positions than a sequence has.
_NO_WINDOW = 1 << 30


@dataclass
class RefPlan:
    """Host-side layout of a step for the torch twin, built once per step:
    ``decodes`` (sequences with one query token, batched together when there
    are several) and ``others`` as (sequence, first query row, query rows,
    keys) tuples."""
    decode_seqs: Optional[torch.Tensor]     # [n] sequence indices, on the device
    decode_rows: Optional[torch.Tensor]     # [n] their query rows
    decode_max_len: int
    others: List[Tuple[int, int, int, int]]


def plan_paged_attention_ref(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                             num_heads: int = 0, num_kv_heads: int = 0,
                             device: Union[str, torch.device] = "cpu", *,
                             block_tables=None, slot_mapping=None, block_size=None, window=None) -> RefPlan:
    """The torch twin's layout, from host copies (head counts, block tables,
    slots, block size and window are not needed: accepted for a uniform
    interface; the window reaches the twin with each layer's call)."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decodes = [s for s in range(len(lens)) if cu[s + 1] - cu[s] == 1]
    if len(decodes) < 2:
        decodes = []
    batched = set(decodes)
    others = [(s, cu[s], cu[s + 1] - cu[s], lens[s]) for s in range(len(lens))
              if s not in batched and cu[s + 1] > cu[s]]
    if not decodes:
        return RefPlan(None, None, 0, others)
    return RefPlan(torch.tensor(decodes, device=device), torch.tensor([cu[s] for s in decodes], device=device),
                   max(lens[s] for s in decodes), others)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: Optional[float] = None,
                        out: Optional[torch.Tensor] = None,
                        plan: Optional[RefPlan] = None, window: Optional[int] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference twin: gathers each sequence's K/V (from the first
    position any of its queries sees) and runs softmax in fp32; ``sinks``
    (``[num_heads]``) join each head's softmax as one more logit with no value."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_paged_attention_ref(cu_seqlens_q, seq_lens, device=q.device)
    if plan.decode_seqs is not None:
        _decode_batch(q, k_cache, v_cache, block_tables, seq_lens, plan, scale, out, window, sinks)
    for s, q_start, q_len, kv_len in plan.others:
        q_end = q_start + q_len
        first = max(0, kv_len - q_len - window + 1) if window else 0   # the first query's window
        first_block, n_blocks = first // block_size, (kv_len + block_size - 1) // block_size
        blocks = block_tables[s, first_block:n_blocks].long()
        skip = first - first_block * block_size
        k = decode(k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[skip:kv_len - first_block * block_size])
        v = decode(v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[skip:kv_len - first_block * block_size])
        k = k.repeat_interleave(group, dim=1)  # [kv_len - first, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(first, kv_len, device=q.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if window:   # every gathered key is in the first query's window, so it was written
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden.unsqueeze(0), float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.float()[:, None, None])
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


# Query tokens per plan tile are chosen so that (tokens x padded group) rows fill
# at least the 16-row minimum of tl.dot and at most this many rows.
_MAX_ROWS = 64
# Launch options of an int8 cache's kernels: given .maxnreg 255, ptxas keeps
# them without spills on sm_80, sm_90 and sm_100; left to its default it
# chose 128 or 168 registers for some tiles and spilled 20-32 bytes
# (``gpu_report``: head dim 64 on sm_100, 256 on sm_90).
QUANT_OPTIONS = {"maxnreg": 255}


@dataclass(frozen=True)
class Tiling:
    """A launch's shape: at most ``max_rows`` query rows per program (a plan
    tile with more is split across programs), ``block_n`` key positions per
    step, ``num_warps`` and ``num_stages``."""
    max_rows: int
    block_n: int
    num_warps: int
    num_stages: int


def tiling(dim: int, lowp_dot: bool, converted: bool = False) -> Tiling:
    """The tiling for a padded head dim ``dim`` and dot precision, chosen from
    ``python -m pagedbackend.kernels.gpu_report`` (docs/gpu.md) so that no
    launch spills on sm_80, sm_90 or sm_100: fewer query rows per program as
    the head dim grows, and fp32 (IEEE dots on FMA units, far more held per
    thread) fewer still. ``converted``: the cache is held in another dtype
    than the model's (bf16, int8 or fp8), whose widening (and an int8 cache's
    scales) takes registers of its own: key tiles of 16 and fewer rows past
    head dim 64. Which is fastest awaits a GPU run."""
    if lowp_dot:   # fp16/bf16 tensor-core dots
        if converted and dim > 64:
            return Tiling(32, 16, 4, 3) if dim <= 128 else Tiling(16, 16, 4, 2)
        return Tiling(_MAX_ROWS, 32, 4, 3) if dim <= 128 else Tiling(32, 32, 4, 2)
    if dim <= 64:
        return Tiling(_MAX_ROWS, 16, 4, 3)
    return Tiling(32, 16, 4, 3) if dim <= 128 else Tiling(16, 16, 8, 3)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, tile_seq_ptr, tile_q_start_ptr, sinks_ptr,
    sm_scale_log2, head_dim, block_size, group, window,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bts,
    BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    DIM: tl.constexpr, LOWP_DOT: tl.constexpr, HAS_SINKS: tl.constexpr, QUANT: tl.constexpr,
):
    # Program = (query tile of one sequence, kv head). Its M rows are BLOCK_Q
    # query tokens x GROUP_PAD query heads sharing the kv head, row m being
    # token m // GROUP_PAD and head m % GROUP_PAD, so each K/V tile is loaded
    # once for the whole group.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    # First query token of the program, within its sequence: a plan tile may be
    # split across programs (axis 2), BLOCK_Q tokens each.
    tile_q0 = tl.load(tile_q_start_ptr + tile) + tl.program_id(2) * BLOCK_Q
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    if tile_q0 >= q_len:   # a split past the sequence's last query
        return

    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_q0 + rows // GROUP_PAD  # query token within the sequence
    g = rows % GROUP_PAD
    head = kv_head * group + g
    row_ok = (q_idx < q_len) & (g < group)
    # Causal position of each row; padding rows take the last query's (they
    # see that key at least, window or not), so no row's softmax is ever all -inf.
    q_pos = seq_len - q_len + tl.minimum(q_idx, q_len - 1)
    d = tl.arange(0, DIM)
    d_ok = d < head_dim

    token = (q_begin + q_idx).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=q_mask, other=0.0).to(tl.float32)
    if LOWP_DOT:
        q = q.to(q_ptr.dtype.element_ty)

    if HAS_SINKS:
        # The head's sink is one more logit with no value: the online softmax
        # starts from it (its running max, a sum of one, nothing accumulated).
        m_i = tl.load(sinks_ptr + head, mask=g < group, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], dtype=tl.float32)

    # Keys beyond the tile's last query position are masked for every row: stop
    # there. Keys before its first query's window (``window``: the sliding
    # window, or more positions than any sequence has) are masked for every
    # row too: start at the BLOCK_N tile that holds the first one, and never
    # load the earlier ones (their blocks may be gone).
    kv_end = seq_len - q_len + tl.minimum(tile_q0 + BLOCK_Q, q_len)
    kv_first = tl.maximum(seq_len - q_len + tile_q0 - window + 1, 0)
    cols = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for start in range(kv_first // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        # A tile of BLOCK_N positions spans one or several whole physical blocks
        # (or part of one when block_size > BLOCK_N); each position finds its
        # block through the table.
        pos = start + cols
        pos_ok = (pos < kv_end) & (pos >= kv_first)
        phys = tl.load(table + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % block_size
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k_row = phys * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_row = phys * stride_vb + slot * stride_vs + kv_head * stride_vh
        if k_cache_ptr.dtype.element_ty.is_fp8():
            # No `other`: the interpreter cannot make an fp8 fill value; masked lanes become 0 after widening.
            k = tl.load(k_cache_ptr + k_row[:, None] + d[None, :] * stride_kd, mask=kv_mask).to(tl.float32)
            v = tl.load(v_cache_ptr + v_row[:, None] + d[None, :] * stride_vd, mask=kv_mask).to(tl.float32)
            k = tl.where(kv_mask, k, 0.0)
            v = tl.where(kv_mask, v, 0.0)
        else:
            k = tl.load(k_cache_ptr + k_row[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0).to(tl.float32)
            v = tl.load(v_cache_ptr + v_row[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0).to(tl.float32)
        if QUANT:   # int8 rows: a float16 scale per 16 channels follows the values
            # A [BLOCK_N, DIM // 16] tile of scales (in float16s, a row's start at
            # (row + head_dim) / 2), each multiplying its group of 16 channels.
            gs = tl.arange(0, DIM // 16)
            s_mask = pos_ok[:, None] & (gs[None, :] * 16 < head_dim)
            k_s = tl.load(k_scale_ptr + ((k_row + head_dim) // 2)[:, None] + gs[None, :], mask=s_mask, other=0.0)
            v_s = tl.load(v_scale_ptr + ((v_row + head_dim) // 2)[:, None] + gs[None, :], mask=s_mask, other=0.0)
            k = tl.reshape(tl.reshape(k, [BLOCK_N, DIM // 16, 16]) * k_s.to(tl.float32)[:, :, None], [BLOCK_N, DIM])
            v = tl.reshape(tl.reshape(v, [BLOCK_N, DIM // 16, 16]) * v_s.to(tl.float32)[:, :, None], [BLOCK_N, DIM])
        if LOWP_DOT:
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = s * sm_scale_log2
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax in base 2 (the scale already carries log2(e)).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if LOWP_DOT:
            acc = tl.dot(p.to(q_ptr.dtype.element_ty), v, acc)
        else:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        m_i = m_new

    acc = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def _half_precision_dot(q: torch.Tensor) -> bool:
    """fp16/bf16 operands go to tl.dot as they are on a GPU (tensor cores).

    The CPU interpreter mishandles bf16 arithmetic, so there all tiles stay fp32.
    """
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


@dataclass
class TritonPlan:
    """Host-side tile map of a step for the Triton-lang kernel, built once per
    step: program ``i`` takes up to ``block_q`` query tokens of sequence
    ``tile_seq[i]``, starting at its query token ``tile_q_start[i]``."""
    tile_seq: torch.Tensor       # int32, on the device
    tile_q_start: torch.Tensor   # int32, on the device
    block_q: int


def _query_tiles(q_lens: torch.Tensor, block_q: int, device: torch.device):
    """Host-side tile -> (sequence, first query token) map; no batch padding."""
    n_tiles = (q_lens + block_q - 1) // block_q
    tile_seq = torch.repeat_interleave(torch.arange(len(q_lens)), n_tiles)
    first_tile = torch.cumsum(n_tiles, 0) - n_tiles
    tile_q_start = (torch.arange(len(tile_seq)) - first_tile[tile_seq]) * block_q
    return tile_seq.to(device, torch.int32), tile_q_start.to(device, torch.int32)


def plan_paged_attention(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
                         num_kv_heads: int, device: Union[str, torch.device] = "cpu", *,
                         block_tables=None, slot_mapping=None, block_size=None, window=None) -> TritonPlan:
    """The tile map, from host (CPU) copies of the step's query layout (block
    tables, slots and block size are read on the device, not here; the
    window reaches the kernel with each layer's call)."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    min_q = max(1, 16 // group_pad)
    max_q = max(min_q, _MAX_ROWS // group_pad)
    # Size the query tile to the longest query run so pure-decode batches do
    # not pay for prefill-sized tiles; the bounds keep the recompiles few.
    cu = cu_seqlens_q.to("cpu", torch.int64)
    q_lens = cu[1:] - cu[:-1]
    longest = int(q_lens.max()) if len(q_lens) else 0
    block_q = min(max(triton.next_power_of_2(max(longest, 1)), min_q), max_q)
    tile_seq, tile_q_start = _query_tiles(q_lens, block_q, torch.device(device))
    return TritonPlan(tile_seq, tile_q_start, block_q)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, scale: Optional[float] = None,
                    out: Optional[torch.Tensor] = None,
                    plan: Optional[TritonPlan] = None, window: Optional[int] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton-lang twin of :func:`paged_attention_ref`.

    Grid: (query tiles over all sequences, kv heads). A tile is up to BLOCK_Q
    query tokens of one sequence; it walks that sequence's block table in
    tiles of BLOCK_N key positions up to its last causal position, from the
    first one its first query sees (``window``). ``plan``
    (``plan_paged_attention``) is computed here when not given; a model passes
    the step's plan so no layer copies the layout to the host again.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if plan is None:
        plan = plan_paged_attention(cu_seqlens_q, seq_lens, num_heads, num_kv_heads, q.device)
    if len(plan.tile_seq) == 0:
        return out

    dim, group_pad, lowp = max(16, triton.next_power_of_2(head_dim)), triton.next_power_of_2(group), \
        _half_precision_dot(q)
    shape = tiling(dim, lowp, k_cache.dtype != q.dtype)
    block_q = min(plan.block_q, max(1, shape.max_rows // group_pad))
    grid = (len(plan.tile_seq), num_kv_heads, plan.block_q // block_q)
    quant = k_cache.dtype == torch.int8
    scales = scale_pointers(k_cache, v_cache)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, *scales, out,
        block_tables, cu_seqlens_q, seq_lens, plan.tile_seq, plan.tile_q_start,
        sinks if sinks is not None else seq_lens,
        scale * _LOG2E, head_dim, block_size, group, window or _NO_WINDOW,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        BLOCK_Q=block_q, GROUP_PAD=group_pad, BLOCK_N=shape.block_n, DIM=dim, LOWP_DOT=lowp,
        HAS_SINKS=sinks is not None, QUANT=quant, num_warps=shape.num_warps, num_stages=shape.num_stages,
        **(QUANT_OPTIONS if quant else {}),
    )
    return out


def _decode_batch(q, k_cache, v_cache, block_tables, seq_lens, plan: RefPlan, scale, out,
                  window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> None:
    """All single-token queries at once: gather their blocks into a padded
    ``[seqs, max_len]`` view and mask the padding (one query sees every key,
    or its last ``window``)."""
    block_size, num_kv_heads, row = k_cache.shape[1:]
    head_dim = q.shape[2]
    group = q.shape[1] // num_kv_heads
    idx, rows = plan.decode_seqs, plan.decode_rows
    n = len(idx)
    lens = seq_lens[idx].long()
    n_blocks = (plan.decode_max_len + block_size - 1) // block_size
    tables = block_tables[idx, :n_blocks].long().clamp_(min=0)
    k = decode(k_cache[tables].reshape(n, -1, num_kv_heads, row))
    v = decode(v_cache[tables].reshape(n, -1, num_kv_heads, row))
    qs = q[rows].float().view(n, num_kv_heads, group, head_dim)
    scores = torch.einsum("nkgd,nlkd->nkgl", qs, k) * scale
    pad = torch.arange(k.shape[1], device=q.device).unsqueeze(0) >= lens.unsqueeze(1)
    if window:
        pad |= torch.arange(k.shape[1], device=q.device).unsqueeze(0) < (lens - window).unsqueeze(1)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    v.masked_fill_(pad[:, :, None, None], 0.0)  # padding may hold anything, even NaN
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.float().view(1, num_kv_heads, group, 1))
    out[rows] = torch.einsum("nkgl,nlkd->nkgd", probs, v).reshape(n, -1, head_dim).to(out.dtype)
