"""The block manager's side of the disk tier (``core/tier_moves.py``) over a
real ``DiskTier`` in a temporary folder, no model: what an eviction saves,
what an admission loads, and the pass rules that keep every byte right (a
block whose content arrives in this very step is never saved from, a load
into a block taken again in the same pass is called off)."""
import pytest

from pagedbackend.core.block_manager import BlockManager
from pagedbackend.core.prefix_cache import block_hashes
from pagedbackend.engine.kv_tier import DiskTier

BS = 4
PAYLOAD = 64


def payload(key: bytes) -> bytes:
    return (key * 2)[:PAYLOAD]


@pytest.fixture
def tier(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, {"test": "layout"}, PAYLOAD)
    yield tier
    tier.close()


def manager(tier, num_blocks=8):
    bm = BlockManager(num_blocks, BS, watermark=0.0)
    bm.attach_tier(tier)
    return bm


def compute_and_free(bm, seq_id, prompt, salt=b""):
    """A prompt computed in one step (its pass's moves taken), then freed: its full blocks stay cached."""
    bm.allocate(seq_id, prompt, salt=salt)
    bm.take_tier_moves()
    bm.mark_computed(seq_id, prompt, len(prompt))
    bm.free(seq_id)


def write_saves(bm, tier):
    """What the engine does with a pass's saves: each block's bytes to the tier."""
    saves, loads = bm.take_tier_moves()
    for record in saves:
        tier.save(record, payload(record.key))
    assert tier.flush()
    return saves, loads


PROMPT = list(range(10, 10 + 3 * BS + 1))   # three full blocks and a token


def prompt_on_disk(tier, num_blocks=8, salt=b""):
    """A block manager whose pool computed PROMPT, then evicted its blocks to the tier."""
    bm = manager(tier, num_blocks)
    compute_and_free(bm, 1, PROMPT, salt)
    bm.allocate(2, list(range(100, 100 + num_blocks * BS)))
    write_saves(bm, tier)
    bm.free(2)
    return bm


def test_an_evicted_cached_block_is_saved_under_its_prefix_key(tier):
    bm = manager(tier)
    prompt = list(range(10, 10 + 3 * BS))
    compute_and_free(bm, 1, prompt)
    hashes = block_hashes(prompt, BS, bm._key(b""))
    bm.allocate(2, list(range(100, 100 + 8 * BS)))   # the whole pool: every cached block evicted
    saves, loads = write_saves(bm, tier)
    assert sorted(s.key for s in saves) == sorted(hashes) and loads == []
    chain = {s.key: s for s in saves}
    assert chain[hashes[1]].parent_key == hashes[0] and chain[hashes[1]].token_ids == tuple(prompt[BS:2 * BS])
    assert all(tier.contains(h) for h in hashes)
    assert bm.take_tier_moves() == ([], [])   # a pass's moves are taken once


def test_a_prompt_that_misses_the_pool_loads_its_blocks_from_disk(tier):
    bm, prompt = prompt_on_disk(tier), PROMPT
    computed = bm.allocate(3, prompt)
    assert computed == 3 * BS   # every full block; the last token is computed
    saves, loads = bm.take_tier_moves()
    table = bm.get_block_table(3)
    hashes = block_hashes(prompt, BS, bm._key(b""))
    assert loads == list(zip(table[:3], hashes))
    assert [tier.take_staged(key) for _, key in loads] == [payload(h) for h in hashes]
    assert all(bm.pool.blocks[b].block_hash == h for b, h in loads)   # registered: a pool hit from now on
    bm.check_invariants()


def test_another_salt_finds_nothing_on_disk(tier):
    bm, prompt = prompt_on_disk(tier, salt=b"tenant-a"), PROMPT
    assert bm.allocate(3, prompt, salt=b"tenant-b") == 0 and bm.allocate(4, prompt) == 0
    assert bm.take_tier_moves()[1] == []


def test_a_block_taken_twice_in_one_pass_is_neither_saved_nor_loaded(tier):
    bm, prompt = prompt_on_disk(tier, num_blocks=4), PROMPT
    assert bm.allocate(3, prompt) == 3 * BS   # three blocks loaded into fresh blocks ...
    bm.free(3)
    bm.allocate(4, list(range(200, 200 + 4 * BS)))   # ... and taken again before the step ran
    saves, loads = bm.take_tier_moves()
    assert saves == [] and loads == []   # their content never arrived: nothing to save, nothing to load into


def test_a_file_gone_under_the_tier_is_a_miss(tier, tmp_path):
    bm, prompt = prompt_on_disk(tier), PROMPT
    hashes = block_hashes(prompt, BS, bm._key(b""))
    (tmp_path / tier.name(hashes[1])).unlink()   # another replica's bound removed it
    assert bm.allocate(3, prompt) == BS   # block 0 from disk, the rest computed
    assert tier.stats.refused == 0 and not tier.contains(hashes[1])
