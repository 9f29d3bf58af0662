"""The encoder's share of a step (vLLM's ``max_num_encoder_input_tokens``):
a prefill chunk that would start more image embeddings than the step has
budget left ends before the first image that does not fit, which then
leads a later step. An image alone larger than the budget still runs,
first in its step, so that no request waits for ever."""
from typing import Sequence, Tuple


def encoder_cut(items: Sequence, start: int, chunk: int, budget: int, fresh: bool) -> Tuple[int, int]:
    """``(chunk, encoder tokens it starts)`` for a chunk of ``chunk`` tokens
    from ``start`` of a prompt with these image items (``offset``,
    ``num_embeds``); ``budget``: encoder tokens left in the step; ``fresh``:
    nothing has used the step's budget yet."""
    used = 0
    for item in sorted(items, key=lambda i: i.offset):
        if not start <= item.offset < start + chunk:
            continue
        if used + item.num_embeds > budget and not (fresh and used == 0 and item.offset == start):
            return item.offset - start, used
        used += item.num_embeds
    return chunk, used
