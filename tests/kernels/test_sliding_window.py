"""Sliding-window attention in every attention path: a query at position p
sees keys q with ``p - window < q <= p`` (Hugging Face's sliding-window
mask), and no path reads the block-table entries of positions that left
every query's window (a KV group gives those blocks back to the pool).

Freed blocks are simulated by pointing their table entries at a block full
of NaN: a path that reads one (even to mask it) turns its output to NaN.
Shapes stay tiny: the Triton-lang kernel runs in the interpreter.
"""
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import pagedbackend.kernels as kernels
from pagedbackend.kernels import paged_attention as pa
from pagedbackend.kernels import sdpa_attention as sa
from paged_batch import TOL, PagedBatch, make_batch


def windowed_reference(batch: PagedBatch, window: Optional[int], scale: Optional[float] = None) -> torch.Tensor:
    """fp32 attention per sequence on contiguous K/V with Hugging Face's
    sliding-window causal mask."""
    num_heads = batch.q.shape[1]
    out = torch.zeros(batch.q.shape, dtype=torch.float32)
    cu = batch.cu_seqlens_q.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[cu[s]:cu[s + 1]].float()
        q_len, seq_len = q.shape[0], k.shape[0]
        if q_len == 0:
            continue
        group = num_heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=visible, scale=scale)
        out[cu[s]:cu[s + 1]] = o.transpose(0, 1)
    return out


def free_out_of_window(batch: PagedBatch, window: int) -> int:
    """Point every table entry whose positions all left the window of the
    sequence's first query at one NaN block; returns how many it replaced."""
    block_size = batch.k_cache.shape[1]
    # make_batch leaves its spare blocks NaN: find one no table holds
    held = set(batch.block_tables[:, :-1].flatten().tolist())
    gone = next(b for b in range(batch.k_cache.shape[0]) if b not in held)
    assert torch.isnan(batch.k_cache[gone]).all() and torch.isnan(batch.v_cache[gone]).all()
    cu = batch.cu_seqlens_q.tolist()
    replaced = 0
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        first = max(0, seq_len - (cu[s + 1] - cu[s]) - window + 1)   # the first query's first key
        for b in range(first // block_size):
            batch.block_tables[s, b] = gone
            replaced += 1
    return replaced


def assert_windowed_paths_match(batch: PagedBatch, window: Optional[int], scale: Optional[float] = None,
                                triton: bool = True) -> None:
    """Triton-lang kernel, reference twin, the CPU serving path (C decode
    kernel and gather fallback) agree with the windowed reference."""
    atol, rtol = TOL[batch.q.dtype]
    expected = windowed_reference(batch, window, scale)
    paths = {"twin": pa.paged_attention_ref(*batch.args(), scale=scale, window=window),
             "sdpa": sa.sdpa_attention(*batch.args(), scale=scale, window=window)}
    saved, sa.USE_NATIVE_DECODE = sa.USE_NATIVE_DECODE, False
    try:
        paths["gather"] = sa.sdpa_attention(*batch.args(), scale=scale, window=window)
    finally:
        sa.USE_NATIVE_DECODE = saved
    if triton:
        paths["triton"] = pa.paged_attention(*batch.args(), scale=scale, window=window)
    for name, got in paths.items():
        assert got.dtype == batch.q.dtype and got.shape == batch.q.shape, name
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# Decodes, fresh prefills shorter and longer than the window, chunks on a
# cached prefix (some starting past the window), an empty query.
WINDOWED = [(1, 37), (23, 23), (1, 5), (9, 50), (0, 12), (1, 1), (17, 33), (5, 9), (1, 97), (6, 88)]


@pytest.mark.parametrize("window,block_size", [(8, 4), (12, 16), (40, 8)])
def test_every_path_attends_to_the_last_window_positions_only(window, block_size):
    batch = make_batch(WINDOWED, block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=32, seed=window)
    assert free_out_of_window(batch, window) > 0
    assert_windowed_paths_match(batch, window)
    full = windowed_reference(batch, None)
    assert not torch.allclose(full, windowed_reference(batch, window))   # the window matters


def test_a_window_longer_than_every_sequence_is_full_attention():
    batch = make_batch(WINDOWED, block_size=8, num_heads=3, num_kv_heads=1, head_dim=32, seed=3)
    windowed = sa.sdpa_attention(*batch.args(), window=128)
    torch.testing.assert_close(windowed, sa.sdpa_attention(*batch.args()), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pa.paged_attention(*batch.args(), window=128), windowed, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_windowed_paths_in_half_precision(dtype):
    batch = make_batch(WINDOWED, block_size=8, num_heads=4, num_kv_heads=1, head_dim=32, dtype=dtype, seed=4)
    free_out_of_window(batch, 10)
    assert_windowed_paths_match(batch, 10, scale=0.2)


@pytest.mark.skipif(sa.native_decode() is None, reason="no C compiler here for the decode kernel")
def test_c_decode_kernel_reads_each_sequence_from_its_window_start():
    # Whole sequences per kernel item (many sequences) and one KV head per item (few).
    gen = torch.Generator().manual_seed(5)
    for n in (12, 2):
        lens = [(1, int(x)) for x in torch.randint(1, 300, (n,), generator=gen)]
        batch = make_batch(lens, block_size=16, num_heads=6, num_kv_heads=2, head_dim=64, seed=n)
        free_out_of_window(batch, 33)
        assert_windowed_paths_match(batch, 33, triton=False)


@pytest.mark.skipif(sa.native_decode() is None or sa.native_write() is None,
                    reason="no C compiler here for the CPU kernels")
def test_the_decode_step_function_attends_with_its_plans_window_and_leaves_other_windows_alone():
    from pagedbackend.models.attention import AttentionMetadata, step_context
    lens = [(1, 9), (1, 33), (1, 17)]
    batch = make_batch(lens, block_size=8, num_heads=4, num_kv_heads=2, head_dim=16, seed=6)
    free_out_of_window(batch, 10)
    # The step stores each sequence's last K/V (the values already there) and attends.
    last = sa._slots(batch.block_tables.long(), batch.seq_lens.long() - 1, 8)
    slots = torch.stack([last[s, s] for s in range(3)])
    k_new = torch.stack([batch.keys[s][-1] for s in range(3)])
    v_new = torch.stack([batch.values[s][-1] for s in range(3)])
    plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                  slot_mapping=slots, block_size=8, num_heads=4, num_kv_heads=2, window=10)
    meta = AttentionMetadata(slots, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, plan)
    ops = kernels.get_attention_ops("sdpa", "cpu")
    with torch.inference_mode(), step_context([(batch.k_cache, batch.v_cache)], meta, ops) as step:
        assert step.fast is not None
        assert step.fast(batch.q, k_new, v_new, 0, 0.25, 0) is None   # a full-attention layer: not this plan's
        out = step.fast(batch.q, k_new, v_new, 0, 0.25, 10)
    torch.testing.assert_close(out, windowed_reference(batch, 10, 0.25), atol=2e-5, rtol=2e-5)


def test_a_plan_for_another_window_is_refused():
    batch = make_batch([(1, 9), (3, 12)], block_size=8, num_heads=2, num_kv_heads=1, head_dim=16, seed=7)
    plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                  slot_mapping=torch.zeros(4, dtype=torch.long), block_size=8,
                                  num_kv_heads=1, window=4)
    with pytest.raises(ValueError, match="window 4"):
        sa.sdpa_attention(*batch.args(), plan=plan)


