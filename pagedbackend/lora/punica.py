"""The step's token-to-adapter mapping (Punica's wrapper) and the op that
every adapted projection calls.

``build_mapping`` groups the rows of a step's flat batch by adapter: one
segment per adapter (its rows, its pages, its rank), and per module kind
(``q_proj``, ...) the segments of the adapters that adapt it. The runner
opens ``lora_step`` around a forward whose batch has adapters; inside it
each adapted projection calls ``pagedbackend::lora_add_(y, x, slot)``, which
adds the LoRA deltas of the step's segments to the projection's output
``y`` in place, through the kernel its ``LoRAModel`` chose
(``kernels.lora``).

A step without adapters opens no context: the layers see ``active`` false
and call nothing, so such a step does no LoRA work at all. ``active`` is a
thread-local that ``torch.compile`` guards on, so a compiled step keeps one
graph without the op and one with it. The op is opaque to the compiler, as
attention is (``models.attention``); the mapping is never a graph input.
"""
import contextlib
import threading
from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch


class _StepState(threading.local):
    active = False     # the step's batch has adapters: the layers call the op
    mapping = None     # LoRAMapping of the step
    model = None       # the LoRAModel whose pool the op reads


state = _StepState()


@dataclass
class LoRAMapping:
    """``rows`` (int32): the batch rows of every segment, back to back;
    ``pages`` (int32): every segment's pages; ``segs`` per module kind: int32
    ``[n, 4]`` (row start, rows, page start, rank) of the segments whose
    adapter adapts that kind; ``max_rows``, ``max_rank``: of any segment."""
    rows: torch.Tensor
    pages: torch.Tensor
    segs: Dict[str, torch.Tensor]
    max_rows: int = 0
    max_rank: int = 0
    # Per kind, segments of at least ``split_rows`` rows kept out of ``segs``
    # (``build_mapping``): (batch rows, pages), each a slice where contiguous.
    large: Dict[str, List[Tuple[object, object]]] = field(default_factory=dict)
    _addresses: Optional[tuple] = None

    def to(self, device: torch.device) -> "LoRAMapping":
        if self.rows.device == device:
            return self
        to = dict(device=device, non_blocking=True)
        return replace(self, rows=self.rows.to(**to), pages=self.pages.to(**to),
                       segs={kind: segs.to(**to) for kind, segs in self.segs.items()}, _addresses=None)

    def addresses(self) -> tuple:
        """``(rows, pages, {kind: (segs, count)})`` as data pointers, taken once
        a step for the C kernel's calls."""
        if self._addresses is None:
            self._addresses = (self.rows.data_ptr(), self.pages.data_ptr(),
                               {kind: (segs.data_ptr(), segs.shape[0]) for kind, segs in self.segs.items()})
        return self._addresses


def empty_mapping() -> LoRAMapping:
    """A mapping with no segment: the op runs and adds nothing (a warm-up)."""
    empty = torch.zeros(0, dtype=torch.int32)
    return LoRAMapping(empty, empty, {})


def build_mapping(entries: Sequence, split_rows: int = 0) -> Optional[LoRAMapping]:
    """The mapping of a step's entries (each with ``token_ids`` and ``lora``,
    a ``manager.StepLoRA`` or None); None when no entry has an adapter.
    ``split_rows``: segments with at least that many rows (a prefill) go to
    ``large``, for a GEMM rather than the segment kernel (0: none do)."""
    spans: Dict[object, List[Tuple[int, int]]] = {}
    start = 0
    for entry in entries:
        count = len(entry.token_ids)
        handle = getattr(entry, "lora", None)
        if handle is not None:
            spans.setdefault(handle, []).append((start, count))
        start += count
    if not spans:
        return None
    rows: List[int] = []
    pages: List[int] = []
    segs: Dict[str, List[Tuple[int, int, int, int]]] = {}
    large: Dict[str, List[Tuple[object, object]]] = {}
    max_rows = max_rank = 0
    for handle, ranges in spans.items():
        count = sum(n for _, n in ranges)
        if split_rows and count >= split_rows:
            batch_rows = _index([r for first, n in ranges for r in range(first, first + n)])
            for kind in handle.kinds:
                large.setdefault(kind, []).append((batch_rows, _index(handle.pages)))
            continue
        row_start = len(rows)
        for first, n in ranges:
            rows.extend(range(first, first + n))
        seg = (row_start, count, len(pages), len(handle.pages))
        pages.extend(handle.pages)
        for kind in handle.kinds:
            segs.setdefault(kind, []).append(seg)
        max_rows, max_rank = max(max_rows, seg[1]), max(max_rank, seg[3])
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)   # noqa: E731
    return LoRAMapping(as_int32(rows), as_int32(pages), {k: as_int32(v).view(-1, 4) for k, v in segs.items()},
                       max_rows, max_rank, large)


def _index(values: Sequence[int]):
    """A slice when ``values`` are consecutive (a view, no copy), else a long tensor."""
    if values[-1] - values[0] == len(values) - 1 and list(values) == list(range(values[0], values[-1] + 1)):
        return slice(values[0], values[-1] + 1)
    return torch.tensor(values, dtype=torch.long)


@contextlib.contextmanager
def lora_step(model, mapping: Optional[LoRAMapping]) -> Iterator[None]:
    """Make a step's mapping visible to the op (nothing to do without one)."""
    if mapping is None:
        yield
        return
    previous = (state.active, state.mapping, state.model)
    state.active, state.mapping, state.model = True, mapping, model
    try:
        yield
    finally:
        state.active, state.mapping, state.model = previous


_ops = torch.library.Library("pagedbackend", "FRAGMENT")
_ops.define("lora_add_(Tensor(a!) y, Tensor x, int slot) -> ()")


def lora_add_(y: torch.Tensor, x: torch.Tensor, slot: int) -> None:
    """``y += x A^T B^T`` per segment, for every module merged into the
    projection ``slot`` (each into its column range of ``y``)."""
    mapping, model = state.mapping, state.model
    if mapping is not None and (mapping.segs or mapping.large):
        model.add(y, x, slot, mapping)


_ops.impl("lora_add_", lora_add_, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedbackend::lora_add_")
def _lora_add_fake(y, x, slot):
    return None
