"""Attention of a bidirectional block's query rows (Gemma 3: one image's
soft tokens see each other, inside the causal model), over the paged cache.

A block's rows are computed in one prefill chunk that reaches the block's
last position (the scheduler never ends a chunk inside one), so by the time
a layer attends, every key of the block is in the cache. The rows' causal
output from the attention backend is replaced by this one: each row sees
every key up to the block's last position, and, on a sliding layer, only
keys after ``position - window`` (Hugging Face's Gemma 3 mask: causal OR
same block, AND the sliding window). The keys are gathered from the cache
through the sequence's block table (decoded from its dtype, as the gather
paths read it) and attended with an explicit mask by
``scaled_dot_product_attention``; any device.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from pagedbackend.kernels.kv_cache_dtype import decode


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    first_pos: int, last_pos: int, scale: float, window: Optional[int] = None) -> torch.Tensor:
    """``q`` ``[n, heads, d]``: the rows at positions ``first_pos ..
    first_pos + n - 1`` of one sequence (``block_table``: its row of the
    step's block tables), all inside a block ending at ``last_pos``; returns
    their attention ``[n, heads, d]``, each over keys ``max(0, p - window + 1)
    .. last_pos`` (all from 0 without a window)."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first_key = 0 if not window else max(0, first_pos - window + 1)
    key_pos = torch.arange(first_key, last_pos + 1, device=q.device)
    slots = block_table.to(q.device).long()[key_pos // block_size] * block_size + key_pos % block_size
    k = decode(k_cache.view(-1, num_kv_heads, k_cache.shape[3]).index_select(0, slots), q.dtype)
    v = decode(v_cache.view(-1, num_kv_heads, v_cache.shape[3]).index_select(0, slots), q.dtype)
    mask = None
    if window:
        q_pos = torch.arange(first_pos, first_pos + n, device=q.device)
        mask = key_pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out[0].transpose(0, 1)
