"""The adapter pool's pages: an adapter takes as many pages as its rank,
eviction is least recently used among adapters no running request uses, and
a pool whose room is pinned refuses without evicting anything."""
import pytest

from pagedbackend.lora.pool import AdapterPool, PoolFullError


def test_an_adapter_takes_pages_by_its_rank_not_the_largest_rank():
    pool = AdapterPool(16)
    small, _ = pool.place("r2", 2, pinned=())
    large, _ = pool.place("r8", 8, pinned=())
    assert len(small) == 2 and len(large) == 8 and pool.num_free == 6
    assert not set(small) & set(large)
    pool.check()


def test_eviction_takes_the_least_recently_used_unpinned_adapters_first():
    pool = AdapterPool(8)
    for name in ("a", "b", "c", "d"):
        pool.place(name, 2, pinned=())
    assert pool.pages_of("a") is not None   # a used again: b is now the oldest
    pages, evicted = pool.place("e", 4, pinned={"b"})
    assert evicted == ["c", "d"] and len(pages) == 4
    assert pool.resident == ["b", "a", "e"] and pool.evictions == 2 and pool.page_ins == 5
    pool.check()


def test_a_pool_pinned_full_refuses_and_evicts_nothing():
    pool = AdapterPool(8)
    pool.place("a", 4, pinned=())
    pool.place("b", 4, pinned=())
    with pytest.raises(PoolFullError, match="leave 4 of 8"):
        pool.place("c", 6, pinned={"a"})
    assert pool.resident == ["a", "b"] and pool.evictions == 0
    assert pool.release("a") and not pool.release("a") and pool.num_free == 4
    pool.check()
