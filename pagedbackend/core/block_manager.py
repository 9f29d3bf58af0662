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
- A disk tier (``tier_moves.py``, ``attach_tier``) takes evicted cached
  blocks and gives a prompt's next blocks back when the pool misses them.
- ``truncate`` gives back the slots of speculative tokens that were rejected:
  positions past the verified ones, and blocks that only they used.
- KV groups (``kv_groups.py``): a model's layers grouped by attention kind,
  each group with its own table per sequence over the one pool
  (``group_manager.py``). A sliding-window group gives a block back once
  every position in it has left the window (``mark_computed``) and takes
  blocks as steps need them (``append_slots(..., step_end)``); admission,
  preemption and the watermark count every group's blocks together.
"""
import enum
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .block_checks import check_invariants
from .block_pool import BlockManagerError, BlockPool, KVBlock, NoFreeBlocksError
from .block_swap import SwapMixin
from .group_manager import FullAttentionManager, GroupTable, make_managers
from .kv_groups import cdiv, skipped_blocks, step_blocks
from .prefix_cache import CachedPrefix, HashFn, block_hashes, hash_block, longest_cached_prefix
from .tier_moves import TierMixin

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
    tables: List[GroupTable]     # one per KV group
    num_tokens: int = 0          # positions holding this sequence's tokens
    hashes: List[bytes] = field(default_factory=list)    # of its first len(hashes) blocks
    on_device: bool = True       # False while swapped out to the host pool
    salt: bytes = b""            # the request's cache_salt: its own prefix-cache namespace
    block_keys: Optional[Mapping[int, bytes]] = None   # per block index, its images' hashes
    num_computed: int = 0        # positions whose K/V are computed (mark_computed)


class BlockManager(SwapMixin, TierMixin):
    def __init__(self, num_blocks: int, block_size: int = 16, num_swap_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01,
                 cache_salt: bytes = b"", hash_fn: HashFn = hash_block,
                 windows: Sequence[Optional[int]] = (None,), step_tokens: Optional[int] = None):
        """``windows``: each KV group's sliding window (None: full attention);
        ``step_tokens``: the most positions one step computes for a sequence
        (a windowed group takes that many at admission, the rest as steps
        need them; None: the whole prompt at admission)."""
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_swap_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if not windows or any(w is not None and (not isinstance(w, int) or w < 1) for w in windows):
            raise ValueError(f"windows must name each KV group's window (None or positive), got {windows!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.host_pool = BlockPool(num_swap_blocks, enable_caching=False) if num_swap_blocks else None
        self.watermark_blocks = int(watermark * num_blocks)
        self.cache_salt = cache_salt
        self.hash_fn = hash_fn
        self.windows = list(windows)
        self.step_tokens = step_tokens
        self.managers: List[FullAttentionManager] = make_managers(self.windows, self.pool, block_size)
        self._windowed = [m for m in self.managers if m.window is not None]
        self._seqs: Dict[int, _SeqBlocks] = {}
        # Device block content carried by each host block, to find it again on swap-in.
        self._host_meta: Dict[int, Tuple[Optional[bytes], Optional[bytes], Optional[tuple], int, bytes]] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0     # of those, tokens found cached

    # ------------------------------------------------------------ queries
    @property
    def num_groups(self) -> int:
        return len(self.managers)

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

    def group_step_blocks(self) -> List[Optional[int]]:
        """Per group, the most blocks it holds for one sequence at a time
        (None: no bound, every position stays)."""
        if self.step_tokens is None:
            return [None] * len(self.windows)
        return [step_blocks(w, self.block_size, self.step_tokens) for w in self.windows]

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
        """Group 0's block table (a given-back block shows as ``PLACEHOLDER_BLOCK``)."""
        state = self._get(seq_id)
        if not state.on_device:
            raise BlockManagerError(f"sequence {seq_id} is swapped out; swap it in first")
        return state.tables[0].ids()

    def get_block_tables(self, seq_id: int) -> List[List[int]]:
        """Every KV group's block table, group 0's first."""
        state = self._get(seq_id)
        if not state.on_device:
            raise BlockManagerError(f"sequence {seq_id} is swapped out; swap it in first")
        return [table.ids() for table in state.tables]

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

    def _cached_prefix(self, token_ids: Sequence[int], salt: bytes = b"", reuse: bool = True,
                       block_keys: Optional[Mapping[int, bytes]] = None) -> CachedPrefix:
        """The cached blocks the sequence's first tokens map to in every group
        (none without ``reuse``); at least the last token is left to compute,
        since its logits are needed."""
        if not self.enable_prefix_caching or not reuse:
            return CachedPrefix(0, [], [[] for _ in self.managers])
        limit = (len(token_ids) - 1) // self.block_size
        hashes = block_hashes(token_ids, self.block_size, self._key(salt), self.hash_fn, limit=limit,
                              block_keys=block_keys)
        return longest_cached_prefix(self.managers, hashes, token_ids, self.block_size)

    def _admission_blocks(self, num_tokens: int, hit: int, reserve_tokens: int = 0) -> List[int]:
        """Per group, the logical blocks a new sequence's table reaches at admission."""
        extra = self._reserved_extra(num_tokens, reserve_tokens)
        return [cdiv(m.admission_target(num_tokens, hit * self.block_size, self.step_tokens), self.block_size)
                + (extra if m.window is None else 0) for m in self.managers]

    def blocks_needed(self, token_ids: Sequence[int], salt: bytes = b"", reuse: bool = True,
                      block_keys: Optional[Mapping[int, bytes]] = None) -> int:
        """Free blocks that ``allocate`` would take for these tokens now."""
        hit = self._cached_prefix(token_ids, salt, reuse, block_keys)
        return sum(end - hit.blocks for end in self._admission_blocks(len(token_ids), hit.blocks)) + hit.revived

    def can_allocate(self, token_id_lists: Sequence[Sequence[int]], reserve_tokens: int = 0,
                     salt: bytes = b"", reuse: bool = True,
                     block_keys: Optional[Mapping[int, bytes]] = None) -> AllocStatus:
        """Whether sequences with these tokens (one group) can be allocated."""
        extra = [self._reserved_extra(len(t), reserve_tokens) for t in token_id_lists]
        total = sum(sum(self._admission_blocks(len(t), 0)) for t in token_id_lists) + sum(extra)
        if total > self.pool.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        needed = sum(self.blocks_needed(t, salt, reuse, block_keys) for t in token_id_lists) + sum(extra)
        if self.pool.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _reserved_extra(self, num_tokens: int, reserve_tokens: int) -> int:
        return max(0, cdiv(reserve_tokens, self.block_size) - cdiv(num_tokens, self.block_size))

    def allocate(self, seq_id: int, token_ids: Sequence[int], reserve_tokens: int = 0,
                 salt: bytes = b"", reuse: bool = True,
                 block_keys: Optional[Mapping[int, bytes]] = None) -> int:
        """Give a new sequence blocks for all its tokens, mapping cached prefix
        blocks where it can. Returns how many leading tokens are already computed.
        ``reserve_tokens`` takes blocks for that many positions up front, as a
        contiguous-reservation server would (benchmark baselines only). ``salt``
        (a request's cache_salt) keeps its prefix blocks apart from requests
        with another salt, or none; ``reuse=False`` maps no cached block (the
        whole prompt is computed; its full blocks are still registered);
        ``block_keys``: the hashes of its images by block index (``prefix_cache.block_hashes``)."""
        if seq_id in self._seqs:
            raise BlockManagerError(f"sequence {seq_id} already has blocks")
        if not token_ids:
            raise BlockManagerError(f"sequence {seq_id} has no tokens to allocate")
        n = len(token_ids)
        whole = sum(self._admission_blocks(n, 0, reserve_tokens))
        if whole > self.pool.num_blocks:
            raise BlockManagerError(
                f"sequence {seq_id} needs {whole} blocks for {n} tokens; the whole pool has {self.pool.num_blocks}")
        hit = self._cached_prefix(token_ids, salt, reuse, block_keys)
        ends = self._admission_blocks(n, hit.blocks, reserve_tokens)
        needed = sum(end - hit.blocks for end in ends) + hit.revived
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} free blocks, {self.pool.num_free} left")
        cached = hit.blocks * self.block_size
        loaded = self._tier_prefix(token_ids, salt, reuse, block_keys, hit)   # read now, loaded by the step
        for mapped in hit.mapped:   # every group's hits first: a new block must not evict one
            for block in mapped:
                self.pool.incref(block)
        tables = []
        for manager, mapped, end in zip(self.managers, hit.mapped, ends):
            blocks = mapped + [self.pool.allocate() for _ in range(end - hit.blocks)]
            table = GroupTable(blocks, hit.blocks - len(mapped), cached)
            manager.fill(table, min(n, manager.admission_target(n, cached, self.step_tokens)))
            tables.append(table)
        state = self._seqs[seq_id] = _SeqBlocks(tables, n, hit.hashes + loaded, salt=salt, block_keys=block_keys,
                                                num_computed=cached + len(loaded) * self.block_size)
        if loaded:
            self._load_from_tier(state, token_ids, hit.blocks, loaded)
        if self.enable_prefix_caching:
            self.prefix_queries += n
            self.prefix_hits += state.num_computed
        return state.num_computed

    def blocks_to_append(self, seq_id: int, num_tokens: int, step_end: Optional[int] = None) -> int:
        """Free blocks ``append_slots(seq_id, num_tokens, step_end)`` would take
        (new blocks plus copies of shared blocks that would be written)."""
        state = self._get(seq_id)
        return sum(m.to_append(t, m.target(t, num_tokens, step_end)) for m, t in zip(self.managers, state.tables))

    def append_slots(self, seq_id: int, num_tokens: int, step_end: Optional[int] = None) -> BlockMapping:
        """Grow the sequence to ``num_tokens`` positions. Every block the new
        positions land in is made private first: a shared one is copied, and the
        returned ``(src, dst)`` pairs tell the runner what to copy. ``step_end``:
        the step computes positions up to it; a windowed group takes blocks
        only that far (None: as far as ``num_tokens``)."""
        state = self._get(seq_id)
        if not state.on_device:
            raise BlockManagerError(f"sequence {seq_id} is swapped out; swap it in first")
        if num_tokens < state.num_tokens:
            raise BlockManagerError(
                f"sequence {seq_id} cannot shrink from {state.num_tokens} to {num_tokens} tokens")
        needed = self.blocks_to_append(seq_id, num_tokens, step_end)
        if needed > self.pool.num_free:
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} free blocks, {self.pool.num_free} left")
        copies: BlockMapping = []
        for manager, table in zip(self.managers, state.tables):
            manager.append(table, manager.target(table, num_tokens, step_end), copies)
        state.num_tokens = num_tokens
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
        for manager, table in zip(self.managers if self._windowed else (), state.tables):
            if table.skipped > skipped_blocks(num_tokens, manager.window, self.block_size):
                raise BlockManagerError(f"sequence {seq_id} cannot be truncated to {num_tokens} tokens: "
                                        f"its window's blocks before them are already given back")
        for manager, table in zip(self.managers, state.tables):
            manager.truncate(table, num_tokens)
        state.num_tokens = num_tokens
        state.num_computed = min(state.num_computed, num_tokens)

    def mark_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """The sequence's first ``num_computed`` positions hold computed K/V
        (``token_ids`` are its tokens so far): register its full blocks in the
        prefix cache, then give back the blocks that left every window."""
        state = self._get(seq_id)
        if not state.on_device:
            return
        num_computed = min(num_computed, state.num_tokens)
        if self.enable_prefix_caching:
            self._register(state, token_ids, num_computed)
        if num_computed > state.num_computed:
            state.num_computed = num_computed
            for manager, table in zip(self.managers if self._windowed else (), state.tables):
                manager.skip(table, num_computed)

    def _register(self, state: _SeqBlocks, token_ids: Sequence[int], num_computed: int) -> None:
        bs = self.block_size
        n_full = min(num_computed, len(token_ids)) // bs
        start = len(state.hashes)
        if n_full <= start:
            return
        parent = state.hashes[-1] if state.hashes else None
        new = block_hashes(token_ids, bs, self._key(state.salt), self.hash_fn,
                           start=start, parent_hash=parent, limit=n_full, block_keys=state.block_keys)
        for manager, table in zip(self.managers, state.tables):
            previous = parent
            for i, h in enumerate(new, start):
                if table.skipped <= i < table.end:
                    # Only the first group's blocks are reported to KV-aware routers:
                    # the others hold the same prefix under their own keys.
                    self.pool.register(table.blocks[i - table.skipped], manager.key(h), manager.key(previous),
                                       token_ids[i * bs:(i + 1) * bs], state.salt, report=manager.index == 0)
                previous = h
        state.hashes.extend(new)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (reference counts go up)."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise BlockManagerError(f"sequence {child_id} already has blocks")
        if not parent.on_device:
            raise BlockManagerError(f"sequence {parent_id} is swapped out; swap it in first")
        for table in parent.tables:
            for block in table.blocks:
                self.pool.incref(block)
        self._seqs[child_id] = _SeqBlocks([t.copy() for t in parent.tables], parent.num_tokens,
                                          list(parent.hashes), salt=parent.salt, block_keys=parent.block_keys,
                                          num_computed=parent.num_computed)

    def free(self, seq_id: int) -> None:
        """Return every block of the sequence, last block first (so a sequence's
        tail is evicted from the prefix cache before its head)."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            raise UnknownSequenceError(f"sequence {seq_id} has no blocks (never allocated or already freed)")
        pool = self.pool if state.on_device else self.host_pool
        for manager, table in zip(self.managers, state.tables):
            for block in manager.release(table, pool):
                self._forget_host(pool, block)

    def _release(self, pool: BlockPool, block: KVBlock) -> None:
        pool.decref(block)
        self._forget_host(pool, block)

    def _forget_host(self, pool: BlockPool, block: KVBlock) -> None:
        if pool is self.host_pool and block.ref_cnt == 0:
            self._host_meta.pop(block.block_id, None)

    # ------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        """Raise AssertionError if the pools and tables disagree (for tests)."""
        check_invariants(self)
