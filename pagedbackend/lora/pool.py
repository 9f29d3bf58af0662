"""The adapter pool's pages: which adapter holds which rank pages on the
device, and which adapter goes when room is needed.

A page holds one rank of an adapter for every adapted projection (a row of
each LoRA A and the matching column of each LoRA B), so an adapter of rank r
takes r pages, anywhere in the pool: a rank-8 adapter takes an eighth of what
a rank-64 one does, instead of a slot padded to ``max_lora_rank``. Like the KV
block manager this knows nothing about tensors; the runner writes the pages it
hands out (``LoRAModel.write``).

Eviction is least recently used among the adapters that no running request
uses (``pinned``): an adapter that a running request reads is never evicted.
Admission keeps the adapters of the running requests within the pool
(``LoRAManager.fits``), so placing one of them always succeeds.
"""
from collections import OrderedDict
from typing import Collection, Hashable, List, Optional, Tuple


class PoolFullError(RuntimeError):
    """The pinned adapters leave no room for another one."""


class AdapterPool:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the adapter pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: List[int] = list(range(num_pages - 1, -1, -1))   # popped from the end: page 0 first
        self._resident: "OrderedDict[Hashable, List[int]]" = OrderedDict()   # least recently used first
        self.page_ins = 0     # adapters written into the pool
        self.evictions = 0    # adapters evicted to make room

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def resident(self) -> List[Hashable]:
        """Adapters holding pages, least recently used first."""
        return list(self._resident)

    def pages_of(self, adapter: Hashable) -> Optional[List[int]]:
        """The adapter's pages (marking it used now), or None when it holds none."""
        pages = self._resident.get(adapter)
        if pages is not None:
            self._resident.move_to_end(adapter)
        return pages

    def place(self, adapter: Hashable, rank: int, pinned: Collection[Hashable]) -> Tuple[List[int], List[Hashable]]:
        """Pages for an adapter of ``rank`` that holds none yet, evicting the
        least recently used unpinned adapters as needed; returns its pages and
        the adapters evicted. Raises PoolFullError (evicting nothing) when the
        pinned adapters leave too little room."""
        if adapter in self._resident:
            raise ValueError("the adapter already holds pages")
        if not 0 < rank <= self.num_pages:
            raise PoolFullError(f"an adapter of rank {rank} cannot fit a pool of {self.num_pages} pages")
        evictable = [a for a in self._resident if a not in pinned]
        room = self.num_free + sum(len(self._resident[a]) for a in evictable)
        if room < rank:
            raise PoolFullError(f"an adapter of rank {rank} needs {rank} pages; the adapters of running "
                                f"requests leave {room} of {self.num_pages}")
        evicted = []
        for victim in evictable:
            if self.num_free >= rank:
                break
            self._free += self._resident.pop(victim)
            evicted.append(victim)
        self.evictions += len(evicted)
        pages = [self._free.pop() for _ in range(rank)]
        self._resident[adapter] = pages
        self.page_ins += 1
        return pages, evicted

    def release(self, adapter: Hashable) -> bool:
        """Give the adapter's pages back (it was unloaded); False if it held none."""
        pages = self._resident.pop(adapter, None)
        if pages is None:
            return False
        self._free += pages
        return True

    def check(self) -> None:
        """Raise AssertionError if pages are lost or held twice (for tests)."""
        held = [p for pages in self._resident.values() for p in pages]
        assert len(held) == len(set(held)), "a page is held by two adapters"
        assert sorted(held + self._free) == list(range(self.num_pages)), "pages lost or duplicated"
