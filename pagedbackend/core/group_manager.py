"""One KV group's block tables: how a group of one attention kind grows,
shares, shrinks and finds cached prefixes (vLLM v1's single-type managers).

- ``FullAttentionManager``: every position of a sequence stays in its
  blocks for as long as the sequence lives; a cached prefix is any run of
  cached blocks from the first.
- ``SlidingWindowManager``: a query sees the last ``window`` positions, so
  once ``n`` positions are computed the blocks wholly before ``n - window +
  1`` are given back (``skip``); a table holds placeholders for them. Blocks
  are taken as a step needs them (up to its ``step_end``), not for the whole
  prompt at once; a cached prefix needs only the blocks inside the window
  of its first uncomputed position.

The block manager holds one manager per group and one ``GroupTable`` per
group per sequence; the pool is shared, and a block belongs to one group at
a time. A group's prefix-cache keys carry its index, so a block cached by one
group is never mapped into another's table (each holds other layers' K/V).
"""
from typing import List, Optional, Sequence

from .block_pool import BlockPool, KVBlock
from .kv_groups import cdiv, skipped_blocks

BlockMapping = List[tuple]
# The block id a table shows for a block it gave back; kernels never read it.
PLACEHOLDER_BLOCK = 0


class GroupTable:
    """One group's block table of one sequence: ``blocks`` are the held
    blocks of logical blocks ``skipped`` onwards (the earlier ones were given
    back); ``num_tokens``: positions they hold slots for."""

    __slots__ = ("blocks", "skipped", "num_tokens")

    def __init__(self, blocks: Optional[List[KVBlock]] = None, skipped: int = 0, num_tokens: int = 0):
        self.blocks = blocks if blocks is not None else []
        self.skipped = skipped
        self.num_tokens = num_tokens

    @property
    def end(self) -> int:
        """Logical blocks of the table, given back ones included."""
        return self.skipped + len(self.blocks)

    def ids(self) -> List[int]:
        ids = [b.block_id for b in self.blocks]
        return [PLACEHOLDER_BLOCK] * self.skipped + ids if self.skipped else ids

    def copy(self) -> "GroupTable":
        return GroupTable(list(self.blocks), self.skipped, self.num_tokens)


