"""KV caches in bfloat16, int8 and fp8 (kv_cache_dtype): every write path stores
the same rows as the torch rule (kernels/kv_cache_dtype.py), and every
attention path (the C decode kernel, the gather path, SDPA chunks, the
Triton-lang kernel under the interpreter, the torch twin) over such a cache
gives what float32 attention gives over the same cache dequantised.

Rows of no sequence are NaN before they are encoded (an int8 row's scale
becomes NaN), so reading one shows in the output.
"""
from types import SimpleNamespace

import pytest
import torch

from pagedbackend.core.kv_memory import KVModel
from pagedbackend.kernels import kv_write
from pagedbackend.kernels import paged_attention as pa
from pagedbackend.kernels import sdpa_attention as sa
from pagedbackend.kernels.kv_cache_dtype import (FP8_MAX, cache_dtype, decode, encode, head_dim_of, quantize_rows,
                                                 row_width, scale_view)
from pagedbackend.worker.loader import kv_block_bytes
from paged_batch import make_batch

KINDS = (torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# How far attention over each cache may drift from float32 attention (and must, a little).
DRIFT = {torch.bfloat16: 0.02, torch.int8: 0.05, torch.float8_e4m3fn: 0.2, torch.float8_e5m2: 0.4}
NATIVE = pytest.mark.skipif(sa.native_decode() is None, reason="no C compiler here for the decode kernel")
# Decodes, fresh prefills, a chunk on a cached prefix.
MIXED = [(1, 37), (5, 40), (1, 70), (9, 9), (1, 1), (3, 19)]


def encoded(batch, dtype):
    """The batch's caches in ``dtype`` and, as the reference reads them, dequantised to float32."""
    k, v = encode(batch.k_cache, dtype), encode(batch.v_cache, dtype)
    return k, v, decode(k), decode(v)


def every_path(batch, k, v, window=None, sinks=None):
    """Each attention path's output over caches ``k``/``v``: name -> tensor."""
    args = (batch.q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens)
    outs = {"triton": pa.paged_attention(*args, window=window, sinks=sinks),
            "torch": pa.paged_attention_ref(*args, window=window, sinks=sinks),
            "sdpa": sa.sdpa_attention(*args, window=window, sinks=sinks)}
    saved, sa.USE_NATIVE_DECODE = sa.USE_NATIVE_DECODE, False
    try:
        outs["gather"] = sa.sdpa_attention(*args, window=window, sinks=sinks)
    finally:
        sa.USE_NATIVE_DECODE = saved
    return outs


def test_int8_rows_hold_values_and_a_float16_scale_per_16_channels():
    x = torch.zeros(2, 64)
    x[0, :4] = torch.tensor([0.5, -127 / 64, 1.0, 0.25])        # absmax 127 * 2^-6: scale 2^-6 exactly
    x[0, 16:19] = torch.tensor([127.0, -63.5, 62.5]) / 1024    # scale 2^-10: ties to even
    x[0, 32] = 2.0                                             # 2 / 127 is no float16: the one above it
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, 72) and row_width(64, torch.int8) == 72
    assert rows[0, :4].tolist() == [32, -127, 64, 16]
    assert rows[0, 16:19].tolist() == [127, -64, 62]
    scales = scale_view(rows).float()
    assert scales.dtype == torch.float32 and scale_view(rows).dtype == torch.float16
    above = torch.tensor(2.0 / 127).to(torch.float16)
    above = above if above.float() * 127 >= 2.0 else (above.view(torch.int16) + 1).view(torch.float16)
    assert scales[0].tolist() == [2.0 ** -6, 2.0 ** -10, above.item(), 0.0]
    step_below = (above.view(torch.int16) - 1).view(torch.float16).float()
    assert step_below * 127 < 2.0 <= scales[0, 2] * 127 and rows[0, 32] == 127   # the smallest that holds 2
    assert scales[1].tolist() == [0.0] * 4 and decode(rows)[1].tolist() == [0.0] * 64 and head_dim_of(rows) == 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 128, generator=gen) * torch.rand(50, 3, 128, generator=gen) * 10
    rows = quantize_rows(x)
    scale = scale_view(rows).float().unsqueeze(-1)
    err = (decode(rows) - x).abs().unflatten(-1, (8, 16))
    absmax = x.unflatten(-1, (8, 16)).abs().amax(-1, keepdim=True)
    assert bool((err <= scale / 2).all())
    assert bool((scale * 127 >= absmax).all()) and bool((scale <= absmax / 127 * (1 + 2.0 ** -10)).all())
    with pytest.raises(ValueError, match="a head size that is a multiple of 16"):
        quantize_rows(torch.zeros(3, 40))


