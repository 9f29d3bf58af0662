"""Batched LoRA for one projection (Punica's SGMV idea): a step's tokens in
segments that share an adapter, each segment shrunk through its adapter's A
and expanded through its B, added to the projection's output in place.

The adapter pool holds rank pages: row ``p`` of ``A`` ``[pages, in]`` is one
row of some adapter's LoRA A, row ``p`` of ``B`` ``[pages, out]`` the matching
column of its LoRA B with the scaling folded in. ``segs`` (int32 ``[n, 4]``)
gives per segment: where its rows start in ``rows``, how many, where its
pages start in ``pages``, and its rank; ``rows`` are row indices of ``x`` and
``y``, ``pages`` page ids. For every segment::

    y[rows] += (x[rows] @ A[pages].T) @ B[pages]

Three kernels compute it: ``sgmv_ref`` (torch, the reference twin),
``sgmv_triton`` (Triton-lang, a shrink and an expand kernel, for GPUs) and
``sgmv_c`` (``csrc/lora_sgmv.c``, float32 on CPU, built at first use).
"""

import torch

from pagedbackend.kernels import interpret_without_gpu, native

interpret_without_gpu()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["sgmv_c", "sgmv_ref", "sgmv_triton", "c_kernel"]


def sgmv_ref(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, rows: torch.Tensor,
             pages: torch.Tensor, segs: torch.Tensor) -> None:
    """The torch twin: one gather and two matmuls per segment."""
    for row_start, num_rows, page_start, rank in segs.tolist():
        index = rows[row_start:row_start + num_rows].long()
        page = pages[page_start:page_start + rank].long()
        shrunk = x.index_select(0, index).float() @ A.index_select(0, page).float().t()
        delta = shrunk @ B.index_select(0, page).float()
        y.index_add_(0, index, delta.to(y.dtype))


# ---------------------------------------------------------------- C (CPU)

def c_kernel():
    """``lora_sgmv_f32`` of ``csrc/lora_sgmv.c``, built on first use; raises
    RuntimeError saying why it cannot be (no compiler, a failed build)."""
    return native.load("lora_sgmv").lora_sgmv_f32


def sgmv_c(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, rows: torch.Tensor,
           pages: torch.Tensor, segs: torch.Tensor, kernel=None) -> None:
    """The C kernel: float32 CPU tensors; ``x`` and ``y`` rows may be strided
    (``y`` a column slice), ``A``, ``B``, ``rows``, ``pages``, ``segs`` contiguous."""
    kernel = kernel or c_kernel()
    if x.stride(-1) != 1:
        x = x.contiguous()
    status = kernel(x.data_ptr(), x.stride(0), x.shape[1], y.data_ptr(), y.stride(0), y.shape[1],
                    A.data_ptr(), B.data_ptr(), rows.data_ptr(), pages.data_ptr(), segs.data_ptr(),
                    segs.shape[0])
    if status != 0:
        raise MemoryError("lora_sgmv: no memory for the step's shrunk rows")


# ---------------------------------------------------------------- Triton-lang

@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, rows_ptr, pages_ptr, segs_ptr, in_features,
                   stride_x, stride_a, stride_s,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """S[segment rows, :rank] = x[rows] @ A[pages]^T for one block of one segment's rows."""
    seg = tl.program_id(0)
    row_start = tl.load(segs_ptr + seg * 4)
    num_rows = tl.load(segs_ptr + seg * 4 + 1)
    page_start = tl.load(segs_ptr + seg * 4 + 2)
    rank = tl.load(segs_ptr + seg * 4 + 3)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < num_rows
    rows = tl.load(rows_ptr + row_start + m, mask=m_ok, other=0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    pages = tl.load(pages_ptr + page_start + r, mask=r_ok, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        xb = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        ab = tl.load(a_ptr + pages[None, :] * stride_a + k[:, None], mask=r_ok[None, :] & k_ok[:, None],
                     other=0.0).to(tl.float32)
        acc += tl.dot(xb, ab, input_precision="ieee")
    # S rows follow the rows array: row_start + m holds this segment's row m.
    tl.store(s_ptr + (row_start + m)[:, None] * stride_s + r[None, :], acc,
             mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, rows_ptr, pages_ptr, segs_ptr, out_features,
                   stride_s, stride_b, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[rows, block of columns] += S[segment rows, :rank] @ B[pages, block]."""
    seg = tl.program_id(0)
    row_start = tl.load(segs_ptr + seg * 4)
    num_rows = tl.load(segs_ptr + seg * 4 + 1)
    page_start = tl.load(segs_ptr + seg * 4 + 2)
    rank = tl.load(segs_ptr + seg * 4 + 3)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < num_rows
    rows = tl.load(rows_ptr + row_start + m, mask=m_ok, other=0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    pages = tl.load(pages_ptr + page_start + r, mask=r_ok, other=0)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    s = tl.load(s_ptr + (row_start + m)[:, None] * stride_s + r[None, :], mask=m_ok[:, None] & r_ok[None, :],
                other=0.0)
    b = tl.load(b_ptr + pages[:, None] * stride_b + n[None, :], mask=r_ok[:, None] & n_ok[None, :],
                other=0.0).to(tl.float32)
    delta = tl.dot(s, b, input_precision="ieee")
    y_at = y_ptr + rows[:, None] * stride_y + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_at, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=ok)


def _block(size: int, least: int = 16) -> int:
    """The power of two holding ``size`` (at least ``least``: tl.dot's smallest side)."""
    return max(least, triton.next_power_of_2(max(size, 1)))


def sgmv_triton(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, rows: torch.Tensor,
                pages: torch.Tensor, segs: torch.Tensor, max_rows: int, max_rank: int,
                block_m: int = 16, block_k: int = 64, block_n: int = 64) -> None:
    """The Triton-lang kernels: a shrink into a float32 scratch ``[rows, rank]``,
    then an expand into ``y``. ``max_rows`` and ``max_rank``: the largest
    segment's rows and rank (they size the launch grid and the rank block)."""
    if segs.shape[0] == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_r = _block(max_rank)
    scratch = torch.empty((rows.shape[0], block_r), dtype=torch.float32, device=x.device)
    row_blocks = triton.cdiv(max_rows, block_m)
    _shrink_kernel[(segs.shape[0], row_blocks)](
        x, A, scratch, rows, pages, segs, x.shape[1], x.stride(0), A.stride(0), scratch.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k)
    _expand_kernel[(segs.shape[0], row_blocks, triton.cdiv(y.shape[1], block_n))](
        scratch, B, y, rows, pages, segs, y.shape[1], scratch.stride(0), B.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n)
