"""Causal attention over a paged KV cache for a flat, unpadded batch.

The batch mixes prefills (several query tokens per sequence, possibly on top of
cached prefix blocks) and decodes (one query token). For sequence ``s``:

- its query tokens are rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of ``q``;
- its keys are the first ``seq_lens[s]`` positions reached through
  ``block_tables[s]`` (logical block i -> physical block id);
- the query tokens are the last ``q_len`` of those positions, so query row
  ``i`` sits at position ``seq_lens[s] - q_len + i`` and sees keys ``<=`` it.

Shapes: ``q`` and ``out`` ``[num_tokens, num_heads, head_dim]``; caches
``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_tables`` int32
``[num_seqs, max_blocks_per_seq]``; ``cu_seqlens_q`` int32 ``[num_seqs + 1]``;
``seq_lens`` int32 ``[num_seqs]``. ``num_heads`` is a multiple of
``num_kv_heads`` (grouped-query attention).
"""
import math
from typing import Optional

import torch


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: Optional[float] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference twin: gathers each sequence's K/V and runs softmax in fp32."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, kv_len in enumerate(lens):
        q_start, q_end = cu[s], cu[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        n_blocks = (kv_len + block_size - 1) // block_size
        blocks = block_tables[s, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        k = k.repeat_interleave(group, dim=1)  # [kv_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
        k_pos = torch.arange(kv_len).unsqueeze(0)
        scores.masked_fill_((k_pos > q_pos).unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