def _edge_rows():
    """Rows at float16's ends: huge (the scale saturates at 65504), zero, with
    float16-subnormal scales, float32 subnormals, exactly 127 * 65504."""
    x = torch.randn(6, 1, 64, generator=torch.Generator().manual_seed(4))
    x[0] *= 1e30
    x[1] = 0.0
    x[2] *= 1e-6
    x[3, 0, :16] = torch.tensor([1e-40, -3e-45] * 8)
    x[4, 0, :16] = 127 * 65504.0
    x[4, 0, 16:] *= 3e5
    x[5, 0, :16] *= 1e-3
    return x


def test_int8_scales_saturate_and_stay_positive_at_float16s_ends():
    x = _edge_rows()
    rows = quantize_rows(x)
    scales, out = scale_view(rows).float(), decode(rows)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(scales).all())
    assert scales[0].tolist() == [[65504.0] * 4] and rows[0, 0, :64].abs().max() == 127   # saturated, finite
    assert torch.equal(out[0], (x[0].sign() * (x[0].abs() / 65504.0).round().clamp(max=127) * 65504.0))
    assert scales[1].tolist() == [[0.0] * 4] and out[1].abs().max() == 0
    # A tiny absmax keeps a non-zero scale (float16 subnormals: steps of 2^-24) and its values.
    tiny = scales[2][scales[2] < 2.0 ** -14]
    assert tiny.numel() == 4 and bool((tiny > 0).all())
    assert bool(((out[2] - x[2]).abs() <= scales[2].repeat_interleave(16, -1) / 2).all()) and out[2].abs().max() > 0
    assert scales[3, 0, 0] == 2.0 ** -24 and out[3, 0, :16].abs().max() == 0   # float32 subnormals read as 0
    assert scales[4, 0, 0] == 65504.0 and out[4, 0, 0] == 127 * 65504.0   # the largest that is held exactly
    assert bool(((out[4] - x[4]).abs() <= scales[4].repeat_interleave(16, -1) / 2).all())
    assert bool(((out[5] - x[5]).abs() <= scales[5].repeat_interleave(16, -1) / 2).all())


@pytest.mark.parametrize("dtype", KINDS, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(6, 2, 64, 8), (4, 4, 128, 16),
                                                                        (8, 2, 96, 4), (4, 2, 48, 8)])
def test_every_attention_path_matches_attention_over_the_dequantised_cache(dtype, num_heads, num_kv_heads,
                                                                           head_dim, block_size):
    batch = make_batch(MIXED, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, seed=head_dim)
    k, v, k_ref, v_ref = encoded(batch, dtype)
    assert k.shape[-1] == row_width(head_dim, dtype)
    expected = pa.paged_attention_ref(batch.q, k_ref, v_ref, batch.block_tables, batch.cu_seqlens_q,
                                      batch.seq_lens)
    assert not expected.isnan().any()
    for name, out in every_path(batch, k, v).items():
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=name)
    # ... and it is attention over values near the float32 ones, not over something else
    full = pa.paged_attention_ref(*batch.args())
    assert 0 < (expected - full).abs().max() < DRIFT[dtype]


@pytest.mark.parametrize("dtype", KINDS, ids=str)
def test_sliding_window_and_sinks_over_a_quantised_cache(dtype):
    lens = [(1, 50), (1, 9), (7, 45), (12, 12)]
    batch = make_batch(lens, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64, seed=5)
    k, v, k_ref, v_ref = encoded(batch, dtype)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for window, sink in ((16, None), (16, sinks), (None, sinks)):
        expected = pa.paged_attention_ref(batch.q, k_ref, v_ref, batch.block_tables, batch.cu_seqlens_q,
                                          batch.seq_lens, window=window, sinks=sink)
        for name, out in every_path(batch, k, v, window=window, sinks=sink).items():
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=f"{name} {window}")


