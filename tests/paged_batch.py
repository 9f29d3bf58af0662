"""A paged batch of random K/V scattered into shuffled cache blocks, and the
tolerances of the attention kernels against float32 attention: shared by the
kernel tests (tests/kernels/)."""
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

# (atol, rtol) against fp32 attention on the same (already rounded) inputs.
# bf16 gets a full ulp: the interpreter truncates fp32 -> bf16 instead of rounding.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    keys: List[torch.Tensor]     # per sequence, contiguous [seq_len, num_kv_heads, head_dim]
    values: List[torch.Tensor]

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens)

    def to(self, device) -> "PagedBatch":
        move = lambda t: t.to(device)  # noqa: E731
        return PagedBatch(*map(move, self.args()), keys=list(map(move, self.keys)),
                          values=list(map(move, self.values)))


def make_batch(lens: Sequence[Tuple[int, int]], *, block_size: int, num_heads: int,
               num_kv_heads: int, head_dim: int, dtype=torch.float32, seed: int = 0) -> PagedBatch:
    """Scatter random K/V for sequences given as (q_len, seq_len) into shuffled physical blocks.

    Every cache position that belongs to no sequence (spare blocks, the tail of
    each last block, table padding) holds NaN, so reading one shows in the output.
    """
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    blocks_per_seq = [math.ceil(seq_len / block_size) for _, seq_len in lens]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen)
    spare = int(physical[-1])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(lens), max(blocks_per_seq, default=0) + 1), spare, dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, ((_, seq_len), n) in enumerate(zip(lens, blocks_per_seq)):
        block_tables[s, :n] = physical[used:used + n].to(torch.int32)
        used += n
        k, v = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
        for pos in range(seq_len):
            block, offset = int(block_tables[s, pos // block_size]), pos % block_size
            k_cache[block, offset], v_cache[block, offset] = k[pos], v[pos]
        keys.append(k)
        values.append(v)
    q_lens = torch.tensor([q_len for q_len, _ in lens], dtype=torch.int32)
    cu_seqlens_q = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.cumsum(q_lens, 0)
    q = randn(int(cu_seqlens_q[-1]), num_heads, head_dim)
    seq_lens = torch.tensor([seq_len for _, seq_len in lens], dtype=torch.int32)
    return PagedBatch(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, keys, values)
