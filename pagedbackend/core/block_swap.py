"""Swapping whole sequence groups between the device block pool and a
bounded host pool (PagedAttention, section 4.5), all or nothing. Blocks
shared inside a group move once; a block whose content is still in the
device prefix cache when it comes back is mapped again rather than copied.
Returned ``(src, dst)`` pairs tell the model runner what to copy.

A part of ``BlockManager`` (its tables, pools and host-block metadata).
Every KV group's held blocks move; a windowed group's given-back blocks
stay given back.
"""
from typing import Dict, List, Sequence, Tuple

from .block_pool import BlockManagerError, KVBlock, NoFreeBlocksError

BlockMapping = List[Tuple[int, int]]


class SwapMixin:
    def _distinct_blocks(self, seq_ids: Sequence[int], on_device: bool) -> List[KVBlock]:
        if len(set(seq_ids)) != len(seq_ids):
            raise BlockManagerError(f"duplicate sequence ids in {list(seq_ids)}")
        seen: Dict[int, KVBlock] = {}
        for seq_id in seq_ids:
            state = self._get(seq_id)
            if state.on_device != on_device:
                where = "on the device" if state.on_device else "swapped out"
                raise BlockManagerError(f"sequence {seq_id} is already {where}")
            for table in state.tables:
                for block in table.blocks:
                    seen.setdefault(block.block_id, block)
        return list(seen.values())

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        return len(self._distinct_blocks(seq_ids, True)) <= self.num_free_swap_blocks

    def blocks_to_swap_in(self, seq_ids: Sequence[int]) -> int:
        """Device blocks ``swap_in`` would take at most for this group."""
        return len(self._distinct_blocks(seq_ids, False))

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        needed = len(self._distinct_blocks(seq_ids, False))
        return self.pool.num_free - needed >= self.watermark_blocks

    def swap_out(self, seq_ids: Sequence[int]) -> BlockMapping:
        """Move a whole group to the host pool. Returns (device, host) pairs to copy."""
        distinct = self._distinct_blocks(seq_ids, True)
        if len(distinct) > self.num_free_swap_blocks:
            raise NoFreeBlocksError(
                f"swapping out needs {len(distinct)} host blocks, {self.num_free_swap_blocks} free")
        return self._move(seq_ids, self.host_pool, self._to_host, self.pool.decref, on_device=False)

    def swap_in(self, seq_ids: Sequence[int]) -> BlockMapping:
        """Bring a swapped-out group back. Returns (host, device) pairs to copy;
        a block whose content is still in the prefix cache is mapped, not copied."""
        distinct = self._distinct_blocks(seq_ids, False)
        if len(distinct) > self.pool.num_free:
            raise NoFreeBlocksError(f"swapping in needs {len(distinct)} device blocks, "
                                    f"{self.pool.num_free} free")
        return self._move(seq_ids, self.pool, self._bring_back,
                          lambda host: self._release(self.host_pool, host), on_device=True)

    def _move(self, seq_ids: Sequence[int], target_pool, place, release, on_device: bool) -> BlockMapping:
        """Give every distinct block of the group one counterpart in
        ``target_pool`` (``place(block, copies)``), shared again wherever the
        group shared it; the old blocks go back (``release``), last first."""
        moved: Dict[int, KVBlock] = {}
        copies: BlockMapping = []
        for seq_id in seq_ids:
            state = self._seqs[seq_id]
            for table in state.tables:
                blocks = []
                for block in table.blocks:
                    twin = moved.get(block.block_id)
                    if twin is None:
                        twin = moved[block.block_id] = place(block, copies)
                    else:
                        target_pool.incref(twin)
                    blocks.append(twin)
                for block in reversed(table.blocks):
                    release(block)
                table.blocks = blocks
            state.on_device = on_device
        return copies

    def _to_host(self, block: KVBlock, copies: BlockMapping) -> KVBlock:
        host = self.host_pool.allocate()
        self._host_meta[host.block_id] = (block.block_hash, block.parent_hash, block.token_ids, block.num_tokens,
                                          block.salt)
        copies.append((block.block_id, host.block_id))
        return host

    def _bring_back(self, host: KVBlock, copies: BlockMapping) -> KVBlock:
        block_hash, parent_hash, token_ids, num_tokens, salt = self._host_meta[host.block_id]
        if block_hash is not None:
            cached = self.pool.lookup(block_hash, parent_hash, token_ids)
            if cached is not None:
                self.pool.incref(cached)
                return cached
        block = self.pool.allocate()
        block.num_tokens = num_tokens
        copies.append((host.block_id, block.block_id))
        if block_hash is not None:
            self.pool.register(block, block_hash, parent_hash, token_ids, salt)
        return block