def test_every_attention_path_reads_float16_subnormal_scales():
    # Values of about 1e-4: every int8 scale below float16's normals (2^-14).
    batch = make_batch(MIXED, block_size=8, num_heads=6, num_kv_heads=2, head_dim=64, seed=5)
    k = encode(batch.k_cache * 1e-2, torch.int8)
    v = encode(batch.v_cache * 1e-4, torch.int8)
    finite = scale_view(v).float().isfinite()
    assert bool((scale_view(v).float()[finite] < 2.0 ** -14).all()) and bool((scale_view(v).float()[finite] > 0).all())
    expected = pa.paged_attention_ref(batch.q, decode(k), decode(v), *batch.args()[3:]) * 1e4
    for name, out in every_path(batch, k, v).items():
        torch.testing.assert_close(out * 1e4, expected, atol=2e-5, rtol=2e-5, msg=name)


@NATIVE
@pytest.mark.parametrize("dtype", KINDS, ids=str)
def test_decode_kernel_over_many_long_sequences(dtype):
    # Enough sequences that each C work item is a whole sequence; lengths up to 1500.
    gen = torch.Generator().manual_seed(3)
    lens = [(1, int(n)) for n in torch.randint(1, 1500, (9,), generator=gen)]
    batch = make_batch(lens, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=3)
    k, v, k_ref, v_ref = encoded(batch, dtype)
    expected = pa.paged_attention_ref(batch.q, k_ref, v_ref, batch.block_tables, batch.cu_seqlens_q,
                                      batch.seq_lens)
    torch.testing.assert_close(sa.sdpa_attention(*(batch.q, k, v), *batch.args()[3:]), expected,
                               atol=2e-5, rtol=2e-5)


@NATIVE
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int8), ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_kernel_at_contexts_that_fetch_keys_far_ahead(dtype, block_size):
    # Items of 2,048 keys and more fetch float32 and bfloat16 key rows three
    # tiles ahead; a window starts them inside a block. Two sequences (an item
    # a KV head) and four (an item a sequence) on two threads.
    gen = torch.Generator().manual_seed(7)
    for lens, window in (([(1, 2600), (1, 2049)], None), ([(1, 2600), (1, 2049), (1, 3001), (1, 2100)], 2100)):
        batch = make_batch(lens, block_size=block_size, num_heads=9, num_kv_heads=3, head_dim=64,
                           seed=int(torch.randint(100, (1,), generator=gen)))
        k, v, k_ref, v_ref = encoded(batch, dtype)
        expected = pa.paged_attention_ref(batch.q, k_ref, v_ref, batch.block_tables, batch.cu_seqlens_q,
                                          batch.seq_lens, window=window)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            out = sa.sdpa_attention(batch.q, k, v, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
                                    window=window)
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=f"{lens} {window}")


def _write_case(seed=11, block_size=8, heads=3, dim=64, tokens=11, num_blocks=6, edges=False):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(tokens, 2 * heads, dim, generator=gen) * 3   # K and V: strided slices of one tensor
    if edges:   # _edge_rows as keys and their negatives as values, once per head
        rows = _edge_rows().expand(-1, heads, -1)
        kv = torch.cat([rows, -rows.flip(0)], dim=1)
        tokens = kv.shape[0]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(torch.int64)
    return kv[:, :heads], kv[:, heads:], slots, (num_blocks, block_size, heads, dim)


@pytest.mark.parametrize("dtype, edges", [(kind, False) for kind in KINDS] + [(torch.int8, True)],
                         ids=lambda p: str(p) if isinstance(p, torch.dtype) else ("edges" if p else "randn"))