def test_the_plan_gathers_only_keys_inside_the_window():
    batch = make_batch([(1, 30), (1, 5), (6, 26)], block_size=4, num_heads=2, num_kv_heads=1, head_dim=16)
    plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                  slot_mapping=torch.zeros(8, dtype=torch.long), block_size=4,
                                  num_kv_heads=1, window=8)
    assert plan.window == 8 and plan.decode_len == 8   # the longest window, not the longest sequence
    assert torch.isinf(plan.decode_bias[1, 0, 5:]).all() and (plan.decode_bias[0] == 0).all()
    (chunk,) = plan.chunks
    # queries at positions 20..25 see keys from 13 on: 13 keys, a band of width 8
    assert chunk.index.numel() == 13 and chunk.mask.shape == (6, 13) and not chunk.fresh
    assert chunk.mask.sum(1).tolist() == [8] * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the compiled kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_compiled_kernel_attends_to_the_window_on_gpu(dtype):
    batch = make_batch(WINDOWED + [(130, 300)], block_size=16, num_heads=8, num_kv_heads=2, head_dim=128,
                       dtype=dtype, seed=8)
    free_out_of_window(batch, 40)
    expected = windowed_reference(batch, 40)
    atol, rtol = TOL[dtype] if dtype != torch.float32 else (1e-4, 1e-4)
    for attention in (pa.paged_attention, pa.paged_attention_ref):
        got = attention(*batch.to("cuda").args(), window=40)
        torch.testing.assert_close(got.float().cpu(), expected, atol=atol, rtol=rtol)
