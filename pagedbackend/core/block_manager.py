"""Paged KV-cache block manager: per-sequence block tables over a shared block
pool, like page tables over page frames (PagedAttention, section 4.2).

It knows nothing about tensors: copy-on-write and swapping are returned as
lists of ``(src, dst)`` block ids for the model runner to carry out.

- Block tables grow one block at a time as tokens arrive; nothing is reserved
  for future tokens.
- ``fork`` shares all of a sequence's blocks with a child (parallel sampling,
  beam search); a write into a shared block first copies it (copy-on-write).
- Full blocks whose K/V are computed are registered in the prefix cache by a
  hash chain; a new sequence maps the cached blocks its prompt starts with.
- ``swap_out`` / ``swap_in`` move a whole sequence group to and from a bounded
  host pool, all or nothing (``block_swap.py``).
- ``truncate`` gives back the slots of speculative tokens that were rejected:
  positions past the verified ones, and blocks that only they used.
"""
import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .block_pool import BlockManagerError, BlockPool, KVBlock, NoFreeBlocksError
from .block_swap import SwapMixin
from .prefix_cache import HashFn, block_hashes, hash_block

BlockMapping = List[Tuple[int, int]]

__all__ = ["AllocStatus", "BlockManager", "BlockManagerError", "NoFreeBlocksError",
           "UnknownSequenceError"]


class UnknownSequenceError(BlockManagerError, KeyError):
    """The sequence id has no blocks here (never allocated, or already freed)."""

    def __str__(self) -> str:
        return self.args[0] if self.args else "unknown sequence"


class AllocStatus(enum.Enum):
    OK = "ok"          # fits now
    LATER = "later"    # fits once other sequences release blocks
    NEVER = "never"    # larger than the whole pool


