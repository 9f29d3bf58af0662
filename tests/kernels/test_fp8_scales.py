"""Per-layer k_scale / v_scale of an fp8 KV cache (models/fp8_scales.py):
through the attention op, every path (the C decode kernel, the gather path,
SDPA chunks, the torch twin, the Triton-lang kernel under the interpreter)
stores ``k / k_scale`` and ``v / v_scale`` and gives attention over the cache
read back as ``stored * scale``; scale 1 is the unscaled path bit for bit;
calculated scales are the step's absmax over vLLM's constants."""
import pytest
import torch

from pagedbackend import kernels
from pagedbackend.kernels import paged_attention as pa
from pagedbackend.kernels import sdpa_attention as sa
from pagedbackend.kernels.kv_cache_dtype import decode, encode
from pagedbackend.models.attention import AttentionMetadata, step_context
from pagedbackend.models.fp8_scales import (K_SCALE_CONSTANT, V_SCALE_CONSTANT, KVScales, checkpoint_scale,
                                            scale_value)
from paged_batch import make_batch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
NATIVE = pytest.mark.skipif(sa.native_decode() is None or sa.native_write() is None,
                            reason="no C compiler here for the CPU kernels")
# Decodes and chunks on a cached prefix: every path reads all their keys from
# the cache. (A fresh prefill's SDPA attends to its K/V as computed, unrounded:
# test_a_fresh_prefill_attends_to_its_own_values_at_any_scale.)
MIXED = [(1, 37), (5, 40), (1, 20), (9, 12), (3, 19)]
FRESH = [(9, 9), (6, 6)]
DECODES = [(1, 37), (1, 20), (1, 9)]
BLOCK, HEADS, KV_HEADS, DIM, SCALE = 8, 4, 2, 64, 0.125
# Scales that move the values far from scale 1's bytes: keys x 40 (e4m3's
# subnormals left behind), values / 3 (e5m2's coarse steps land elsewhere).
K_SCALE, V_SCALE = 0.025, 3.0


def _step(lens, seed=3):
    """A batch whose new tokens (each sequence's last q_len) are written by the
    op: the cache holds NaN there, so a missed write shows in the output."""
    batch = make_batch(lens, block_size=BLOCK, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seed=seed)
    positions = [torch.arange(n - q, n) for q, n in lens]
    slots = torch.cat([sa._slots(batch.block_tables[s], p, BLOCK) for s, p in enumerate(positions)])
    k_new = torch.cat([batch.keys[s][p] for s, p in enumerate(positions)]) * 3
    v_new = torch.cat([batch.values[s][p] for s, p in enumerate(positions)]) * 3
    for cache, new in ((batch.k_cache, k_new), (batch.v_cache, v_new)):
        cache.view(-1, KV_HEADS, DIM)[slots] = float("nan")
    return batch, slots, k_new, v_new


def _run(backend, batch, slots, k_new, v_new, dtype, scales, native=True):
    """The op's output and the caches it wrote (fp8, from the batch's values / the scales)."""
    k_scale, v_scale = (scales.k[0], scales.v[0]) if scales is not None else (1.0, 1.0)
    k_cache, v_cache = encode(batch.k_cache / k_scale, dtype), encode(batch.v_cache / v_scale, dtype)
    ops = kernels.get_attention_ops(backend, "cpu")
    plan = ops.plan(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables, slot_mapping=slots,
                    block_size=BLOCK, num_heads=HEADS, num_kv_heads=KV_HEADS, device="cpu", window=None)
    meta = AttentionMetadata(slots, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, plan)
    saved, sa.USE_NATIVE_DECODE = sa.USE_NATIVE_DECODE, native
    try:
        with torch.inference_mode(), step_context([(k_cache, v_cache)], meta, ops, kv_scales=scales) as step:
            fast = step.fast is not None
            out = torch.ops.pagedbackend.paged_attention(batch.q, k_new, v_new, 0, SCALE, 0, None)
    finally:
        sa.USE_NATIVE_DECODE = saved
    return out, k_cache, v_cache, fast


def _reference(batch, slots, k_new, v_new, dtype, k_scale, v_scale):
    """Float32 attention over the cache the torch rule writes, read as ``stored * scale``;
    and that cache."""
    k_ref, v_ref = encode(batch.k_cache / k_scale, dtype), encode(batch.v_cache / v_scale, dtype)
    k_ref.view(-1, KV_HEADS, DIM)[slots] = encode(k_new / k_scale, dtype)
    v_ref.view(-1, KV_HEADS, DIM)[slots] = encode(v_new / v_scale, dtype)
    out = pa.paged_attention_ref(batch.q, decode(k_ref) * k_scale, decode(v_ref) * v_scale, batch.block_tables,
                                 batch.cu_seqlens_q, batch.seq_lens, scale=SCALE)
    return out, k_ref, v_ref


def _same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("backend, lens, native", [("torch", MIXED, True), ("sdpa", MIXED, True),
                                                   ("sdpa", MIXED, False), ("triton", MIXED, True),
                                                   pytest.param("sdpa", DECODES, True, marks=NATIVE)],
                         ids=["torch", "sdpa", "gather", "triton", "c-decode"])