def test_every_write_path_stores_the_torch_rule_rows(dtype, edges):
    key, value, slots, (blocks, block_size, heads, dim) = _write_case(edges=edges)
    shape = (blocks, block_size, heads, row_width(dim, dtype))
    caches = {name: (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for name in ("torch", "triton", "native", "index_copy")}
    kv_write.write_kv_ref(key, value, *caches["torch"], slots)
    kv_write.write_kv(key, value, *caches["triton"], slots)
    plan = sa.plan_sdpa_attention(torch.tensor([0, 1]), torch.tensor([1]), block_tables=torch.zeros(1, 1),
                                  slot_mapping=slots, block_size=block_size, num_kv_heads=heads)
    sa.write_kv_sdpa(key, value, *caches["native"], slots, plan)
    sa.write_kv_sdpa(key, value, *caches["index_copy"], slots)   # no plan: the torch fallback
    k_ref, v_ref = caches["torch"]
    assert torch.equal(decode(k_ref).view(-1, heads, dim)[slots], decode(encode(key, dtype)))
    for name, (k, v) in caches.items():
        if name == "triton" and not k.is_cuda and dtype == torch.bfloat16:   # the interpreter truncates fp32 -> bf16: an ulp
            torch.testing.assert_close(k.float(), k_ref.float(), rtol=2 ** -7, atol=0, msg=name)
            torch.testing.assert_close(v.float(), v_ref.float(), rtol=2 ** -7, atol=0, msg=name)
        elif dtype in FP8 and name == "triton" and not k.is_cuda:
            # the interpreter stores an fp8 subnormal as 0 (a GPU keeps it): else bit for bit
            tiny = 2.0 ** -6 if dtype == torch.float8_e4m3fn else 2.0 ** -14
            for got, ref in ((k, k_ref), (v, v_ref)):
                same = got.view(torch.uint8) == ref.view(torch.uint8)
                assert bool((same | ((ref.float().abs() < tiny) & (got.float() == 0))).all()), name
        elif dtype in FP8:   # bit for bit (torch.equal has no fp8 kernel: the bytes)
            assert torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8)), name
            assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8)), name
        else:
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref), name


