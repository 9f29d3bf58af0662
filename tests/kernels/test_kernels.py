"""Kernel specifications: the Triton-lang kernels, their torch reference twins
and PyTorch's scaled_dot_product_attention agree on seeded random paged batches.

Without a GPU the kernels run in the Triton interpreter, so shapes stay tiny.
"""
import math
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace
from typing import List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

import pagedbackend.kernels as kernels
from pagedbackend.kernels import kv_write
from pagedbackend.kernels import paged_attention as pa
from pagedbackend.kernels import sdpa_attention as sa
from paged_batch import TOL, PagedBatch, make_batch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def sdpa_attention(batch: PagedBatch, scale: Optional[float] = None) -> torch.Tensor:
    """fp32 causal attention per sequence on contiguous K/V, via PyTorch SDPA."""
    num_heads = batch.q.shape[1]
    out = torch.zeros(batch.q.shape, dtype=torch.float32, device=batch.q.device)
    cu = batch.cu_seqlens_q.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[cu[s]:cu[s + 1]].float()
        q_len, seq_len = q.shape[0], k.shape[0]
        if q_len == 0:
            continue
        group = num_heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=visible, scale=scale)
        out[cu[s]:cu[s + 1]] = o.transpose(0, 1)
    return out


def assert_matches_sdpa(batch: PagedBatch, scale: Optional[float] = None) -> None:
    """Kernel, reference twin, the CPU serving path and SDPA agree within the dtype's tolerance."""
    atol, rtol = TOL[batch.q.dtype]
    expected = sdpa_attention(batch, scale)
    got = pa.paged_attention(*batch.args(), scale=scale)
    ref = pa.paged_attention_ref(*batch.args(), scale=scale)
    served = sa.sdpa_attention(*batch.args(), scale=scale)
    gathered = gather_path_attention(batch, scale)   # the decodes' fallback path
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    torch.testing.assert_close(gathered.float(), expected, atol=atol, rtol=rtol)
    assert served.dtype == batch.q.dtype and served.shape == batch.q.shape
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(ref.float(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(served.float(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


def gather_path_attention(batch: PagedBatch, scale: Optional[float] = None) -> torch.Tensor:
    """The CPU serving path with its C decode kernel turned off."""
    saved, sa.USE_NATIVE_DECODE = sa.USE_NATIVE_DECODE, False
    try:
        return sa.sdpa_attention(*batch.args(), scale=scale)
    finally:
        sa.USE_NATIVE_DECODE = saved


@pytest.mark.skipif(sa.native_decode() is None, reason="no C compiler here for the decode kernel")
@pytest.mark.parametrize("seed", range(4))
def test_decode_kernel_over_many_long_sequences_matches_sdpa(seed):
    # Enough sequences that each kernel item is a whole sequence (the few-sequence
    # case, one KV head per item, is in every batch above); lengths up to 700.
    gen = torch.Generator().manual_seed(seed)
    lens = [(1, int(n)) for n in torch.randint(1, 700, (9,), generator=gen)]
    batch = make_batch(lens, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=seed)
    served = sa.sdpa_attention(*batch.args())
    torch.testing.assert_close(served, sdpa_attention(batch), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(served, gather_path_attention(batch), atol=2e-5, rtol=2e-5)


def test_decode_through_a_block_the_cache_lacks_raises_instead_of_reading_past_it():
    batch = make_batch([(1, 20), (1, 7)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, seed=3)
    tables = batch.block_tables.clone()
    tables[0, 1] = batch.k_cache.shape[0] + 5   # a corrupt table: no such block
    args = list(batch.args())
    args[3] = tables
    with pytest.raises(IndexError):
        sa.sdpa_attention(*args)


def random_lens(kind: str, n: int, seed: int) -> List[Tuple[int, int]]:
    """(q_len, seq_len) pairs: fresh prefills, prefills on a cached prefix, or decodes."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    if kind == "prefill":
        return [(L, L) for L in (r(1, 40) for _ in range(n))]
    if kind == "chunk":
        return [(c, c + r(1, 40)) for c in (r(2, 20) for _ in range(n))]
    if kind == "decode":
        return [(1, r(1, 70)) for _ in range(n)]
    raise ValueError(kind)


# ---------------------------------------------------------------- paged attention

# (block_size, num_heads, num_kv_heads, head_dim): every block size, GQA ratio 1/3/4, both head dims.
SHAPES = [
    (8, 2, 2, 64),
    (16, 3, 1, 64),
    (32, 8, 2, 128),
    (8, 4, 1, 128),
    (16, 6, 2, 128),
    (32, 2, 2, 64),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", SHAPES)
def test_prefill_of_ragged_sequences_matches_sdpa(block_size, num_heads, num_kv_heads, head_dim):
    lens = random_lens("prefill", 3, seed=block_size + num_heads)
    lens.append((block_size + 1, block_size + 1))  # one past a block boundary
    batch = make_batch(lens, block_size=block_size, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, seed=1)
    assert_matches_sdpa(batch)


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", SHAPES[:3])
def test_query_chunk_on_cached_prefix_attends_to_prefix_and_causally_to_itself(
        block_size, num_heads, num_kv_heads, head_dim):
    lens = random_lens("chunk", 3, seed=10 + block_size)
    batch = make_batch(lens, block_size=block_size, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, seed=2)
    assert_matches_sdpa(batch)


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", SHAPES[:3])
def test_decode_batch_attends_to_whole_cached_sequence(block_size, num_heads, num_kv_heads, head_dim):
    lens = random_lens("decode", 5, seed=20 + block_size)
    lens.append((1, 2 * block_size))  # exactly filling its last block
    batch = make_batch(lens, block_size=block_size, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, seed=3)
    assert_matches_sdpa(batch)


@pytest.mark.parametrize("head_dim", [32, 80, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (14, 2)])
def test_decodes_of_other_head_sizes_match_sdpa(head_dim, num_heads, num_kv_heads):
    # The C decode kernel is specialised (vectorised by hand) for head sizes 32, 64,
    # 128 and 256; others take its generic loop. Query groups of 3 and of 7 heads take
    # the value pass's runs of rows whole and split (4 + 3, or 2 + 2 + 2 + 1).
    lens = random_lens("decode", 5, seed=30 + head_dim)
    batch = make_batch(lens, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, seed=6)
    assert_matches_sdpa(batch)


MIXED = [(1, 37), (23, 23), (1, 5), (9, 50), (0, 12), (1, 1), (17, 33)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch_matches_sdpa_in_every_dtype(dtype):
    # Decodes, fresh prefills, chunks on a prefix and a sequence with no new query.
    batch = make_batch(MIXED, block_size=16, num_heads=3, num_kv_heads=1, head_dim=64, dtype=dtype, seed=4)
    assert_matches_sdpa(batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_blocks_gqa4_head128_in_every_dtype(dtype):
    batch = make_batch(MIXED, block_size=8, num_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype, seed=5)
    assert_matches_sdpa(batch)


@pytest.mark.parametrize("seed", range(24))
def test_random_paged_batches_match_sdpa(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    block_size, num_heads, num_kv_heads, head_dim = pick(SHAPES)
    lens = sum((random_lens(kind, int(torch.randint(0, 3, (1,), generator=gen)), seed=seed * 3 + i)
                for i, kind in enumerate(("prefill", "chunk", "decode"))), []) or [(1, 1)]
    order = torch.randperm(len(lens), generator=gen).tolist()
    batch = make_batch([lens[i] for i in order], block_size=block_size, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=pick(DTYPES), seed=seed)
    assert_matches_sdpa(batch)


def test_long_query_chunk_spans_several_query_tiles():
    # 64 rows / 4 heads per group = 16 query tokens per tile: 45 tokens take three tiles.
    batch = make_batch([(45, 60), (1, 9)], block_size=16, num_heads=4, num_kv_heads=1, head_dim=64, seed=6)
    assert_matches_sdpa(batch)


def test_a_plan_tile_split_across_programs_matches_sdpa():
    # fp32 at head dim 256 holds at most 16 rows per program (kernels.paged_attention.tiling),
    # so a 64-token plan tile runs as four programs: 40 tokens fill three, the fourth returns.
    from pagedbackend.kernels.paged_attention import plan_paged_attention, tiling
    assert tiling(256, lowp_dot=False).max_rows == 16
    batch = make_batch([(40, 52), (1, 7)], block_size=16, num_heads=1, num_kv_heads=1, head_dim=256, seed=7)
    assert plan_paged_attention(batch.cu_seqlens_q, batch.seq_lens, 1, 1).block_q == 64
    assert_matches_sdpa(batch)


def test_explicit_scale_is_applied():
    batch = make_batch(MIXED[:4], block_size=16, num_heads=2, num_kv_heads=1, head_dim=64, seed=7)
    assert_matches_sdpa(batch, scale=0.3)
    default = pa.paged_attention(*batch.args())
    assert not torch.allclose(default, pa.paged_attention(*batch.args(), scale=0.3))


def test_strided_query_and_output_views_are_respected():
    batch = make_batch(MIXED, block_size=16, num_heads=4, num_kv_heads=2, head_dim=64, seed=8)
    num_tokens, num_heads, head_dim = batch.q.shape
    # q as a slice of a fused qkv projection; out as every other row of a bigger buffer.
    qkv = torch.randn(num_tokens, 3 * num_heads, head_dim)
    qkv[:, :num_heads] = batch.q
    q = qkv[:, :num_heads]
    buffer = torch.full((2 * num_tokens, num_heads, head_dim), 7.0)
    out = buffer[::2]
    assert not q.is_contiguous() and not out.is_contiguous()

    result = pa.paged_attention(q, *batch.args()[1:], out=out)

    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, sdpa_attention(batch), atol=2e-5, rtol=2e-5)
    assert torch.all(buffer[1::2] == 7.0)


def test_half_precision_dot_path_used_on_gpu_stays_within_fp16_tolerance(monkeypatch):
    # On a GPU fp16/bf16 tiles go to tl.dot unconverted; the interpreter can run that path for fp16.
    monkeypatch.setattr(pa, "_half_precision_dot", lambda q: q.dtype == torch.float16)
    batch = make_batch(MIXED, block_size=16, num_heads=3, num_kv_heads=1, head_dim=64,
                       dtype=torch.float16, seed=9)
    got = pa.paged_attention(*batch.args())
    torch.testing.assert_close(got.float(), sdpa_attention(batch), atol=4e-3, rtol=4e-3)


def test_query_tiles_cover_each_sequence_without_padding_the_batch():
    q_lens = torch.tensor([1, 0, 9, 4])
    tile_seq, tile_q_start = pa._query_tiles(q_lens, 4, torch.device("cpu"))
    assert tile_seq.tolist() == [0, 2, 2, 2, 3]
    assert tile_q_start.tolist() == [0, 0, 4, 8, 0]


# ---------------------------------------------------------------- KV write

def _kv_case(dtype, cache_dtype, seed, block_size=8, dim=64):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, heads, tokens = 6, 3, 11
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype)
    # key/value as slices of one fused [tokens, 2 * heads, dim] tensor: strided views
    kv = torch.randn(tokens, 2 * heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(torch.int32)
    slots[[2, 7]] = -1
    return kv[:, :heads], kv[:, heads:], k_cache, v_cache, slots


@pytest.mark.parametrize("dtype,block_size,dim", [(torch.float32, 8, 64), (torch.float16, 16, 128),
                                                  (torch.bfloat16, 32, 64)], ids=str)
def test_write_kv_matches_reference_and_skips_negative_slots(dtype, block_size, dim):
    key, value, k_cache, v_cache, slots = _kv_case(dtype, dtype, seed=11, block_size=block_size, dim=dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    before = k_cache.clone()

    kv_write.write_kv(key, value, k_cache, v_cache, slots)
    kv_write.write_kv_ref(key, value, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    flat = k_cache.view(-1, *k_cache.shape[2:])
    written = slots[slots >= 0].long()
    assert torch.equal(flat[written], key[slots >= 0])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[untouched], before.view_as(flat)[untouched])


@pytest.mark.parametrize("cache_dtype", (torch.float16, torch.bfloat16), ids=str)
def test_write_kv_converts_fp32_tokens_to_the_cache_dtype(cache_dtype):
    key, value, k_cache, v_cache, slots = _kv_case(torch.float32, cache_dtype, seed=12)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    kv_write.write_kv(key, value, k_cache, v_cache, slots)
    kv_write.write_kv_ref(key, value, k_ref, v_ref, slots)

    atol, rtol = TOL[cache_dtype]
    torch.testing.assert_close(k_cache.float(), k_ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(v_cache.float(), v_ref.float(), atol=atol, rtol=rtol)


def test_decode_sees_the_token_write_kv_just_stored():
    lens = [(1, 13), (1, 16), (1, 17)]
    batch = make_batch(lens, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64, seed=13)
    # Scatter the newest token of each sequence afresh, replacing what make_batch put there.
    new_k = torch.randn(len(lens), 2, 64)
    new_v = torch.randn(len(lens), 2, 64)
    slots = torch.tensor([int(batch.block_tables[s, (L - 1) // 8]) * 8 + (L - 1) % 8
                          for s, (_, L) in enumerate(lens)], dtype=torch.int32)
    for s in range(len(lens)):
        batch.keys[s][-1], batch.values[s][-1] = new_k[s], new_v[s]

    kv_write.write_kv(new_k, new_v, batch.k_cache, batch.v_cache, slots)

    torch.testing.assert_close(pa.paged_attention(*batch.args()), sdpa_attention(batch), atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- CPU serving path

def _step_of(batch: PagedBatch, lens, dtype):
    """The new tokens of ``batch`` (the last ``q_len`` of each sequence): their
    K/V, slots, and the cache with those slots poisoned with NaN."""
    block_size = batch.k_cache.shape[1]
    ks, vs, slots = [], [], []
    for s, (q_len, seq_len) in enumerate(lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(batch.block_tables[s, pos // block_size]) * block_size + pos % block_size)
        ks.append(batch.keys[s][seq_len - q_len:])
        vs.append(batch.values[s][seq_len - q_len:])
    slots = torch.tensor(slots, dtype=torch.long)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = float("nan")
    v_cache.view(-1, *v_cache.shape[2:])[slots] = float("nan")
    return torch.cat(ks).to(dtype), torch.cat(vs).to(dtype), slots, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_forward_writes_the_step_then_attends_like_sdpa(dtype):
    # Decodes, fresh prefills, chunks on a prefix and an empty query, GQA 3.
    batch = make_batch(MIXED, block_size=16, num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype, seed=16)
    k, v, slots, k_cache, v_cache = _step_of(batch, MIXED, dtype)
    plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                  slot_mapping=slots, block_size=16, num_kv_heads=2)
    out = sa.sdpa_forward(batch.q, k, v, k_cache, v_cache, slots, batch.block_tables,
                          batch.cu_seqlens_q, batch.seq_lens, 0.125, plan)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), sdpa_attention(batch, 0.125), atol=atol, rtol=rtol)
    written = k_cache.view(-1, 2, 64)[slots]
    assert torch.equal(written, k) and torch.equal(v_cache.view(-1, 2, 64)[slots], v)


def test_sdpa_plan_pads_decodes_of_unequal_length_with_a_minus_infinity_bias():
    lens = [(1, 3), (1, 18), (1, 18)]
    batch = make_batch(lens, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64, seed=17)
    plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                  slot_mapping=torch.zeros(3, dtype=torch.long), block_size=8,
                                  num_kv_heads=2)
    assert plan.decode_all and plan.decode_len == 18 and plan.chunks == []
    assert plan.decode_bias.shape == (3 * 2, 1, 18)
    assert torch.isinf(plan.decode_bias[:2, 0, 3:]).all() and (plan.decode_bias[:2, 0, :3] == 0).all()
    assert (plan.decode_bias[2:] == 0).all()
    # Rows (sequence 0, head 1) point at head 1 of sequence 0's slots, padding at its first slot.
    table = batch.block_tables[0].long()
    first = int(table[0]) * 8
    row = plan.decode_index.view(3, 2, 18)[0, 1]
    assert row[:3].tolist() == [(first + p) * 2 + 1 for p in range(3)]
    assert set(row[3:].tolist()) == {first * 2 + 1}


def test_sdpa_write_skips_negative_slots():
    key, value, k_cache, v_cache, slots = _kv_case(torch.float32, torch.float32, seed=18)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    sa.write_kv_sdpa(key, value, k_cache, v_cache, slots)
    kv_write.write_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ---------------------------------------------------------------- dispatch

def test_torch_backend_gives_the_reference_twins():
    expected = (kv_write.write_kv_ref, pa.paged_attention_ref, pa.plan_paged_attention_ref, None, None,
                False)
    assert kernels.get_attention_ops("torch", "cpu") == expected
    assert kernels.get_attention_ops("torch", "cuda") == expected


def test_sdpa_backend_and_auto_on_cpu_give_the_cpu_serving_path():
    expected = (sa.write_kv_sdpa, sa.sdpa_attention, sa.plan_sdpa_attention, sa.sdpa_forward,
                sa.decode_step, False)
    assert kernels.get_attention_ops("sdpa", "cpu") == expected
    assert kernels.get_attention_ops("auto", torch.device("cpu")) == expected


def test_triton_backend_and_auto_on_cuda_give_the_kernels():
    # Only these kernels read every length on the device: a decode step can be recorded.
    expected = (kv_write.write_kv, pa.paged_attention, pa.plan_paged_attention, None, None, True)
    assert kernels.get_attention_ops("triton", "cpu") == expected
    assert kernels.get_attention_ops("auto", "cuda:0") == expected


def test_unknown_backend_is_rejected_by_name():
    with pytest.raises(ValueError, match="'flash'"):
        kernels.get_attention_ops("flash", "cpu")


def test_importing_kernels_defers_triton_and_its_interpreter_setting_until_a_kernel_is_used():
    code = ("import os, sys, torch, pagedbackend.kernels as kernels\n"
            "assert 'triton' not in sys.modules and 'TRITON_INTERPRET' not in os.environ\n"
            "kernels.write_kv\n"
            "assert 'triton' in sys.modules\n"
            "assert os.environ.get('TRITON_INTERPRET') == (None if torch.cuda.is_available() else '1')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[2], env=env)


# ---------------------------------------------------------------- on a GPU

@GPU
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_kernels_match_sdpa_on_gpu(dtype):
    lens = MIXED + random_lens("chunk", 2, seed=30) + [(130, 300)]
    atol, rtol = TOL[dtype] if dtype != torch.float32 else (1e-4, 1e-4)
    for block_size, num_heads, num_kv_heads, head_dim in SHAPES:
        batch = make_batch(lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=dtype, seed=14).to("cuda")
        expected = sdpa_attention(batch)
        for attention in (pa.paged_attention, pa.paged_attention_ref):
            got = attention(*batch.args())
            torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)

    key, value, k_cache, v_cache, slots = (t.to("cuda") for t in _kv_case(dtype, dtype, seed=15))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_write.write_kv(key, value, k_cache, v_cache, slots)
    kv_write.write_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.skipif(sa.native_decode() is None, reason="no C compiler here for the decode kernel")
def test_loading_the_cpu_kernels_keeps_subnormal_floats():
    # A library linked with -ffast-math would flush subnormals to zero in the
    # whole process (crtfastmath.o), changing every float computation after it.
    from pagedbackend.kernels import packed_linear
    packed_linear.load_library()
    assert sa.native_decode() is not None
    assert torch.tensor([1e-40], dtype=torch.float32).item() != 0.0
    assert (torch.tensor([1e-38]) / 1000).item() != 0.0
    assert float("1e-310") * 1.0 != 0.0


@pytest.mark.skipif(sa.native_write() is None, reason="no C compiler here for the write kernel")
def test_the_c_kv_write_stores_what_index_copy_does_and_refuses_a_slot_past_the_cache():
    torch.manual_seed(7)
    caches = {native: (torch.zeros(10, 4, 2, 8), torch.zeros(10, 4, 2, 8)) for native in (True, False)}
    # V a slice of a fused QKV output, as in the model: its tokens' rows lie apart
    key, value = torch.randn(6, 2, 8), torch.randn(6, 3 * 16)[:, 32:].view(6, 2, 8)
    assert not value.is_contiguous() and sa._rows_contiguous(value)
    calls = []
    real_write = sa.native_write()
    sa._natives["paged_write_kv"] = lambda *args: calls.append(args) or real_write(*args)
    slots = torch.tensor([39, 0, 5, 17, 4, 22])
    plan = SimpleNamespace(write_slots=slots)
    saved = sa.USE_NATIVE_DECODE
    try:
        for native, (k_cache, v_cache) in caches.items():
            sa.USE_NATIVE_DECODE = native
            sa.write_kv_sdpa(key, value, k_cache, v_cache, slots, plan)
        assert torch.equal(caches[True][0], caches[False][0]) and torch.equal(caches[True][1], caches[False][1])
        assert torch.equal(caches[True][0].view(-1, 2, 8)[slots], key)
        sa.USE_NATIVE_DECODE = True
        k_cache, v_cache = caches[True]
        before = k_cache.clone()
        bad = torch.tensor([3, 40])   # 40 slots in the cache: the second is past its end
        assert len(calls) == 1   # the strided V went through the C kernel, not index_copy_
        assert torch.equal(caches[True][1].view(-1, 2, 8)[slots], value)
        refused = real_write(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                             bad.data_ptr(), 2, 2, 8, 40, 16, 48, 0)
        assert refused == -1 and torch.equal(k_cache, before)   # the kernel writes nothing
        with pytest.raises(IndexError):   # and the write falls through to index_copy_'s error
            sa.write_kv_sdpa(key[:2], value[:2], k_cache, v_cache, bad, SimpleNamespace(write_slots=bad))
    finally:
        sa.USE_NATIVE_DECODE = saved
        sa._natives["paged_write_kv"] = real_write



def _decode_step_inputs(layers: int, seed: int):
    """A decode-only step over `layers` layers' caches: the plan, the slots of
    the new tokens, and per layer q, k and v (v a slice of a fused QKV output,
    as in the model)."""
    batch = make_batch([(1, 9), (1, 33), (1, 17)], block_size=8, num_heads=6, num_kv_heads=2,
                       head_dim=16, seed=seed)
    slots = sa._slots(batch.block_tables.long(), batch.seq_lens.long() - 1, 8)
    slots = torch.stack([slots[s, s] for s in range(3)])
    plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                  slot_mapping=slots, block_size=8, num_heads=6, num_kv_heads=2)
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(layers):
        qkv = torch.randn(3, 6 * 16 + 2 * 2 * 16, generator=gen)
        q = qkv[:, :96].reshape(3, 6, 16).contiguous()
        k = qkv[:, 96:128].reshape(3, 2, 16).contiguous()
        v = qkv[:, 128:].view(3, 2, 16)
        inputs.append((q, k, v))
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(layers)]
    return batch, slots, plan, inputs, caches


def test_a_decode_step_function_stores_and_attends_as_the_general_path_does():
    from pagedbackend.models.attention import AttentionMetadata, step_context
    if sa.native_decode() is None or sa.native_write() is None:
        pytest.skip("no C compiler here for the CPU kernels")
    ops = kernels.get_attention_ops("sdpa", "cpu")
    results = {}
    for fast in (True, False):
        batch, slots, plan, inputs, caches = _decode_step_inputs(3, seed=5)
        meta = AttentionMetadata(slots, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, plan)
        saved = sa.USE_DECODE_STEP
        sa.USE_DECODE_STEP = fast
        try:
            with torch.inference_mode(), step_context(caches, meta, ops) as step:
                assert (step.fast is not None) == fast
                outs = []
                for layer, (q, k, v) in enumerate(inputs):
                    if fast:   # the step's function takes these tensors itself, not the general path
                        outs.append(step.fast(q, k, v, layer, 0.25))
                        assert outs[-1] is not None
                    else:
                        outs.append(torch.ops.pagedbackend.paged_attention(q, k, v, layer, 0.25, 0, None))
        finally:
            sa.USE_DECODE_STEP = saved
        results[fast] = outs, caches
    (fast_outs, fast_caches), (outs, caches) = results[True], results[False]
    for a, b in zip(fast_outs, outs):
        assert torch.equal(a, b)
    same = lambda a, b: bool(((a == b) | (a.isnan() & b.isnan())).all())  # noqa: E731 (NaN: never written)
    for (ka, va), (kb, vb) in zip(fast_caches, caches):
        assert same(ka, kb) and same(va, vb)
    for layer, (q, k, v) in enumerate(_decode_step_inputs(3, seed=5)[3]):   # the new K/V were stored
        assert torch.equal(fast_caches[layer][1].view(-1, 2, 16)[slots], v)


def test_bfloat16_decodes_take_the_c_kernels_and_agree_with_the_gather_path():
    # A bfloat16 model's decodes: q and the new K/V widened to float32 for the
    # C kernels, the output narrowed back; the cache holds the model's dtype.
    dtype = torch.bfloat16
    from pagedbackend.models.attention import AttentionMetadata, step_context
    if sa.native_decode() is None or sa.native_write() is None:
        pytest.skip("no C compiler here for the CPU kernels")
    ops = kernels.get_attention_ops("sdpa", "cpu")
    results = {}
    for native in (True, False):
        batch, slots, plan, inputs, _ = _decode_step_inputs(2, seed=8)
        caches = [(batch.k_cache.to(dtype), batch.v_cache.to(dtype)) for _ in inputs]
        inputs = [(q.to(dtype), k.to(dtype), v.to(dtype)) for q, k, v in inputs]
        meta = AttentionMetadata(slots, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, plan)
        saved = sa.USE_NATIVE_DECODE
        sa.USE_NATIVE_DECODE = native
        try:
            with torch.inference_mode(), step_context(caches, meta, ops) as step:
                assert (step.fast is not None) == native
                outs = [torch.ops.pagedbackend.paged_attention(q, k, v, layer, 0.25, 0, None)
                        for layer, (q, k, v) in enumerate(inputs)]
                if native:   # the step's function took them, and the general path's C call agrees with it
                    q, k, v = inputs[0]
                    general = sa._decodes(q, *caches[0], plan, 0.25)
                    assert general.dtype == dtype and torch.equal(general, outs[0])
        finally:
            sa.USE_NATIVE_DECODE = saved
        results[native] = outs, caches
    (c_outs, c_caches), (outs, caches) = results[True], results[False]
    for a, b in zip(c_outs, outs):
        assert a.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    same = lambda a, b: bool(((a == b) | (a.isnan() & b.isnan())).all())  # noqa: E731 (NaN: never written)
    for (ka, va), (kb, vb) in zip(c_caches, caches):   # the rows stored are the same bits
        assert same(ka, kb) and same(va, vb)
    # and a float32 reference over the same cache: both within half precision of it
    batch, slots, plan, inputs, _ = _decode_step_inputs(2, seed=8)
    q = inputs[1][0].to(dtype).float()
    ref = sa._decodes(q, c_caches[1][0].float(), c_caches[1][1].float(), plan, 0.25)
    torch.testing.assert_close(c_outs[1].float(), ref, atol=1e-2, rtol=1e-2)


def test_a_decode_step_function_leaves_what_it_does_not_fit_to_the_general_path():
    from pagedbackend.models.attention import AttentionMetadata, step_context
    if sa.native_decode() is None or sa.native_write() is None:
        pytest.skip("no C compiler here for the CPU kernels")
    ops = kernels.get_attention_ops("sdpa", "cpu")
    batch, slots, plan, inputs, caches = _decode_step_inputs(1, seed=6)
    meta = AttentionMetadata(slots, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, plan)
    with torch.inference_mode(), step_context(caches, meta, ops) as step:
        q, k, v = inputs[0]
        assert step.fast(q.double(), k, v, 0, 0.25) is None   # another dtype
        assert step.fast(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, 0, 0.25) is None   # strided q
    # a step with a prefill chunk gets no step function
    mixed = make_batch([(1, 9), (4, 12)], block_size=8, num_heads=6, num_kv_heads=2, head_dim=16)
    mixed_slots = torch.arange(5)
    mixed_plan = sa.plan_sdpa_attention(mixed.cu_seqlens_q, mixed.seq_lens, block_tables=mixed.block_tables,
                                        slot_mapping=mixed_slots, block_size=8, num_heads=6, num_kv_heads=2)
    assert sa.decode_step(mixed_plan, [(mixed.k_cache, mixed.v_cache)]) is None
    # a slot past the cache: the step's function writes nothing and the general path raises
    bad = slots.clone()
    bad[1] = batch.k_cache.shape[0] * 8
    bad_plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                      slot_mapping=bad, block_size=8, num_heads=6, num_kv_heads=2)
    before = [c.clone() for c in caches[0]]
    meta = AttentionMetadata(bad, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, bad_plan)
    with torch.inference_mode(), step_context(caches, meta, ops) as step:
        assert step.fast is not None and step.fast(q, k, v, 0, 0.25) is None
        assert all(bool(((c == b) | (c.isnan() & b.isnan())).all()) for c, b in zip(caches[0], before))
        with pytest.raises(IndexError):
            torch.ops.pagedbackend.paged_attention(q, k, v, 0, 0.25, 0, None)
