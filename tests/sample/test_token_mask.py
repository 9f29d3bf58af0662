"""Structured-output masks: the C kernel (kernels/csrc/token_mask.c) masks
exactly what xgrammar's own kernel masks, for words that are all ones, all
zeros or mixed, a vocabulary that is not a multiple of 32, rows that share
nothing with their bitmask row's index, and strided logits."""
import pytest
import torch

from pagedbackend.sample import token_mask


class Fixed:
    """A matcher stand-in that fills a given bitmask row (the function under
    test calls only ``fill_next_token_bitmask``)."""

    def __init__(self, mask):
        self.mask = mask

    def fill_next_token_bitmask(self, bitmask, row):
        bitmask[row] = self.mask


class Row:
    def __init__(self, row, constraint):
        self.row, self.constraint = row, constraint


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_the_c_kernel_masks_what_xgrammars_kernel_masks(vocab):
    import xgrammar as xgr
    if token_mask._mask_kernel() is None:
        pytest.skip("no C compiler here for the token-mask kernel")
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    masks = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, words), dtype=torch.int32, generator=g)
    masks[0] = -1                     # free text: every token
    masks[1, ::2] = 0                 # delimiters: whole words refused
    masks[2] = 0
    bit = (vocab - 1) % 32
    masks[2, -1] = 1 << bit if bit < 31 else -2 ** 31   # only the last token
    logits = torch.randn(9, vocab + 7, generator=g)[:, :vocab]   # strided rows
    targets = [7, 0, 3, 8, 5]
    rows = [Row(t, Fixed(m)) for t, m in zip(targets, masks)] + [Row(1, None), Row(7, Fixed(masks[0]))]
    expected = logits.clone()
    bitmask = torch.full((9, words), -1, dtype=torch.int32)
    for t, m in zip(targets, masks):
        bitmask[t] = m
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=targets)

    token_mask.mask_logits(logits, rows)

    assert torch.equal(logits, expected)
    assert torch.isinf(logits[3]).sum() == vocab - 1 and torch.isfinite(logits[3, vocab - 1])
    assert torch.isfinite(logits[7]).all() and torch.isfinite(logits[1]).all()
