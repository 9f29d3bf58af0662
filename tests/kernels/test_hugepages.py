"""Large CPU tensors asked onto transparent huge pages (kernels/hugepages.py):
the same values as torch's own tensors, and the range marked for huge pages."""
import pathlib

import pytest
import torch

from pagedbackend.kernels import hugepages
from pagedbackend.models import bf16_linear

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_offered() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def vma_fields(address: int) -> dict:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields, inside = {}, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_zeros_are_torch_zeros_in_every_cache_dtype(dtype):
    t = hugepages.zeros((3, 1 << 20), dtype)
    assert t.shape == (3, 1 << 20) and t.dtype == dtype and t.is_contiguous()
    assert not t.view(torch.uint8).any()


def test_small_tensors_and_other_devices_are_left_alone():
    assert hugepages.advise(torch.empty(1000)) is False
    assert hugepages.advise(torch.empty(0)) is False
    assert hugepages.advise(torch.empty(1 << 20, device="meta")) is False


@pytest.mark.skipif(not pathlib.Path("/proc/self/smaps").exists() or not thp_offered(),
                    reason="no transparent huge pages on this system (or no /proc)")
def test_a_large_tensor_is_marked_for_huge_pages_before_it_is_touched():
    t = hugepages.empty((16 << 20,), torch.uint8)
    middle = t.data_ptr() + (8 << 20)
    assert hugepages.advise(t) is True
    fields = vma_fields(middle)
    assert "hg" in fields.get("VmFlags", "").split()   # VM_HUGEPAGE: madvise took
    t.fill_(7)
    assert int(t[-1]) == 7 and int(t.sum()) == 7 * (16 << 20)


def test_a_paired_weight_is_unchanged_by_its_pages():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 4096, generator=g).to(torch.bfloat16)   # 70 rows: a padded last block
    paired = bf16_linear.pair(w)
    assert paired.is_contiguous() and paired.shape == (5, 2048, 16, 2)
    assert torch.equal(bf16_linear.unpair(paired, 70), w)
    assert not paired[4, :, 6:].any()   # the rows past N are zero