@NATIVE
@pytest.mark.parametrize("dtype", KINDS, ids=str)
def test_decode_step_writes_then_attends_in_the_cache_dtype(dtype):
    lens = [(1, 20), (1, 33), (1, 5)]
    batch = make_batch(lens, block_size=8, num_heads=6, num_kv_heads=2, head_dim=64, seed=9)
    k_cache, v_cache, _, _ = encoded(batch, dtype)
    slots = torch.tensor([int(batch.block_tables[s, (n - 1) // 8]) * 8 + (n - 1) % 8 for s, (_, n) in enumerate(lens)])
    new_k, new_v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                  slot_mapping=slots, block_size=8, num_kv_heads=2)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_write.write_kv_ref(new_k, new_v, ref_k, ref_v, slots)
    expected = pa.paged_attention_ref(batch.q, decode(ref_k), decode(ref_v), batch.block_tables,
                                      batch.cu_seqlens_q, batch.seq_lens, scale=0.125)
    step = sa.decode_step(plan, [(k_cache, v_cache)])
    assert step is not None
    out = step(batch.q, new_k, new_v, 0, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(k_cache[..., :64], ref_k[..., :64], rtol=0, atol=0, equal_nan=True)


def test_pool_holds_twice_the_tokens_per_halving_of_the_row():
    # The default model (SmolLM2-135M): 30 layers, 3 KV heads of 64.
    args = SimpleNamespace(num_layers=30, head_dim=64)   # what a KV block's size reads of ModelArgs
    budget = 256 * 1024 * 1024
    tokens = {dtype: budget // kv_block_bytes(args, 16, 3, dtype) * 16
              for dtype in (torch.float32, torch.bfloat16, torch.int8)}
    assert tokens[torch.bfloat16] / tokens[torch.float32] == pytest.approx(2.0, rel=1e-3)
    # int8: 64 bytes of values and four 2-byte scales per row against bfloat16's 128 bytes
    assert tokens[torch.int8] / tokens[torch.bfloat16] == pytest.approx(128 / 72, rel=1e-3)
    assert tokens[torch.int8] / tokens[torch.float32] == pytest.approx(256 / 72, rel=1e-3)
    assert KVModel(30, 3, 64, 1, scale_bytes=8).kv_bytes_per_token == 2 * 30 * 3 * 72
    assert kv_block_bytes(args, 16, 3, torch.int8) == KVModel(30, 3, 64, 1, scale_bytes=8).kv_bytes_per_block(16)


def test_the_setting_names_its_formats_and_what_it_refuses():
    from pagedbackend.config import EngineConfig
    assert cache_dtype("auto", torch.float16) == torch.float16
    assert cache_dtype("int8", torch.float32) == torch.int8
    assert cache_dtype("fp8", torch.float32) == cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, int8, fp8"):
        EngineConfig(kv_cache_dtype="fp8_e4m3fnuz")
    # Each rank holds its own heads' rows in the format (tests/worker/test_tensor_parallel.py).
    assert EngineConfig(kv_cache_dtype="int8", tensor_parallel_size=2).kv_cache_dtype == "int8"


@NATIVE
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_the_c_writer_rounds_every_float_as_torch_does(dtype):
    # A spread of every float32 bit pattern (normals, subnormals of both
    # formats, values past the largest fp8, infinities, NaNs) and chosen edges.
    edges = [0.0, -0.0, 448.0, 449.0, 464.0, 465.0, -500.0, 57344.0, 61440.0, 1e30, float("inf"),
             -float("inf"), float("nan"), 2.0 ** -10, 2.0 ** -17, 3 * 2.0 ** -18, 2.0 ** -9 * 1.5, 2.0 ** -16 * 2.5]
    bits = torch.arange(0, 2 ** 32, 65537, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([bits, torch.tensor(edges)])
    x = torch.cat([x, torch.zeros(-x.numel() % 64)]).view(-1, 1, 64)
    n = x.shape[0]
    k, v = torch.zeros(n, 1, 1, 64, dtype=dtype), torch.zeros(n, 1, 1, 64, dtype=dtype)
    slots = torch.arange(n, dtype=torch.int64)
    assert sa.native_write()(x.data_ptr(), x.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), n, 1, 64,
                             n, 64, 64, sa.native_kind(dtype)) == 0
    expected = x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).view(torch.uint8)
    assert torch.equal(k.view(n, 1, 64).view(torch.uint8), expected)
    assert torch.equal(v.view(n, 1, 64).view(torch.uint8), expected)
    # and every byte reads back as torch widens it (the decode kernel's table)
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = torch.isfinite(every.float())
    assert torch.equal(decode(encode(every.float()[finite], dtype)), every.float()[finite])


def test_fp8_pool_holds_twice_bfloat16s_tokens():
    args = SimpleNamespace(num_layers=30, head_dim=64)
    budget = 256 * 1024 * 1024
    bf16 = budget // kv_block_bytes(args, 16, 3, torch.bfloat16) * 16
    for dtype in FP8:
        assert row_width(64, dtype) == 64 and head_dim_of(torch.zeros(1, 64, dtype=dtype)) == 64
        assert budget // kv_block_bytes(args, 16, 3, dtype) * 16 / bf16 == pytest.approx(2.0, rel=1e-3)


@pytest.mark.parametrize("capability, model, kv, refusal", [
    ((8, 0), torch.bfloat16, torch.float8_e4m3fn, "compute capability 8.9 or newer"),
    ((8, 9), torch.bfloat16, torch.float8_e4m3fn, None),
    ((8, 0), torch.bfloat16, torch.float8_e5m2, None),
    ((9, 0), torch.float32, torch.int8, "needs dtype bfloat16 or float16"),
    ((8, 0), torch.float16, torch.int8, None),
])
def test_a_cache_the_triton_kernels_cannot_run_on_a_gpu_is_refused_by_name(monkeypatch, capability, model, kv,
                                                                           refusal):
    """The GPU's compute capability is faked here (no GPU on this machine): it is
    what the rule reads, and the same launches fail to compile for sm_80 in
    ``gpu_report`` (e4m3 has no conversion there)."""
    from pagedbackend.kernels.kv_cache_dtype import check_triton_cache
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    check = lambda: check_triton_cache(torch.device("cuda", 0), model, kv, "the setting")   # noqa: E731
    if refusal is None:
        check()
    else:
        with pytest.raises(ValueError, match=refusal):
            check()
    check_triton_cache(torch.device("cpu"), model, kv, "the setting")   # the CPU kernels take every cache
