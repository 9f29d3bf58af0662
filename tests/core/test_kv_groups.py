"""KV groups: layers grouped by attention kind over one block pool; a
sliding-window group gives a block back once every position in it has left
the window, takes blocks as steps need them, and needs only its window of a
cached prefix; admission counts every group."""
import pytest

from pagedbackend.core.block_manager import AllocStatus, BlockManager, BlockManagerError
from pagedbackend.core.group_manager import PLACEHOLDER_BLOCK
from pagedbackend.core.kv_groups import blocks_held, kv_layout, skipped_blocks, step_blocks


def tokens(n, start=0):
    return list(range(start, start + n))


# ---------------------------------------------------------------- layout

def test_a_model_whose_layers_attend_alike_has_one_group_of_every_layer():
    layout = kv_layout([None] * 30)
    assert len(layout.groups) == 1 and layout.slots == 30
    assert layout.layer_slot == tuple(range(30)) and not layout.frees_blocks
    mistral = kv_layout([4096] * 4)   # every layer windowed: one group that frees blocks
    assert mistral.windows == [4096] and mistral.frees_blocks


def test_gemma3_pattern_makes_groups_of_as_many_layers_as_the_smallest_kind():
    # 26 layers, every sixth full: 4 full, 22 windowed -> blocks of 4 layers,
    # one full group and six windowed ones (the last with 2 layers).
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    layout = kv_layout(windows)
    assert layout.slots == 4
    assert [g.window for g in layout.groups] == [None] + [512] * 6
    assert layout.groups[0].layers == (5, 11, 17, 23)
    assert [len(g.layers) for g in layout.groups[1:]] == [4, 4, 4, 4, 4, 2]
    for layer, (g, slot) in enumerate(zip(layout.layer_group, layout.layer_slot)):
        assert layout.groups[g].layers[slot] == layer
    kept = kv_layout(windows, free_out_of_window=False)
    assert len(kept.groups) == 1 and kept.windows == [None] and kept.slots == 26


