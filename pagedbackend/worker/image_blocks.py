"""The bidirectional blocks of one step (a model whose images' rows see
each other, Gemma 3): for each entry, the rows of each image run its new
tokens cover, as ``models.attention.ImageBlock``s. The scheduler ends no
prefill chunk inside a run (``core.whole_spans``), so every run met here
ends inside its entry's chunk."""
from typing import List, Sequence

from pagedbackend.core.scheduled import SeqEntry
from pagedbackend.core.whole_spans import image_runs
from pagedbackend.models.attention import ImageBlock


def image_blocks(entries: Sequence[SeqEntry]) -> List[ImageBlock]:
    blocks, row = [], 0
    for seq, entry in enumerate(entries):
        lo, hi = entry.start_pos, entry.start_pos + len(entry.token_ids)
        for first, end in image_runs(getattr(entry, "mm_items", ())):
            if max(lo, first) >= min(hi, end):
                continue
            if end > hi:
                raise RuntimeError(f"an image's positions {first}..{end - 1} attend both ways, but this step's "
                                   f"chunk ends at {hi}: the scheduler split the image")
            start = max(lo, first)
            blocks.append(ImageBlock(seq, row + start - lo, row + end - lo, start, end - 1))
        row += len(entry.token_ids)
    return blocks
