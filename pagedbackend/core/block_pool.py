"""Physical KV blocks: a fixed pool with reference counts, an LRU free queue and
a cache of full blocks keyed by their prefix hash.

Like page frames in an OS, blocks are handed out and returned in O(1). A block
whose reference count drops to zero keeps its hash and contents: it stays
findable by the prefix cache until the pool needs it again, and free blocks are
reused least-recently-freed first (lazy LRU eviction).

Cached blocks form a tree: a block is registered only under a cached parent,
and a block leaving the cache takes its cached descendants with it (a prefix
lookup walks from the first block, so they could not be found anyway). With
``events`` set (a ``KVEventLog``), blocks entering the prefix cache
(``register``) and leaving it (eviction, reset) are reported there, each block
before its parent, for routers that route by what the engine holds
(``kv_events.py``). With ``moves`` set (``tier_moves.TierMoves``: the disk
tier is on), every cached block an allocation evicts, and each block
allocated, is told to it, so the evicted content can be saved before the
step overwrites it.
"""
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .kv_events import KVEventLog


class BlockManagerError(RuntimeError):
    """Misuse of the block manager; the pool is left untouched."""


class NoFreeBlocksError(BlockManagerError):
    """The pool has no free block left."""


class KVBlock:
    """One physical block of ``block_size`` token slots."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids", "salt", "reported",
                 "num_tokens", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only for a full block whose K/V are computed (the prefix cache key),
        # with the content it was computed from, to rule out hash collisions.
        self.block_hash: Optional[bytes] = None
        self.parent_hash: Optional[bytes] = None
        self.token_ids: Optional[Tuple[int, ...]] = None
        self.salt = b""   # the cache salt in its hash (reported with the block's events)
        self.reported = False   # its BlockStored was published (so its BlockRemoved is too)
        # Token positions of this block that hold a sequence's tokens (<= block_size).
        self.num_tokens = 0
        self.prev_free: Optional["KVBlock"] = None
        self.next_free: Optional["KVBlock"] = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: pop from the head (the block
    freed longest ago), append at the tail, remove from the middle in O(1) when a
    prefix-cache hit revives a free block."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head: Optional[KVBlock] = None
        self._tail: Optional[KVBlock] = None
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        if self._head is None:
            raise NoFreeBlocksError("no free KV block left")
        block = self._head
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head
        while block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """A fixed number of physical blocks with reference counts and a prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: List[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: Dict[bytes, KVBlock] = {}
        self.children: Dict[bytes, Set[KVBlock]] = {}   # parent hash -> its cached children
        self.num_shared = 0        # blocks with ref_cnt > 1
        self.num_cached_free = 0   # free blocks still holding a cached hash
        self.num_evictions = 0
        # Set by the engine when KV-cache events are on (None: nothing reported).
        self.events: Optional[KVEventLog] = None
        # Set when the disk tier is on (tier_moves.TierMoves; None: evicted content is dropped).
        self.moves = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> KVBlock:
        """Take the least recently freed block; evict its cached hash if it has one."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self._uncache(block, spill=self.moves is not None)
            self.num_cached_free -= 1
            self.num_evictions += 1
        if self.moves is not None:
            self.moves.allocated(block)
        block.ref_cnt = 1
        block.num_tokens = 0
        return block

    def incref(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            # A prefix-cache hit on a freed block takes it back from the free queue.
            self.free_queue.remove(block)
            if block.block_hash is not None:
                self.num_cached_free -= 1
        elif block.ref_cnt == 1:
            self.num_shared += 1
        block.ref_cnt += 1

    def decref(self, block: KVBlock) -> None:
        if block.ref_cnt <= 0:
            raise BlockManagerError(f"block {block.block_id} freed more often than allocated")
        block.ref_cnt -= 1
        if block.ref_cnt == 1:
            self.num_shared -= 1
        elif block.ref_cnt == 0:
            self.free_queue.append(block)
            if block.block_hash is not None:
                self.num_cached_free += 1

    def lookup(self, block_hash: bytes, parent_hash: Optional[bytes],
               token_ids: Sequence[int]) -> Optional[KVBlock]:
        """The cached block computed from exactly this content, or None."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None  # a miss, or a hash collision between different contents
        return block

    def register(self, block: KVBlock, block_hash: bytes, parent_hash: Optional[bytes],
                 token_ids: Sequence[int], salt: bytes = b"", report: bool = True) -> bool:
        """Make a full, computed block findable by its hash (``salt``: the cache
        salt that went into it, for its event; ``report``: publish its events
        when events are on). A hash already taken (the same content computed
        twice, or a collision), or for a reported block a parent no longer
        cached (a router could not place it), leaves it unregistered."""
        report = report and self.events is not None
        if (not self.enable_caching or block.block_hash is not None or block_hash in self.cached
                or (report and parent_hash is not None and parent_hash not in self.cached)):
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
        block.salt, block.reported = salt, report
        self.cached[block_hash] = block
        if report and parent_hash is not None:   # a router drops a removed block's subtree: so do we
            self.children.setdefault(parent_hash, set()).add(block)
        if block.reported:
            self.events.stored(block_hash, parent_hash, block.token_ids, salt)
        return True

    def _uncache(self, block: KVBlock, report: bool = True, spill: bool = False) -> None:
        """Drop the block's hash, and before it those of its cached reported
        descendants (deepest first; those still free no longer count as cached).
        ``spill``: each one's content goes to the disk tier (``moves``)."""
        subtree, stack = [], [block]
        while stack:
            node = stack.pop()
            subtree.append(node)
            stack.extend(self.children.pop(node.block_hash, ()))
        for node in reversed(subtree):   # every child after its parent in subtree
            if node is not block and node.ref_cnt == 0:
                self.num_cached_free -= 1
            del self.cached[node.block_hash]
            if node.parent_hash is not None and node.parent_hash in self.children:
                self.children[node.parent_hash].discard(node)
                if not self.children[node.parent_hash]:
                    del self.children[node.parent_hash]
            if report and node.reported:
                self.events.removed(node.block_hash)
            if spill:
                self.moves.evicted(node)
            node.block_hash = node.parent_hash = node.token_ids = None
            node.salt, node.reported = b"", False

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of a free block (e.g. after weights change):
        reported as one ``AllBlocksCleared`` when no cached block is in use, else
        block by block, newest first (children before their parents)."""
        everything = all(block.ref_cnt == 0 for block in self.cached.values())
        for block in reversed(list(self.cached.values())):
            if block.ref_cnt == 0 and block.block_hash is not None:   # not gone with a parent
                self._uncache(block, report=not everything)
                self.num_cached_free -= 1
        if everything and self.events is not None:
            self.events.cleared()
