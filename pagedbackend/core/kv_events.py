"""KV-cache events: blocks entering and leaving the prefix cache, in vLLM's
shapes (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), so that
routers built for vLLM (NVIDIA Dynamo's KV router, llm-d's indexer) can route
by what an engine holds.

The block pool appends events to a ``KVEventLog`` (a port: a plain list, no
network); the engine takes the log after each step and hands the batch to a
publisher (``engine/kv_publisher.py``), which does the sending off the step.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence


def external_hash(block_hash: bytes) -> int:
    """A block's hash as vLLM's events carry it: an unsigned 64-bit integer
    (the first 8 bytes of our SHA-256 chain hash). Routers use it only to link
    a block to its parent and to name removals."""
    return int.from_bytes(block_hash[:8], "big")


@dataclass
class BlockStored:
    """Full blocks that entered the prefix cache, a chain in order: the first
    block's parent is ``parent_block_hash`` (None: the sequence's first block)."""
    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]           # every block's tokens, concatenated
    block_size: int
    lora_id: Optional[int] = None      # vLLM's deprecated adapter id (always None here)
    medium: Optional[str] = None       # vLLM's: "GPU" / "CPU" (the engine's pool), "DISK" (kv_offload_dir)
    lora_name: Optional[str] = None    # the adapter the blocks were computed with, if any
    # Per block, the keys besides the tokens that went into its hash (the
    # request's cache salt), or None when there are none for any block.
    extra_keys: Optional[List[Optional[tuple]]] = None

    def wire(self) -> list:
        """vLLM's msgpack layout (a tagged array; a trailing default omitted)."""
        fields = ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids,
                  self.block_size, self.lora_id, self.medium, self.lora_name]
        return fields + [self.extra_keys] if self.extra_keys is not None else fields


@dataclass
class BlockRemoved:
    """Blocks evicted from the prefix cache, each block before its parent."""
    block_hashes: List[int]
    medium: Optional[str] = None

    def wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass
class AllBlocksCleared:
    """The prefix cache was emptied."""

    def wire(self) -> list:
        return ["AllBlocksCleared"]


def salt_key(salt: bytes) -> Optional[tuple]:
    """A request's cache salt as a block's extra keys (vLLM carries it the same
    way), or None for no salt. Text that is not UTF-8 stays distinct, escaped."""
    return (salt.decode("utf-8", "backslashreplace"),) if salt else None


# vLLM's ``medium`` values: where a block is held (its pool is the GPU's, or
# the CPU's when the engine runs there), and the disk tier (``kv_offload_dir``).
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK = "GPU", "CPU", "DISK"


class KVEventLog:
    """Where the block pool appends events; the engine ``take``s them once a
    step. Consecutive stores of one chain (same salt, adapter and medium)
    merge into one ``BlockStored``, consecutive removals (same medium) into
    one ``BlockRemoved``. ``medium``: the pool's (None: not named)."""

    def __init__(self, medium: Optional[str] = None):
        self.events: list = []
        self.medium = medium

    def stored(self, block_hash: bytes, parent_hash: Optional[bytes], token_ids: Sequence[int],
               salt: bytes = b"", lora_name: Optional[str] = None, medium: Optional[str] = None) -> None:
        """``medium``: where the block is held (None: the pool)."""
        medium = medium or self.medium
        h = external_hash(block_hash)
        parent = None if parent_hash is None else external_hash(parent_hash)
        key = salt_key(salt)
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and last.block_hashes[-1] == parent and last.lora_name == lora_name
                and last.medium == medium
                and last.block_size == len(token_ids) and (last.extra_keys or [None])[-1] == key):
            last.block_hashes.append(h)
            last.token_ids.extend(token_ids)
            if last.extra_keys is not None:
                last.extra_keys.append(key)
            return
        self.events.append(BlockStored([h], parent, list(token_ids), len(token_ids), medium=medium,
                                       lora_name=lora_name, extra_keys=None if key is None else [key]))

    def removed(self, block_hash: bytes, medium: Optional[str] = None) -> None:
        medium = medium or self.medium
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_hash(block_hash))
        else:
            self.events.append(BlockRemoved([external_hash(block_hash)], medium))

    def cleared(self) -> None:
        """Everything cached is gone: earlier events of this step no longer matter."""
        self.events = [AllBlocksCleared()]

    def take(self) -> list:
        events, self.events = self.events, []
        return events