def test_every_attention_path_stores_and_reads_at_the_layers_scales(dtype, backend, lens, native):
    batch, slots, k_new, v_new = _step(lens)
    expected, k_ref, v_ref = _reference(batch, slots, k_new, v_new, dtype, K_SCALE, V_SCALE)
    out, k_cache, v_cache, fast = _run(backend, batch, slots, k_new, v_new, dtype,
                                       KVScales([K_SCALE], [V_SCALE]), native)
    assert fast == (lens is DECODES)   # the decode step's C kernels (paged_decode_kv), else the general path
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    if backend != "triton":   # the interpreter stores an fp8 subnormal as 0 (test_kv_cache_dtype)
        assert _same_bytes(k_cache, k_ref) and _same_bytes(v_cache, v_ref)
    # ... and the scales are not a no-op: the same values at scale 1 are other bytes and other attention
    at_one, k_one, _ = _reference(batch, slots, k_new, v_new, dtype, 1.0, 1.0)
    assert not _same_bytes(k_one, k_ref) and (at_one - expected).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("lens", [MIXED, pytest.param(DECODES, marks=NATIVE)], ids=["mixed", "decodes"])
def test_scale_one_is_the_unscaled_path_bit_for_bit(dtype, lens):
    batch, slots, k_new, v_new = _step(lens)
    plain = _run("sdpa", batch, slots, k_new, v_new, dtype, None)
    ones = _run("sdpa", batch, slots, k_new, v_new, dtype, KVScales([1.0], [1.0]))
    assert torch.equal(plain[0], ones[0]) and _same_bytes(plain[1], ones[1]) and _same_bytes(plain[2], ones[2])


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_a_fresh_prefill_attends_to_its_own_values_at_any_scale(dtype):
    batch, slots, k_new, v_new = _step(FRESH)
    k_full, v_full = batch.k_cache.clone(), batch.v_cache.clone()
    k_full.view(-1, KV_HEADS, DIM)[slots], v_full.view(-1, KV_HEADS, DIM)[slots] = k_new, v_new
    full = pa.paged_attention_ref(batch.q, k_full, v_full, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
                                  scale=SCALE)
    for scales in (None, KVScales([K_SCALE], [V_SCALE])):
        out = _run("sdpa", batch, slots, k_new, v_new, dtype, scales)[0]
        torch.testing.assert_close(out, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_calculated_scales_are_the_first_steps_absmax_over_vllms_constants(dtype):
    batch, slots, k_new, v_new = _step(FRESH)   # the first step: prefills
    scales = KVScales([1.0], [1.0], calculate=True)
    _run("torch", batch, slots, k_new, v_new, dtype, scales)   # not armed (a warm-up): scale 1 stays
    assert scales.k == [1.0] and scales.v == [1.0] and not scales.step_done()
    scales.arm()
    out, k_cache, v_cache, _ = _run("torch", batch, slots, k_new, v_new, dtype, scales)
    k_scale = float(k_new.abs().max() / K_SCALE_CONSTANT)
    v_scale = float(v_new.abs().max() / V_SCALE_CONSTANT)
    assert scales.k == [k_scale] and scales.v == [v_scale] and k_scale != 1.0
    # the stored bytes are the new K/V at those scales, their largest at 200 and 100
    stored_k = k_cache.view(-1, KV_HEADS, DIM)[slots]
    stored_v = v_cache.view(-1, KV_HEADS, DIM)[slots]
    assert _same_bytes(stored_k, encode(k_new / k_scale, dtype))
    assert _same_bytes(stored_v, encode(v_new / v_scale, dtype))
    assert float(decode(stored_k).abs().max()) == float(encode(torch.tensor([K_SCALE_CONSTANT]), dtype).float())
    assert float(decode(stored_v).abs().max()) == float(encode(torch.tensor([V_SCALE_CONSTANT]), dtype).float())
    expected, _, _ = _reference(batch, slots, k_new, v_new, dtype, k_scale, v_scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    # once: the step ends the calculation, and a later step keeps the scales
    assert scales.step_done() and not scales.step_done()
    scales.arm()
    _run("torch", batch, slots, k_new * 2, v_new * 2, dtype, scales)
    assert scales.k == [k_scale] and scales.v == [v_scale]


def test_checkpoint_scale_names_and_values():
    assert checkpoint_scale("layers.3.self_attn.k_scale") == (3, "k")
    assert checkpoint_scale("layers.0.self_attn.v_scale") == (0, "v")
    assert checkpoint_scale("layers.12.self_attn.kv_scale") == (12, "kv")
    assert checkpoint_scale("layers.2.self_attn.k_proj.output_scale") == (2, "k")
    assert checkpoint_scale("layers.2.self_attn.v_proj.output_scale") == (2, "v")
    assert checkpoint_scale("layers.2.self_attn.q_scale") == (2, "q")
    assert checkpoint_scale("layers.2.self_attn.k_proj.weight") is None
    assert checkpoint_scale("layers.2.self_attn.k_proj.weight_scale") is None
    assert scale_value("x", torch.tensor(0.5)) == 0.5 and scale_value("x", torch.tensor([2.0])) == 2.0
    with pytest.raises(ValueError, match="only per-tensor scales"):
        scale_value("model.layers.0.self_attn.k_scale", torch.ones(2))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            scale_value("model.layers.0.self_attn.k_scale", torch.tensor(bad))
    assert KVScales.for_model(torch.nn.Linear(1, 1), torch.bfloat16, True) is None   # not an fp8 cache
