"""The block manager's side of the disk tier below the prefix cache
(``kv_offload_dir``; the files themselves: ``engine/kv_tier.py``).

- Saving: when an allocation evicts a full, hashed block (``BlockPool``: the
  least recently freed one), its content is still intact until the step
  runs; ``TierMoves`` notes "save block id under this key" and the step
  carries the list to the worker, which copies the bytes out first.
- Loading: a prompt whose next blocks miss the pool but whose keys the tier
  holds gets fresh blocks for them, registered under those keys at once, and
  the step carries "load these payloads into these blocks" (read and checked
  here, at admission, so a refused file is simply a miss and is recomputed).

A key is the block's prefix-cache key (hash chain with the engine's model
key, the request's cache salt and adapter, its images, its KV group), so
the tier keeps every namespace apart just as the pool does. The tier is
used for models whose KV groups are all full attention.

The tier port (``tier``) is anything with ``contains(key) -> bool`` and
``stage(key) -> bool`` (read and check a file now, hold its payload for the
step) and ``unstage(key)``; the core never touches files.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from .prefix_cache import CachedPrefix, block_hashes


class TierSave(NamedTuple):
    """A block to copy out before the step: its id and what it is."""
    block_id: int
    key: bytes
    parent_key: Optional[bytes]
    token_ids: Tuple[int, ...]
    salt: bytes
    reported: bool   # its pool events were published (so are its disk ones)

    @classmethod
    def of(cls, block) -> "TierSave":
        """A cached block's save (before its hash is dropped)."""
        return cls(block.block_id, block.block_hash, block.parent_hash, block.token_ids, block.salt, block.reported)


class TierMoves:
    """One scheduling pass's block moves between the pool and the tier."""

    def __init__(self, tier):
        self.tier = tier
        self.saves: Dict[int, TierSave] = {}
        self.loads: Dict[int, bytes] = {}   # block id -> key of the payload to load
        # Blocks allocated in this pass: their content is not there until the
        # step's moves run, so if evicted again they are not saved (and a load
        # into one is called off).
        self._fresh: Set[int] = set()

    def allocated(self, block) -> None:
        self._fresh.add(block.block_id)

    def evicted(self, block) -> None:
        if block.block_id in self._fresh:
            self.loads.pop(block.block_id, None)
        elif not self.tier.contains(block.block_hash):
            self.saves[block.block_id] = TierSave.of(block)

    def stage(self, keys: Sequence[bytes]) -> bool:
        """Read and check one logical block's payload of every KV group; all or none."""
        staged = []
        for key in keys:
            if not self.tier.contains(key) or not self.tier.stage(key):
                for done in staged:
                    self.tier.unstage(done)
                return False
            staged.append(key)
        return True

    def take(self) -> Tuple[List[TierSave], List[Tuple[int, bytes]]]:
        """The pass's saves and loads (for the step), and a fresh pass."""
        saves, loads = list(self.saves.values()), list(self.loads.items())
        self.saves, self.loads, self._fresh = {}, {}, set()
        return saves, loads


class TierMixin:
    """``BlockManager``'s disk-tier methods (its pool, managers and key)."""
    tier_moves: Optional[TierMoves] = None
    tier_loaded_blocks = 0   # logical blocks whose K/V came from the tier

    def attach_tier(self, tier) -> None:
        """Save evicted blocks to ``tier`` and load prefixes from it."""
        self.tier_moves = self.pool.moves = TierMoves(tier)

    def take_tier_moves(self) -> Tuple[List[TierSave], List[Tuple[int, bytes]]]:
        """What the coming step must save and load (``SchedulerOutput``)."""
        return self.tier_moves.take() if self.tier_moves is not None else ([], [])

    def _tier_prefix(self, token_ids: Sequence[int], salt: bytes, reuse: bool, block_keys,
                     hit: CachedPrefix) -> List[bytes]:
        """Hashes of the blocks right after the pool's hit that the tier holds
        for every KV group, read and checked now (at least the last token is
        left to compute)."""
        if self.tier_moves is None or not reuse or not self.enable_prefix_caching or self._windowed:
            return []
        limit = (len(token_ids) - 1) // self.block_size
        if hit.blocks >= limit:
            return []
        found = []
        for h in block_hashes(token_ids, self.block_size, self._key(salt), self.hash_fn, start=hit.blocks,
                              parent_hash=hit.hashes[-1] if hit.hashes else None, limit=limit,
                              block_keys=block_keys):
            keys = [m.key(h) for m in self.managers]
            if any(k in self.pool.cached for k in keys) or not self.tier_moves.stage(keys):
                break
            found.append(h)
        return found

    def _load_from_tier(self, state, token_ids: Sequence[int], start: int, hashes: List[bytes]) -> None:
        """Register the new blocks ``start..`` of every group under the tier's
        keys and note their loads (their content arrives before the step runs)."""
        bs = self.block_size
        for manager, table in zip(self.managers, state.tables):
            previous = state.hashes[start - 1] if start else None
            for i, h in enumerate(hashes, start):
                block = table.blocks[i - table.skipped]
                self.pool.register(block, manager.key(h), manager.key(previous), token_ids[i * bs:(i + 1) * bs],
                                   state.salt, report=manager.index == 0)
                self.tier_moves.loads[block.block_id] = manager.key(h)
                previous = h
        self.tier_loaded_blocks += len(hashes)
