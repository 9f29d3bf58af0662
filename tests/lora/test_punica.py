"""The step's token-to-adapter mapping: one segment per adapter over its rows
wherever they lie in the batch, per module kind only the adapters that adapt
it, and prefill-sized segments set apart for a GEMM."""
from types import SimpleNamespace

import torch

from pagedbackend.lora.manager import StepLoRA
from pagedbackend.lora.punica import build_mapping

QV = StepLoRA((4, 5), frozenset({"q_proj", "v_proj"}))
ALL = StepLoRA((0, 1, 2), frozenset({"q_proj", "v_proj", "down_proj"}))


def entry(tokens: int, lora=None):
    return SimpleNamespace(token_ids=[7] * tokens, lora=lora)


def test_rows_of_one_adapter_form_one_segment_and_kinds_list_their_adapters():
    mapping = build_mapping([entry(2, QV), entry(3), entry(1, ALL), entry(1, QV)])
    assert mapping.rows.tolist() == [0, 1, 6, 5] and mapping.pages.tolist() == [4, 5, 0, 1, 2]
    assert mapping.segs["q_proj"].tolist() == [[0, 3, 0, 2], [3, 1, 2, 3]]
    assert mapping.segs["down_proj"].tolist() == [[3, 1, 2, 3]]
    assert mapping.max_rows == 3 and mapping.max_rank == 3 and not mapping.large


def test_a_step_without_adapters_has_no_mapping():
    assert build_mapping([entry(4), entry(1)]) is None


def test_prefill_sized_segments_are_set_apart_as_slices_or_gathers():
    mapping = build_mapping([entry(40, QV), entry(2), entry(30, QV), entry(70, ALL), entry(1, ALL)],
                            split_rows=64)
    assert not mapping.segs   # both adapters reach 64 rows: nothing left for the segment kernel
    (qv_rows, qv_pages), (_, all_pages_v) = mapping.large["v_proj"]
    assert torch.equal(qv_rows, torch.tensor(list(range(40)) + list(range(42, 72)))) and qv_pages == slice(4, 6)
    (all_rows, all_pages), = mapping.large["down_proj"]
    assert all_rows == slice(72, 143) and all_pages == all_pages_v == slice(0, 3)
    assert len(mapping.large["q_proj"]) == 2 and len(mapping.large["down_proj"]) == 1
