"""Mixture-of-experts feed-forward on GPUs: a grouped GEMM in Triton-lang and
its torch twin (the reference loop over the active experts is ``moe_ref``).

Every path computes, for tokens ``x`` ``[T, H]`` routed to experts ``ids``
``[T, k]`` with weights ``weights`` ``[T, k]`` (float32):

    out[t] = sum_j weights[t, j] * (w2[e] . act(w13[e] . x[t] + b13[e]) + b2[e]),  e = ids[t, j]

with ``w13`` ``[E, 2I, H]`` (the I gate rows, then the I up rows), ``w2``
``[E, H, I]``, optional biases ``b13`` ``[E, 2I]`` and ``b2`` ``[E, H]``.
An id outside ``[0, E)`` contributes nothing (an expert held by another rank).
``act`` is ``silu`` (``silu(gate) * up``) or ``swigluoai`` (gpt-oss:
``gate`` clamped above at ``limit``, ``up`` to ``[-limit, limit]``, then
``gate * sigmoid(alpha * gate) * (up + 1)``).

The GPU path sorts the step's (token, slot) pairs by expert into row blocks of
``BLOCK_M`` (each block one expert, padded; ``align_by_expert``, all on the
device, no host sync) and runs one grouped GEMM launch per projection: a
program multiplies one row block by a column tile of its expert's weight, so
each expert's weights are read once per column tile however many tokens it
serves. The second GEMM multiplies in the routing weights; the slots are
summed per token at the end.
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedbackend.kernels import interpret_without_gpu
from pagedbackend.kernels.moe_ref import ACTIVATIONS, activate, fused_experts_torch  # noqa: F401

interpret_without_gpu()   # before any kernel is defined
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

@dataclass
class ExpertAlignment:
    """The step's (token, slot) pairs sorted by expert in row blocks of
    ``block_m``: ``pair_ids`` int32 ``[max_rows]`` (pair index ``t * k + j``,
    or the number of pairs for padding), ``block_expert`` int32
    ``[max_rows / block_m]`` (each block's expert), ``num_rows`` int32 ``[1]``
    (rows in use, a multiple of ``block_m``). Device tensors; the sizes are
    upper bounds known without a host sync."""
    pair_ids: torch.Tensor
    block_expert: torch.Tensor
    num_rows: torch.Tensor
    block_m: int
    num_pairs: int


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort the pairs of ``ids`` ``[T, k]`` by expert, each expert's run padded
    to a multiple of ``block_m`` rows; ids outside ``[0, num_experts)`` are left out."""
    flat = ids.reshape(-1).long()
    pairs = flat.numel()
    device = flat.device
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    # scatter_add, not bincount: bincount on CUDA reads its input's maximum back to the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)
    expert_of = key[order]
    valid = expert_of < num_experts
    first_pair = torch.cumsum(counts, 0) - counts   # of each expert, in sorted order
    safe = expert_of.clamp(max=num_experts - 1)
    rank = torch.arange(pairs, device=device) - first_pair[safe]
    dest = ends[safe] - padded[safe] + rank
    bound = pairs + min(num_experts, pairs) * (block_m - 1)
    max_rows = max(block_m, (bound + block_m - 1) // block_m * block_m)
    # Pairs left out land in one spare row past the end: no boolean indexing,
    # so no host sync (a CUDA graph can hold the step).
    pair_ids = torch.full((max_rows + 1,), pairs, dtype=torch.int32, device=device)
    pair_ids.scatter_(0, torch.where(valid, dest, max_rows), order.to(torch.int32))
    pair_ids = pair_ids[:max_rows]
    starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp(max=num_experts - 1)
    return ExpertAlignment(pair_ids, block_expert.to(torch.int32), ends[-1:].to(torch.int32),
                           block_m, pairs)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, weight_ptr, pair_ptr, block_expert_ptr, num_rows_ptr,
    N, K, num_pairs,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_biase, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOWP_DOT: tl.constexpr,
):
    # Program = (row block of one expert, column tile). Row r of the block is
    # pair pair_ptr[r]; its input row is a[pair // A_ROW_DIV].
    block = tl.program_id(0)
    tile = tl.program_id(1)
    if block * BLOCK_M >= tl.load(num_rows_ptr):
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    valid = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=valid[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
        if LOWP_DOT:
            acc = tl.dot(a.to(a_ptr.dtype.element_ty), b.to(b_ptr.dtype.element_ty), acc)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_biase + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


GemmFn = Callable[..., None]


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], c: torch.Tensor,
                 weights: Optional[torch.Tensor], align: ExpertAlignment, a_row_div: int,
                 block_n: int = 64, block_k: int = 32) -> None:
    """``c[p] = (a[p // a_row_div] . b[e]^T + bias[e]) (* weights[p])`` for every
    aligned pair ``p`` of expert ``e``; ``b`` ``[E, N, K]``. Rows of ``c`` of
    pairs left out are not written."""
    n, k = b.shape[1], b.shape[2]
    grid = (align.block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, bias if bias is not None else b, c, weights if weights is not None else c,
        align.pair_ids, align.block_expert, align.num_rows, n, k, align.num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        bias.stride(0) if bias is not None else 0, c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        LOWP_DOT=a.is_cuda and a.dtype in (torch.float16, torch.bfloat16),
    )


def grouped_gemm_ref(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], c: torch.Tensor,
                     weights: Optional[torch.Tensor], align: ExpertAlignment, a_row_div: int,
                     block_n: int = 64, block_k: int = 32) -> None:
    """Torch twin of :func:`grouped_gemm`: the same rows, blocks and experts, in fp32."""
    rows = torch.arange(align.pair_ids.numel(), device=a.device)
    pair = align.pair_ids.long()
    used = (pair < align.num_pairs) & (rows < align.num_rows.long())
    pair = pair[used]
    expert = align.block_expert.long()[rows[used] // align.block_m]
    y = torch.einsum("pk,pnk->pn", a[pair // a_row_div].float(), b[expert].float())
    if bias is not None:
        y = y + bias[expert].float()
    if weights is not None:
        y = y * weights.reshape(-1)[pair, None].float()
    c[pair] = y.to(c.dtype)


def fused_experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, b13: Optional[torch.Tensor] = None,
                          b2: Optional[torch.Tensor] = None, activation: str = "silu",
                          alpha: float = 1.702, limit: float = 7.0, gemm: GemmFn = grouped_gemm,
                          block_m: int = 16, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """The experts through two grouped GEMMs (``gemm``: the Triton-lang kernel
    or, for its tests, its twin); see the module docstring."""
    tokens, k = ids.shape
    intermediate = w2.shape[2]
    if tokens == 0:
        return torch.zeros_like(x)
    align = align_by_expert(ids, w13.shape[0], block_m)
    h1 = x.new_empty((tokens * k, 2 * intermediate))
    gemm(x, w13, b13, h1, None, align, k, block_n, block_k)
    h = activate(h1, activation, alpha, limit)   # rows of pairs left out are never read
    h2 = x.new_zeros((tokens * k, w2.shape[1]))
    gemm(h, w2, b2, h2, weights.to(torch.float32).contiguous(), align, 1, block_n, block_k)
    return h2.view(tokens, k, -1).sum(dim=1)
