"""KV-cache events from the block pool (vLLM's BlockStored / BlockRemoved /
AllBlocksCleared): a router that applies them in order holds exactly the
prefix cache's blocks, learns every block with its parent, and is never told
to remove a block that still has children."""
import random

import pytest

from pagedbackend.core.block_manager import BlockManager, NoFreeBlocksError
from kv_router_view import RouterView
from pagedbackend.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog

BS = 4


def view():
    return RouterView(BS)


def matches(view: RouterView, bm: BlockManager) -> None:
    assert view.blocks == view.expected(bm.pool)


def manager(num_blocks=24, **kwargs):
    bm = BlockManager(num_blocks, BS, watermark=0.0, **kwargs)
    bm.pool.events = KVEventLog()
    return bm


def test_a_computed_prompt_is_stored_as_one_chain_and_evicted_leaves_first():
    bm, router = manager(num_blocks=4), view()
    prompt = list(range(100, 114))                  # 3 full blocks and 2 tokens
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, len(prompt))
    events = bm.pool.events.take()
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].parent_block_hash is None and events[0].token_ids == prompt[:12]
    router.apply(events)
    bm.free(1)
    bm.allocate(2, list(range(16)))                # needs all 4 blocks: evicts the 3 cached ones
    events = bm.pool.events.take()
    assert [type(e) for e in events] == [BlockRemoved]
    assert events[0].block_hashes == list(reversed(chain(router)))   # the last block first
    router.apply(events)
    matches(router, bm)


def chain(router: RouterView):
    """The router's one chain, from its root."""
    order, parent = [], None
    while True:
        nxt = [h for h, (p, _, _) in router.blocks.items() if p == parent]
        if not nxt:
            return order
        order.append(nxt[0])
        parent = nxt[0]


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_the_router_view_equal_to_the_prefix_cache(seed):
    rng = random.Random(seed)
    stems = [[rng.randrange(50) for _ in range(13)] for _ in range(3)]
    bm, router = manager(), view()
    live, tokens, next_id = [], {}, 0
    for _ in range(300):
        op = rng.random()
        if op < 0.35 or not live:
            stem = rng.choice(stems)
            prompt = stem[:rng.randint(1, len(stem))] + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            salt = rng.choice([b"", b"", b"tenant-a"])
            try:
                cached = bm.allocate(next_id, prompt, salt=salt)
            except NoFreeBlocksError:
                continue
            tokens[next_id] = list(prompt)
            live.append(next_id)
            # Sometimes two requests with one prompt are admitted before either is computed.
            if rng.random() < 0.5:
                bm.mark_computed(next_id, prompt, rng.randint(cached, len(prompt)))
            next_id += 1
        elif op < 0.6:
            seq = rng.choice(live)
            bm.mark_computed(seq, tokens[seq], len(tokens[seq]))
        elif op < 0.75:
            seq = rng.choice(live)
            grown = tokens[seq] + [rng.randrange(50) for _ in range(rng.randint(1, 5))]
            try:
                bm.append_slots(seq, len(grown))
            except NoFreeBlocksError:
                continue
            tokens[seq] = grown
            bm.mark_computed(seq, grown, len(grown))
        elif op < 0.8 and bm.num_free_blocks:
            seq = rng.choice(live)
            bm.mark_computed(seq, tokens[seq], len(tokens[seq]))
            bm.fork(seq, next_id)
            tokens[next_id] = list(tokens[seq])
            live.append(next_id)
            next_id += 1
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        router.apply(bm.pool.events.take())
        matches(router, bm)
        bm.check_invariants()
        for h, block in bm.pool.cached.items():   # the cache is a tree: every parent is cached
            assert block.parent_hash is None or block.parent_hash in bm.pool.cached
    assert bm.pool.num_evictions > 0


def test_salted_blocks_hash_apart_and_carry_their_salt():
    bm = manager()
    prompt = list(range(9))
    for seq, salt in ((1, b""), (2, b"tenant-a")):
        bm.allocate(seq, prompt, salt=salt)
        bm.mark_computed(seq, prompt, len(prompt))
    plain, salted = bm.pool.events.take()
    assert plain.token_ids == salted.token_ids
    assert set(plain.block_hashes).isdisjoint(salted.block_hashes)
    assert plain.extra_keys is None and salted.extra_keys == [("tenant-a",), ("tenant-a",)]
    assert salted.wire()[8] == [("tenant-a",), ("tenant-a",)] and len(plain.wire()) == 8


def test_reset_clears_everything_once_nothing_is_in_use():
    bm, router = manager(), view()
    prompt = list(range(9))
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 9)
    bm.allocate(2, [7] * 9)
    bm.mark_computed(2, [7] * 9, 9)
    router.apply(bm.pool.events.take())
    bm.free(1)
    bm.pool.reset_prefix_cache()            # sequence 2 still holds its blocks
    events = bm.pool.events.take()
    assert [type(e) for e in events] == [BlockRemoved]
    router.apply(events)
    matches(router, bm)
    bm.free(2)
    bm.pool.reset_prefix_cache()
    assert [type(e) for e in bm.pool.events.take()] == [AllBlocksCleared]
    assert not bm.pool.cached and bm.pool.num_cached_free == 0


def test_without_an_event_log_nothing_is_recorded():
    bm = BlockManager(8, BS)
    bm.allocate(1, list(range(9)))
    bm.mark_computed(1, list(range(9)), 9)
    assert bm.pool.events is None and len(bm.pool.cached) == 2
