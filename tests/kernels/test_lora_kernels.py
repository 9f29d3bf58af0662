"""The batched LoRA kernels (kernels/lora.py) against a plain per-row loop:
the torch twin, the C kernel (float32, CPU) and the Triton-lang kernels under
the interpreter (TRITON_INTERPRET=1 without a GPU), on segments of scattered
rows and pages of different ranks, into a column slice of a wider output."""
import pytest
import torch

from pagedbackend.kernels import lora


def case(seed: int, dtype=torch.float32):
    """x [12, 48], a pool of 40 pages, three segments (ranks 3, 5, 2) over scattered rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 48, generator=g).to(dtype)
    A, B = torch.randn(40, 48, generator=g).to(dtype), torch.randn(40, 36, generator=g).to(dtype)
    rows = torch.tensor([0, 3, 5, 1, 2, 11], dtype=torch.int32)
    pages = torch.tensor([7, 1, 30, 2, 3, 4, 5, 6, 39, 10], dtype=torch.int32)
    segs = torch.tensor([[0, 3, 0, 3], [3, 2, 3, 5], [5, 1, 8, 2]], dtype=torch.int32)
    y = torch.randn(12, 50, generator=g).to(dtype)   # the projection's output; the module owns columns 7..42
    return x, A, B, rows, pages, segs, y


def expected(x, A, B, rows, pages, segs, y):
    out = y.clone().double()
    for row_start, count, page_start, rank in segs.tolist():
        page = pages[page_start:page_start + rank].long()
        for row in rows[row_start:row_start + count].tolist():
            out[row, 7:43] += (x[row].double() @ A[page].double().t()) @ B[page].double()
    return out


def run(kernel, x, A, B, rows, pages, segs, y):
    out = y.clone()
    kernel(out[:, 7:43], x, A, B, rows, pages, segs)
    return out


@pytest.mark.parametrize("name", ["torch", "c", "triton"])
def test_each_kernel_adds_every_segments_delta_to_its_rows_only(name):
    x, A, B, rows, pages, segs, y = case(0)
    kernel = {"torch": lora.sgmv_ref, "c": lora.sgmv_c,
              "triton": lambda *args: lora.sgmv_triton(*args, max_rows=3, max_rank=5)}[name]
    out = run(kernel, x, A, B, rows, pages, segs, y)
    want = expected(x, A, B, rows, pages, segs, y)
    assert torch.allclose(out.double(), want, atol=1e-4, rtol=1e-5)
    untouched = [r for r in range(12) if r not in rows.tolist()]
    assert torch.equal(out[untouched], y[untouched]) and torch.equal(out[:, :7], y[:, :7])


def test_no_segment_changes_nothing():
    x, A, B, rows, pages, _, y = case(1)
    none = torch.zeros((0, 4), dtype=torch.int32)
    for kernel in (lora.sgmv_ref, lora.sgmv_c, lambda *a: lora.sgmv_triton(*a, max_rows=0, max_rank=0)):
        assert torch.equal(run(kernel, x, A, B, rows, pages, none, y), y)


def test_the_torch_twin_serves_bfloat16_within_its_rounding():
    x, A, B, rows, pages, segs, y = case(2, torch.bfloat16)
    out = run(lora.sgmv_ref, x, A, B, rows, pages, segs, y)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), expected(x, A, B, rows, pages, segs, y), atol=0.5, rtol=2e-2)


def test_the_c_kernel_covers_segments_longer_than_its_chunks():
    """A prefill-sized segment (150 rows, rank 20) beside a short one (3 rows,
    rank 37): work items cut both at 64 rows and 16 pages."""
    g = torch.Generator().manual_seed(3)
    x, A, B = torch.randn(160, 40, generator=g), torch.randn(64, 40, generator=g), torch.randn(64, 70, generator=g)
    rows = torch.cat([torch.arange(5, 155), torch.tensor([0, 158, 2])]).to(torch.int32)
    pages = torch.randperm(64, generator=g)[:57].to(torch.int32)
    segs = torch.tensor([[0, 150, 0, 20], [150, 3, 20, 37]], dtype=torch.int32)
    y = torch.randn(160, 70, generator=g)
    out, want = y.clone(), y.clone()
    lora.sgmv_c(out, x, A, B, rows, pages, segs)
    lora.sgmv_ref(want, x, A, B, rows, pages, segs)
    assert torch.allclose(out, want, atol=1e-4, rtol=1e-4)
