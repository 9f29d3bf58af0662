"""Attention sinks (gpt-oss) in every attention path: each head's learned
logit joins the softmax of every query as one more column with no value, so
the weights of the real keys sum to less than one; with a sliding window
too. The Triton-lang kernel runs in the interpreter: shapes stay tiny."""
from typing import Optional

import pytest
import torch

import pagedbackend.kernels as kernels
from pagedbackend.kernels import paged_attention as pa
from pagedbackend.kernels import sdpa_attention as sa
from paged_batch import TOL, PagedBatch, make_batch


def sink_reference(batch: PagedBatch, sinks: torch.Tensor, window: Optional[int] = None,
                   scale: float = 0.25) -> torch.Tensor:
    """Hugging Face's eager gpt-oss attention per sequence: scores, the sink
    as a last column, softmax, the sink's column dropped."""
    out = torch.zeros(batch.q.shape, dtype=torch.float32)
    cu = batch.cu_seqlens_q.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[cu[s]:cu[s + 1]].float()
        if q.shape[0] == 0:
            continue
        group = q.shape[1] // k.shape[1]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        hidden = k_pos > q_pos
        if window:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        both = torch.cat((scores, sinks.float()[:, None, None].expand(-1, q.shape[0], 1)), dim=-1)
        probs = torch.softmax(both, dim=-1)[..., :-1]
        out[cu[s]:cu[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def every_path(batch: PagedBatch, sinks: torch.Tensor, window: Optional[int], triton: bool = True):
    args = dict(scale=0.25, window=window, sinks=sinks)
    paths = {"twin": pa.paged_attention_ref(*batch.args(), **args),
             "sdpa": sa.sdpa_attention(*batch.args(), **args)}
    saved, sa.USE_NATIVE_DECODE = sa.USE_NATIVE_DECODE, False
    try:
        paths["gather"] = sa.sdpa_attention(*batch.args(), **args)
    finally:
        sa.USE_NATIVE_DECODE = saved
    if triton:
        paths["triton"] = pa.paged_attention(*batch.args(), **args)
    return paths


# Decodes (the C kernel's path on CPU), fresh prefills, chunks on a cached prefix.
LENS = [(1, 37), (23, 23), (1, 5), (9, 50), (1, 1), (6, 30)]


@pytest.mark.parametrize("window", [None, 8])
def test_every_path_puts_each_heads_sink_in_its_softmax(window):
    batch = make_batch(LENS, block_size=8, num_heads=4, num_kv_heads=2, head_dim=32, seed=11)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])   # from a small share of the weight to most of it
    expected = sink_reference(batch, sinks, window)
    atol, rtol = TOL[torch.float32]
    for name, got in every_path(batch, sinks, window).items():
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    # The sinks matter: without them the output differs.
    assert not torch.allclose(expected, sink_reference(batch, torch.full((4,), -1e9), window), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_sinks_in_half_precision(dtype):
    batch = make_batch(LENS, block_size=8, num_heads=4, num_kv_heads=1, head_dim=32, dtype=dtype, seed=12)
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    expected = sink_reference(batch, sinks)
    atol, rtol = TOL[dtype]
    for name, got in every_path(batch, sinks, None, triton=False).items():
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(sa.native_decode() is None or sa.native_write() is None,
                    reason="no C compiler here for the CPU kernels")
def test_the_decode_step_function_passes_the_layers_sinks_to_the_c_kernel():
    from pagedbackend.models.attention import AttentionMetadata, step_context
    batch = make_batch([(1, 9), (1, 33), (1, 17)], block_size=8, num_heads=4, num_kv_heads=2, head_dim=16,
                       seed=13)
    last = sa._slots(batch.block_tables.long(), batch.seq_lens.long() - 1, 8)
    slots = torch.stack([last[s, s] for s in range(3)])
    k_new = torch.stack([batch.keys[s][-1] for s in range(3)])
    v_new = torch.stack([batch.values[s][-1] for s in range(3)])
    plan = sa.plan_sdpa_attention(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables,
                                  slot_mapping=slots, block_size=8, num_heads=4, num_kv_heads=2)
    meta = AttentionMetadata(slots, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, plan)
    sinks = torch.tensor([1.0, -1.0, 0.0, 3.0])
    with torch.inference_mode(), step_context([(batch.k_cache, batch.v_cache)], meta,
                                              kernels.get_attention_ops("sdpa", "cpu")) as step:
        out = step.fast(batch.q, k_new, v_new, 0, 0.25, 0, sinks)
        assert step.fast(batch.q, k_new, v_new, 0, 0.25, 0, sinks.double()) is None   # not float32: general path
    torch.testing.assert_close(out, sink_reference(batch, sinks), atol=2e-5, rtol=2e-5)