class FullAttentionManager:
    window: Optional[int] = None

    def __init__(self, index: int, pool: BlockPool, block_size: int):
        self.index, self.pool, self.block_size = index, pool, block_size
        self._suffix = b"" if index == 0 else b"\0g" + index.to_bytes(2, "little")

    def key(self, block_hash: Optional[bytes]) -> Optional[bytes]:
        """The prefix-cache key of a block with this hash in this group."""
        return block_hash + self._suffix if self._suffix and block_hash is not None else block_hash

    # ------------------------------------------------------------ sizes
    def target(self, table: GroupTable, num_tokens: int, step_end: Optional[int]) -> int:
        """Positions the table must hold slots for when the sequence has
        ``num_tokens`` and the step computes up to ``step_end``: all of them."""
        return num_tokens

    def admission_target(self, num_tokens: int, num_cached: int, step_tokens: Optional[int]) -> int:
        """Positions a new sequence's table holds slots for at admission."""
        return num_tokens

    def first_needed(self, num_computed: int) -> int:
        """The first logical block a query after ``num_computed`` positions sees."""
        return 0

    def to_append(self, table: GroupTable, num_tokens: int) -> int:
        """Free blocks ``append`` to ``num_tokens`` takes: new ones, and copies
        of shared blocks the new positions land in."""
        bs, first = self.block_size, table.num_tokens // self.block_size
        end = cdiv(num_tokens, bs)
        cow = sum(1 for b in table.blocks[max(first - table.skipped, 0):max(end - table.skipped, 0)]
                  if b.ref_cnt > 1)
        return max(0, end - table.end) + cow

    # ------------------------------------------------------------ changes
    def append(self, table: GroupTable, num_tokens: int, copies: BlockMapping) -> None:
        """Grow the table to ``num_tokens`` positions; a shared block the new
        positions land in is copied first (its pair goes to ``copies``)."""
        if num_tokens <= table.num_tokens:
            return
        bs, blocks, skipped = self.block_size, table.blocks, table.skipped
        for i in range(table.num_tokens // bs, min(cdiv(num_tokens, bs), table.end)):
            shared = blocks[i - skipped]
            if shared.ref_cnt > 1:
                private = self.pool.allocate()
                private.num_tokens = shared.num_tokens
                self.pool.decref(shared)
                blocks[i - skipped] = private
                copies.append((shared.block_id, private.block_id))
        while table.end < cdiv(num_tokens, bs):
            blocks.append(self.pool.allocate())
        self.fill(table, num_tokens)

    def fill(self, table: GroupTable, num_tokens: int) -> None:
        bs, blocks, skipped = self.block_size, table.blocks, table.skipped
        for i in range(table.num_tokens // bs, cdiv(num_tokens, bs)):
            block = blocks[i - skipped]
            block.num_tokens = max(block.num_tokens, min(bs, num_tokens - i * bs))
        table.num_tokens = num_tokens

    def truncate(self, table: GroupTable, num_tokens: int) -> None:
        """Shrink to the first ``num_tokens`` positions (blocks past them go back)."""
        if num_tokens >= table.num_tokens:
            return
        keep = cdiv(num_tokens, self.block_size)
        while table.end > keep and table.blocks:
            self.pool.decref(table.blocks.pop())
        if num_tokens % self.block_size and table.blocks and table.blocks[-1].ref_cnt == 1:
            table.blocks[-1].num_tokens = num_tokens % self.block_size
        table.num_tokens = num_tokens

    def skip(self, table: GroupTable, num_computed: int) -> None:
        """Give back the blocks no later query sees (none for full attention)."""

    def release(self, table: GroupTable, pool: BlockPool) -> List[KVBlock]:
        """Drop every block of the table, last first; returns them."""
        for block in reversed(table.blocks):
            pool.decref(block)
        return table.blocks

    # ------------------------------------------------------------ prefix cache
    def lookup(self, hashes: Sequence[bytes], token_ids: Sequence[int], i: int) -> Optional[KVBlock]:
        """This group's cached block for logical block ``i`` of a prompt, or None."""
        bs = self.block_size
        parent = self.key(hashes[i - 1]) if i else None
        return self.pool.lookup(self.key(hashes[i]), parent, token_ids[i * bs:(i + 1) * bs])

    def longest_hit(self, hashes: Sequence[bytes], token_ids: Sequence[int], limit: int) -> int:
        """The most leading blocks (at most ``limit``) this group can take
        from the prefix cache: a run of cached blocks from the first."""
        for i in range(limit):
            if self.lookup(hashes, token_ids, i) is None:
                return i
        return limit


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, index: int, pool: BlockPool, block_size: int, window: int):
        super().__init__(index, pool, block_size)
        self.window = window

    def target(self, table: GroupTable, num_tokens: int, step_end: Optional[int]) -> int:
        if step_end is None:
            return num_tokens
        return max(table.num_tokens, min(num_tokens, step_end))

    def admission_target(self, num_tokens: int, num_cached: int, step_tokens: Optional[int]) -> int:
        return num_tokens if step_tokens is None else min(num_tokens, num_cached + step_tokens)

    def first_needed(self, num_computed: int) -> int:
        return skipped_blocks(num_computed, self.window, self.block_size)

    def skip(self, table: GroupTable, num_computed: int) -> None:
        upto = skipped_blocks(num_computed, self.window, self.block_size)
        if upto > table.skipped:
            gone = min(upto - table.skipped, len(table.blocks))
            for block in table.blocks[:gone]:
                self.pool.decref(block)
            del table.blocks[:gone]
            table.skipped += gone

    def longest_hit(self, hashes: Sequence[bytes], token_ids: Sequence[int], limit: int) -> int:
        """The most leading blocks (at most ``limit``) whose last ``window``
        positions this group has cached: searching down from ``limit``, a
        missing block moves the candidate end to it."""
        end = limit
        while end > 0:
            for i in range(end - 1, self.first_needed(end * self.block_size) - 1, -1):
                if self.lookup(hashes, token_ids, i) is None:
                    end = i
                    break
            else:
                return end
        return 0


def make_managers(windows: Sequence[Optional[int]], pool: BlockPool, block_size: int) -> List[FullAttentionManager]:
    """One manager per KV group, by the group's window (None: full attention)."""
    return [FullAttentionManager(g, pool, block_size) if w is None else SlidingWindowManager(g, pool, block_size, w)
            for g, w in enumerate(windows)]
