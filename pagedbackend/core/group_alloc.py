"""A group's sequences get their blocks together or not at all.

``BlockManager.can_allocate`` counts each sequence's need from the prefix
cache as it stands. Allocating one sequence takes new blocks from the free
list's least recently used end, which may evict a cached block a sibling
counted on as a hit; past that block the sibling's prefix is shorter, and
blocks it would have shared with a running sequence must now be new. So a
group judged to fit may still run out part way: then the sequences given
blocks so far return them and the group waits, as if it had not fitted.
"""
from typing import Optional, Sequence

from .block_pool import NoFreeBlocksError


def allocate_group(bm, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]],
                   *args) -> Optional[list]:
    """``bm.allocate(seq_id, tokens, *args)`` for each sequence; the cached
    token counts, or None (every block given back) when the pool ran out."""
    computed = []
    try:
        for seq_id, tokens in zip(seq_ids, token_lists):
            computed.append(bm.allocate(seq_id, tokens, *args))
    except NoFreeBlocksError:
        for seq_id in seq_ids[:len(computed)]:
            bm.free(seq_id)
        return None
    return computed