@dataclass
class _SeqBlocks:
    blocks: List[KVBlock] = field(default_factory=list)  # the block table
    num_tokens: int = 0          # positions holding this sequence's tokens
    hashes: List[bytes] = field(default_factory=list)    # of blocks[:len(hashes)]
    on_device: bool = True       # False while swapped out to the host pool
    salt: bytes = b""            # the request's cache_salt: its own prefix-cache namespace


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager(SwapMixin):
    def __init__(self, num_blocks: int, block_size: int = 16, num_swap_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01,
                 cache_salt: bytes = b"", hash_fn: HashFn = hash_block):
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_swap_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.host_pool = BlockPool(num_swap_blocks, enable_caching=False) if num_swap_blocks else None
        self.watermark_blocks = int(watermark * num_blocks)
        self.cache_salt = cache_salt
        self.hash_fn = hash_fn
        self._seqs: Dict[int, _SeqBlocks] = {}
        # Device block content carried by each host block, to find it again on swap-in.
        self._host_meta: Dict[int, Tuple[Optional[bytes], Optional[bytes], Optional[tuple], int, bytes]] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0     # of those, tokens found cached

    # ------------------------------------------------------------ queries
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    @property
    def num_swap_blocks(self) -> int:
        return self.host_pool.num_blocks if self.host_pool else 0

    @property
    def num_free_swap_blocks(self) -> int:
        return self.host_pool.num_free if self.host_pool else 0

    @property
    def num_shared_blocks(self) -> int:
        return self.pool.num_shared

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def stored_positions(self) -> int:
        """Token positions held in used device blocks (each shared block once)."""
        return sum(b.num_tokens for b in self.pool.blocks if b.ref_cnt > 0)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_seqs(self) -> int:
        """Sequences holding a block table (on the device or swapped out)."""
        return len(self._seqs)

    def is_swapped(self, seq_id: int) -> bool:
        return not self._get(seq_id).on_device

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_tokens

    def get_block_table(self, seq_id: int) -> List[int]:
        state = self._get(seq_id)
        if not state.on_device:
            raise BlockManagerError(f"sequence {seq_id} is swapped out; swap it in first")
        return [b.block_id for b in state.blocks]

    def ref_count(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_cnt

    def _get(self, seq_id: int) -> _SeqBlocks:
        state = self._seqs.get(seq_id)
        if state is None:
            raise UnknownSequenceError(f"sequence {seq_id} has no blocks (never allocated or already freed)")
        return state

    # ------------------------------------------------------------ allocation
    def _key(self, salt: bytes) -> bytes:
        """The extra key of every block hash: the engine's (model, dtype,
        quantisation) and the request's cache salt."""
        return self.cache_salt + b"\0" + salt if salt else self.cache_salt

    def _cached_prefix(self, token_ids: Sequence[int], salt: bytes = b"",
                       reuse: bool = True) -> Tuple[List[KVBlock], List[bytes]]:
        """Cached blocks the sequence's first tokens map to (none without
        ``reuse``). At least the last token is left to compute, since its
        logits are needed."""
        if not self.enable_prefix_caching or not reuse:
            return [], []
        hits: List[KVBlock] = []
        hashes: List[bytes] = []
        parent = None
        limit = (len(token_ids) - 1) // self.block_size
        for i, h in enumerate(block_hashes(token_ids, self.block_size, self._key(salt),
                                           self.hash_fn, limit=limit)):
            block = self.pool.lookup(h, parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        return hits, hashes

    def blocks_needed(self, token_ids: Sequence[int], salt: bytes = b"", reuse: bool = True) -> int:
        """Free blocks that ``allocate`` would take for these tokens now."""
        hits, _ = self._cached_prefix(token_ids, salt, reuse)
        revived = sum(1 for b in hits if b.ref_cnt == 0)
        return _cdiv(len(token_ids), self.block_size) - len(hits) + revived

    def can_allocate(self, token_id_lists: Sequence[Sequence[int]], reserve_tokens: int = 0,
                     salt: bytes = b"", reuse: bool = True) -> AllocStatus:
        """Whether sequences with these tokens (one group) can be allocated."""
        extra = [self._reserved_extra(len(t), reserve_tokens) for t in token_id_lists]
        total = sum(_cdiv(len(t), self.block_size) for t in token_id_lists) + sum(extra)
        if total > self.pool.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        needed = sum(self.blocks_needed(t, salt, reuse) for t in token_id_lists) + sum(extra)
        if self.pool.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _reserved_extra(self, num_tokens: int, reserve_tokens: int) -> int:
        return max(0, _cdiv(reserve_tokens, self.block_size) - _cdiv(num_tokens, self.block_size))

    def allocate(self, seq_id: int, token_ids: Sequence[int], reserve_tokens: int = 0,
                 salt: bytes = b"", reuse: bool = True) -> int:
        """Give a new sequence blocks for all its tokens, mapping cached prefix
        blocks where it can. Returns how many leading tokens are already computed.
        ``reserve_tokens`` takes blocks for that many positions up front, as a
        contiguous-reservation server would (benchmark baselines only). ``salt``
        (a request's cache_salt) keeps its prefix blocks apart from requests
        with another salt, or none; ``reuse=False`` maps no cached block (the
        whole prompt is computed; its full blocks are still registered)."""
        if seq_id in self._seqs:
            raise BlockManagerError(f"sequence {seq_id} already has blocks")
        if not token_ids:
            raise BlockManagerError(f"sequence {seq_id} has no tokens to allocate")
        n_blocks = _cdiv(len(token_ids), self.block_size) + self._reserved_extra(len(token_ids), reserve_tokens)
        if n_blocks > self.pool.num_blocks:
            raise BlockManagerError(
                f"sequence {seq_id} needs {n_blocks} blocks for {len(token_ids)} tokens; "
                f"the whole pool has {self.pool.num_blocks}")
        hits, hashes = self._cached_prefix(token_ids, salt, reuse)
        needed = n_blocks - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} free blocks, {self.pool.num_free} left")
        for block in hits:
            self.pool.incref(block)
        blocks = hits + [self.pool.allocate() for _ in range(n_blocks - len(hits))]
        state = _SeqBlocks(blocks=blocks, hashes=hashes, salt=salt)
        self._seqs[seq_id] = state
        self._fill(state, len(token_ids))
        num_cached = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += num_cached
        return num_cached

    def _fill(self, state: _SeqBlocks, num_tokens: int) -> None:
        bs = self.block_size
        for i in range(state.num_tokens // bs, _cdiv(num_tokens, bs)):
            state.blocks[i].num_tokens = max(state.blocks[i].num_tokens, min(bs, num_tokens - i * bs))
        state.num_tokens = num_tokens

    def blocks_to_append(self, seq_id: int, num_tokens: int) -> int:
        """Free blocks ``append_slots(seq_id, num_tokens)`` would take (new blocks
        plus copies of shared blocks that would be written)."""
        state = self._get(seq_id)
        bs = self.block_size
        first, end = state.num_tokens // bs, _cdiv(num_tokens, bs)
        cow = sum(1 for b in state.blocks[first:end] if b.ref_cnt > 1)
        return max(0, end - len(state.blocks)) + cow

    def append_slots(self, seq_id: int, num_tokens: int) -> BlockMapping:
        """Grow the sequence to ``num_tokens`` positions. Every block the new
        positions land in is made private first: a shared one is copied, and the
        returned ``(src, dst)`` pairs tell the runner what to copy."""
        state = self._get(seq_id)
        if not state.on_device:
            raise BlockManagerError(f"sequence {seq_id} is swapped out; swap it in first")
        if num_tokens < state.num_tokens:
            raise BlockManagerError(
                f"sequence {seq_id} cannot shrink from {state.num_tokens} to {num_tokens} tokens")
        needed = self.blocks_to_append(seq_id, num_tokens)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} free blocks, {self.pool.num_free} left")
        bs = self.block_size
        copies: BlockMapping = []
        for i in range(state.num_tokens // bs, min(_cdiv(num_tokens, bs), len(state.blocks))):
            shared = state.blocks[i]
            if shared.ref_cnt > 1:
                private = self.pool.allocate()
                private.num_tokens = shared.num_tokens
                self.pool.decref(shared)
                state.blocks[i] = private
                copies.append((shared.block_id, private.block_id))
        while len(state.blocks) < _cdiv(num_tokens, bs):
            state.blocks.append(self.pool.allocate())
        self._fill(state, num_tokens)
        return copies

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink the sequence to its first ``num_tokens`` positions (the slots
        of rejected speculative tokens go back); blocks past them are freed.
        Those positions were appended, so the blocks they lie in are private."""
        state = self._get(seq_id)
        if not state.on_device:
            raise BlockManagerError(f"sequence {seq_id} is swapped out; swap it in first")
        if not 0 < num_tokens <= state.num_tokens:
            raise BlockManagerError(f"sequence {seq_id} cannot be truncated from {state.num_tokens} "
                                    f"to {num_tokens} tokens")
        bs, keep = self.block_size, _cdiv(num_tokens, self.block_size)
        while len(state.blocks) > keep:
            self.pool.decref(state.blocks.pop())
        if num_tokens % bs and state.blocks[-1].ref_cnt == 1:
            state.blocks[-1].num_tokens = num_tokens % bs
        state.num_tokens = num_tokens

    def mark_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the sequence's full blocks whose K/V are now computed in the
        prefix cache (``token_ids`` are the sequence's tokens so far)."""
        if not self.enable_prefix_caching:
            return
        state = self._get(seq_id)
        n_full = min(num_computed, len(token_ids), state.num_tokens) // self.block_size
        start = len(state.hashes)
        if n_full <= start or not state.on_device:
            return
        parent = state.hashes[-1] if state.hashes else None
        new = block_hashes(token_ids, self.block_size, self._key(state.salt), self.hash_fn,
                           start=start, parent_hash=parent, limit=n_full)
        bs = self.block_size
        for i, h in enumerate(new, start):
            self.pool.register(state.blocks[i], h, parent, token_ids[i * bs:(i + 1) * bs], state.salt)
            parent = h
        state.hashes.extend(new)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (reference counts go up)."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise BlockManagerError(f"sequence {child_id} already has blocks")
        if not parent.on_device:
            raise BlockManagerError(f"sequence {parent_id} is swapped out; swap it in first")
        for block in parent.blocks:
            self.pool.incref(block)
        self._seqs[child_id] = _SeqBlocks(list(parent.blocks), parent.num_tokens, list(parent.hashes),
                                          salt=parent.salt)

    def free(self, seq_id: int) -> None:
        """Return every block of the sequence, last block first (so a sequence's
        tail is evicted from the prefix cache before its head)."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            raise UnknownSequenceError(f"sequence {seq_id} has no blocks (never allocated or already freed)")
        pool = self.pool if state.on_device else self.host_pool
        for block in reversed(state.blocks):
            self._release(pool, block)

    def _release(self, pool: BlockPool, block: KVBlock) -> None:
        pool.decref(block)
        if pool is self.host_pool and block.ref_cnt == 0:
            self._host_meta.pop(block.block_id, None)

    # ------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        """Raise AssertionError if the pools and tables disagree (for tests)."""
        for pool, on_device in ((self.pool, True), (self.host_pool, False)):
            if pool is None:
                continue
            refs = [0] * pool.num_blocks
            for state in self._seqs.values():
                if state.on_device == on_device:
                    for block in state.blocks:
                        assert pool.blocks[block.block_id] is block, "table points outside its pool"
                        refs[block.block_id] += 1
            free_ids = [b.block_id for b in pool.free_queue]
            assert len(free_ids) == len(set(free_ids)) == pool.num_free, "free queue corrupted"
            for block in pool.blocks:
                assert block.ref_cnt == refs[block.block_id], (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs[block.block_id]} table entries")
            assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}, \
                "a block is neither free nor in use, or both"
            assert pool.num_shared == sum(1 for b in pool.blocks if b.ref_cnt > 1), "shared count drifted"
            assert pool.num_cached_free == sum(
                1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None), "cached count drifted"
            for h, block in pool.cached.items():
                assert block.block_hash == h, "cache map disagrees with block"
        for seq_id, state in self._seqs.items():
            assert len(state.blocks) >= _cdiv(state.num_tokens, self.block_size), \
                f"sequence {seq_id}: {len(state.blocks)} blocks for {state.num_tokens} tokens"
