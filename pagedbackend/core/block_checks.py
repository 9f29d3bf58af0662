"""The block manager's invariants, checked by tests after every change:
reference counts equal table entries, the free queue holds exactly the free
blocks, the pool's counters agree with its blocks, and every KV group's
table covers its positions, a windowed group's having given back exactly
the blocks that left its window."""
from .kv_groups import cdiv, skipped_blocks


def check_invariants(bm) -> None:
    """Raise AssertionError if ``bm``'s pools and tables disagree."""
    for pool, on_device in ((bm.pool, True), (bm.host_pool, False)):
        if pool is None:
            continue
        refs = [0] * pool.num_blocks
        for state in bm._seqs.values():
            if state.on_device == on_device:
                for table in state.tables:
                    for block in table.blocks:
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
    bs = bm.block_size
    for seq_id, state in bm._seqs.items():
        assert len(state.tables) == len(bm.managers), f"sequence {seq_id}: one table per group"
        assert state.num_computed <= state.num_tokens, f"sequence {seq_id}: computed past its tokens"
        for g, (manager, table) in enumerate(zip(bm.managers, state.tables)):
            where = f"sequence {seq_id}, group {g}"
            assert table.end >= cdiv(table.num_tokens, bs), f"{where}: {table.end} blocks for {table.num_tokens} tokens"
            assert table.num_tokens <= state.num_tokens, f"{where}: slots past the sequence"
            if manager.window is None:
                assert table.skipped == 0 and table.num_tokens == state.num_tokens, \
                    f"{where}: a full-attention table lacks positions"
                continue
            assert table.num_tokens >= state.num_computed, f"{where}: computed positions lack slots"
            gone = skipped_blocks(state.num_computed, manager.window, bs)
            assert table.skipped == gone, (f"{where}: {table.skipped} blocks given back, but "
                                           f"{gone} left the window after {state.num_computed} positions")