def test_window_arithmetic():
    # The next query after n computed positions sees keys from n - window + 1.
    assert skipped_blocks(16, 8, 4) == 2      # keys 9.. : blocks 0 and 1 gone
    assert skipped_blocks(7, 8, 4) == 0 and skipped_blocks(100, None, 4) == 0
    assert blocks_held(8192, 1024, 16) == 512 - (8192 - 1023) // 16
    assert blocks_held(8192, None, 16) == 512
    assert step_blocks(1024, 16, 256) == -(-(1023 + 256) // 16) + 1 and step_blocks(None, 16, 256) is None


def test_bad_windows_are_refused_by_name():
    with pytest.raises(ValueError, match="sliding window"):
        kv_layout([None, 0])
    with pytest.raises(ValueError, match="windows"):
        BlockManager(8, 4, windows=[None, -3])


# ---------------------------------------------------------------- giving blocks back

def windowed_bm(num_blocks=32, caching=False, step_tokens=None, windows=(None, 8)):
    return BlockManager(num_blocks, 4, enable_prefix_caching=caching, watermark=0.0,
                        windows=windows, step_tokens=step_tokens)


def test_a_windowed_group_gives_back_each_block_once_every_position_left_the_window():
    bm = windowed_bm()
    bm.allocate(1, tokens(10))
    assert bm.num_used_blocks == 3 + 3
    bm.mark_computed(1, tokens(10), 10)   # next query at 10 sees 3..10: block 0 (0..3) still in
    full, windowed = bm.get_block_tables(1)
    assert windowed[0] != PLACEHOLDER_BLOCK or bm.ref_count(windowed[0]) == 1
    for n in range(11, 30):
        bm.append_slots(1, n)
        bm.mark_computed(1, tokens(n), n)
        held = bm.num_used_blocks - -(-n // 4)   # the full group keeps every block
        assert held == blocks_held(n, 8, 4), n
        bm.check_invariants()
    full, windowed = bm.get_block_tables(1)
    assert len(full) == len(windowed) == 8
    assert windowed[:skipped_blocks(29, 8, 4)] == [PLACEHOLDER_BLOCK] * skipped_blocks(29, 8, 4)
    bm.free(1)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_with_prefix_caching_a_block_that_left_the_window_stays_findable_in_the_free_list():
    bm = windowed_bm(caching=True)
    bm.allocate(1, tokens(17))
    bm.mark_computed(1, tokens(17), 17)   # keys 10..16 in view: blocks 0 and 1 leave
    assert bm.num_cached_free_blocks == 2
    bm.check_invariants()


def test_a_windowed_group_takes_blocks_only_as_far_as_the_step_reaches():
    bm = windowed_bm(step_tokens=8)
    bm.allocate(1, tokens(40))    # a 40-token prompt, computed 8 positions a step
    full, windowed = bm.get_block_tables(1)
    assert len(full) == 10 and len(windowed) == 2
    for done in range(0, 40, 8):
        bm.append_slots(1, 40, done + 8)
        bm.mark_computed(1, tokens(40), done + 8)
        assert bm.num_used_blocks - 10 <= step_blocks(8, 4, 8)
        bm.check_invariants()
    assert bm.num_used_blocks == 10 + blocks_held(40, 8, 4)


def test_admission_counts_every_group_and_a_windowed_group_its_first_step_only():
    bm = windowed_bm(num_blocks=20, step_tokens=8)
    assert bm.blocks_needed(tokens(40)) == 10 + 2
    assert bm.can_allocate([tokens(40)]) == AllocStatus.OK
    assert bm.can_allocate([tokens(80)]) == AllocStatus.NEVER   # 20 full-group blocks and 2 more
    bm.allocate(1, tokens(40))
    assert bm.can_allocate([tokens(30)]) == AllocStatus.LATER   # 8 + 2 do not fit the 8 left


def test_a_cached_prefix_maps_only_the_blocks_inside_the_window():
    bm = windowed_bm(caching=True)
    bm.allocate(1, tokens(32))
    bm.mark_computed(1, tokens(32), 32)
    bm.free(1)
    hit = bm.allocate(2, tokens(33))   # 32 positions cached: 8 whole blocks
    assert hit == 32
    full, windowed = bm.get_block_tables(2)
    # The first uncomputed position (32) sees keys from 25: blocks 6.. are mapped.
    assert windowed[:6] == [PLACEHOLDER_BLOCK] * 6
    assert [t.skipped for t in bm._seqs[2].tables] == [0, 6] and len(full) == len(windowed) == 9
    bm.check_invariants()


@pytest.mark.parametrize("windows,hit", [((8,), 32), ((None,), 12)])
def test_a_windowed_prefix_hit_survives_the_eviction_of_blocks_before_the_window(windows, hit):
    bm = BlockManager(40, 4, watermark=0.0, windows=windows)
    bm.allocate(1, tokens(33))
    bm.mark_computed(1, tokens(33), 33)   # windowed: blocks 0-5 leave the window, first to the free list
    bm.free(1)
    bm.allocate(2, tokens(148, start=900))   # 37 blocks: every never-used one, then 6 freed ones
    bm.free(2)
    # Windowed: blocks 0-5 went first and are gone, yet a query at 32 needs only
    # blocks 6 and 7 (positions 25..31): the whole prefix is a hit. Full
    # attention freed its blocks last first: only blocks 0-2 are left.
    assert bm.allocate(3, tokens(41)) == hit
    bm.check_invariants()


@pytest.mark.parametrize("missing,hit", [({5}, 10), ({9}, 9), ({8, 6}, 6), ({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, 0)])
def test_the_windowed_hit_search_moves_its_end_below_each_missing_block_in_the_window(missing, hit):
    from pagedbackend.core.group_manager import SlidingWindowManager
    manager = SlidingWindowManager(0, None, 4, window=8)
    manager.lookup = lambda hashes, token_ids, i: None if i in missing else object()
    # An end of e blocks needs blocks (4e - 7) // 4 .. e - 1: those its first uncomputed position sees.
    assert manager.longest_hit([b""] * 10, tokens(41), 10) == hit


def test_fork_shares_the_window_and_copy_on_write_stays_in_its_group():
    bm = windowed_bm()
    bm.allocate(1, tokens(22))
    bm.mark_computed(1, tokens(22), 22)
    bm.fork(1, 2)
    before = bm.num_used_blocks
    copies = bm.append_slots(2, 23)
    assert len(copies) == 2   # the shared last block, once per group
    assert bm.num_used_blocks == before + 2
    full1, win1 = bm.get_block_tables(1)
    full2, win2 = bm.get_block_tables(2)
    assert full1[:-1] == full2[:-1] and win1[:-1] == win2[:-1] and win1[-1] != win2[-1]
    bm.check_invariants()


def test_truncating_past_blocks_already_given_back_is_refused():
    bm = windowed_bm()
    bm.allocate(1, tokens(20))
    bm.mark_computed(1, tokens(20), 20)
    bm.append_slots(1, 24)
    bm.truncate(1, 21)   # speculative slots go back
    with pytest.raises(BlockManagerError, match="given back"):
        bm.truncate(1, 5)
    bm.check_invariants()


def test_swapping_keeps_what_the_window_gave_back():
    bm = BlockManager(32, 4, num_swap_blocks=16, enable_prefix_caching=False, watermark=0.0, windows=(None, 8))
    bm.allocate(1, tokens(25))
    bm.mark_computed(1, tokens(25), 25)
    used = bm.num_used_blocks
    out = bm.swap_out([1])
    assert len(out) == used and bm.num_used_blocks == 0
    back = bm.swap_in([1])
    assert len(back) == used
    assert bm.get_block_tables(1)[1][:skipped_blocks(25, 8, 4)] == [PLACEHOLDER_BLOCK] * skipped_blocks(25, 8, 4)
    bm.check_invariants()
