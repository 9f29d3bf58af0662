"""Prefill chunks that never end inside a span that must be computed whole
(Gemma 3's images: a soft token attends to the image's later ones, so the
whole span runs in one forward; ``models.attention`` image blocks).

A chunk that would end inside such a span stops before it; a chunk that
starts inside one (a prefix-cache hit can end mid-span: those positions were
computed whole before) or at its start runs to its end when the step has
room for that, else it waits for a step that has."""
from typing import List, Optional, Sequence, Tuple


def chunk_outside_spans(start: int, chunk: int, spans: Sequence[Tuple[int, int]], room: int) -> int:
    """The chunk of a sequence whose next token is at ``start``, ``chunk``
    tokens wanted and ``room`` tokens free in the step, cut or stretched so
    that it ends at no position strictly inside a span (``[first, end)``
    positions, sorted); 0: it waits."""
    end = start + chunk
    for first, last in spans:
        if first < end < last:
            if first > start:
                return first - start
            return last - start if last - start <= room else 0
    return chunk


def whole_span_error(spans: Sequence[Tuple[int, int]], step_tokens: int) -> Optional[str]:
    """Why a prompt with these spans can never run in steps of ``step_tokens``, or None."""
    longest = max((end - first for first, end in spans), default=0)
    if longest > step_tokens:
        return (f"an image of {longest} tokens is computed in one step (its tokens attend to each other), "
                f"more than max_num_batched_tokens={step_tokens}")
    return None


def image_runs(items) -> List[Tuple[int, int]]:
    """``[first, end)`` of each run of embedding positions of the images
    (``multimodal.inputs.MultiModalItem``: a span, or the runs its
    ``embed_mask`` marks), in prompt order: the blocks whose positions see
    each other in a model with bidirectional images."""
    runs = []
    for item in sorted(items, key=lambda i: i.offset):
        if item.embed_mask is None:
            runs.append((item.offset, item.offset + item.length))
            continue
        start = None
        for i, embeds in enumerate(tuple(item.embed_mask) + (False,)):
            if embeds and start is None:
                start = i
            elif not embeds and start is not None:
                runs.append((item.offset + start, item.offset + i))
                start = None
    return runs
