"""Attention over the paged KV cache: store the step's K/V, then attend.

The layer holds this rank's head counts only; which kernels run (Triton-lang
or their torch twins) is chosen once per model by
``pagedbackend.kernels.get_attention_ops``.
"""
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import nn

KVCache = Tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, block_size, kv_heads, head_dim]


@dataclass
class AttentionMetadata:
    """The flat batch's layout, shared by every layer of one forward step.

    ``slot_mapping`` (int64 ``[num_tokens]``): cache slot of each new token;
    ``block_tables`` (int32 ``[num_seqs, max_blocks]``, 0-padded);
    ``cu_seqlens_q`` (int32 ``[num_seqs + 1]``): query rows of each sequence;
    ``seq_lens`` (int32 ``[num_seqs]``): cached + new tokens of each sequence;
    ``plan``: the attention backend's per-step layout (``AttentionOps.plan``),
    built once per step on the host.
    """
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    plan: Optional[Any] = None


class PagedAttention(nn.Module):
    """Writes the new tokens' K/V into their slots, then runs causal attention
    of the queries against everything cached for their sequence."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q`` ``[T, heads, d]``, ``k``/``v`` ``[T, kv_heads, d]`` -> ``[T, heads, d]``."""
        k_cache, v_cache = kv_cache
        self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.ops.attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                  meta.seq_lens, scale=self.scale, plan=meta.plan)
