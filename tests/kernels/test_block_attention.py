"""Bidirectional blocks (Gemma 3's images) inside causal paged attention:
through the attention op, with each backend, a block's rows see every key
up to the block's end, other rows stay causal, and a sliding window still
cuts keys behind each row (Hugging Face's mask: causal OR same block, AND
the window). Blocks may start before the step (a cached prefix ending
inside one) and a step may hold several, in several sequences."""
import pytest
import torch
import torch.nn.functional as F

from pagedbackend.kernels import get_attention_ops
from pagedbackend.models.attention import AttentionMetadata, ImageBlock, paged_attention, step_context
from paged_batch import TOL, make_batch

# (q_len, seq_len) per sequence: a fresh prefill, a chunk on a cached prefix, a decode.
LENS = [(20, 20), (12, 22), (1, 9)]
# Per sequence, bidirectional blocks as (first, last) positions.
BLOCKS = [[(5, 9), (12, 14)], [(8, 13), (16, 19)], []]
BLOCK_SIZE, HEADS, KV_HEADS, DIM = 4, 4, 2, 16


def reference(batch, blocks, window):
    """Dense fp32 attention per sequence with Hugging Face's Gemma 3 mask."""
    out = torch.zeros(batch.q.shape)
    cu = batch.cu_seqlens_q.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[cu[s]:cu[s + 1]]
        seq_len = k.shape[0]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        group = torch.full((seq_len,), -1)
        for i, (a, b) in enumerate(blocks[s]):
            group[a:b + 1] = i
        same = (group[q_pos] == group[k_pos]) & (group[q_pos] >= 0)
        visible = (k_pos <= q_pos) | same
        if window:
            visible &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                           v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=visible)
        out[cu[s]:cu[s + 1]] = o.transpose(0, 1)
    return out


def step_blocks(batch, blocks):
    """The step's ImageBlocks: each block's rows inside the step."""
    cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    found = []
    for s, spans in enumerate(blocks):
        start = lens[s] - (cu[s + 1] - cu[s])
        for a, b in spans:
            first = max(a, start)
            if first <= b:
                found.append(ImageBlock(s, cu[s] + first - start, cu[s] + b + 1 - start, first, b))
    return found


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton"])
@pytest.mark.parametrize("window", [None, 3, 8])
def test_block_rows_see_their_whole_block_and_other_rows_stay_causal(backend, window):
    batch = make_batch(LENS, block_size=BLOCK_SIZE, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    ops = get_attention_ops(backend, "cpu")
    cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    slots, new_k, new_v = [], [], []
    for s in range(len(LENS)):
        for pos in range(lens[s] - (cu[s + 1] - cu[s]), lens[s]):
            slots.append(int(batch.block_tables[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            new_k.append(batch.keys[s][pos])
            new_v.append(batch.values[s][pos])
    slot_mapping = torch.tensor(slots)
    plan = ops.plan(batch.cu_seqlens_q, batch.seq_lens, block_tables=batch.block_tables, slot_mapping=slot_mapping,
                    block_size=BLOCK_SIZE, num_heads=HEADS, num_kv_heads=KV_HEADS, device="cpu", window=window)
    meta = AttentionMetadata(slot_mapping, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, plan)
    blocks = step_blocks(batch, BLOCKS)
    assert len(blocks) == 4
    with step_context([(batch.k_cache, batch.v_cache)], meta, ops, image_blocks=blocks):
        out = paged_attention(batch.q, torch.stack(new_k), torch.stack(new_v), 0, DIM ** -0.5, window or 0, None)
    with step_context([(batch.k_cache, batch.v_cache)], meta, ops):
        causal = paged_attention(batch.q, torch.stack(new_k), torch.stack(new_v), 0, DIM ** -0.5, window or 0, None)
    expected = reference(batch, BLOCKS, window)
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    # the blocks changed what their rows see (a real check), and only their rows
    in_block = torch.zeros(len(out), dtype=torch.bool)
    for b in blocks:
        in_block[b.rows_start:b.rows_end - 1] = True   # a block's last row sees no more than causal
    assert not torch.allclose(out[in_block], causal[in_block], atol=1e-3)
    outside = torch.ones(len(out), dtype=torch.bool)
    for b in blocks:
        outside[b.rows_start:b.rows_end] = False
    torch.testing.assert_close(out[outside], causal[outside], atol=0, rtol=0)
