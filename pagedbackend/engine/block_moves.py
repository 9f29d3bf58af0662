"""The block moves a step carries, done before its forward pass in the order
that keeps every byte: the disk tier's saves first (host copies of evicted
blocks that this step may overwrite), swap-out, swap-in, copy-on-write,
then the disk tier's loads into blocks registered for them (``core/tier_moves.py``);
and the disk tier's setup (``kv_offload_dir``, ``engine/kv_tier.py``) with
its save of the pool's cached blocks at shutdown."""
import hashlib
import logging
import pathlib
from typing import Optional

from ..core.tier_moves import TierSave
from .kv_tier import GiB, DiskTier

logger = logging.getLogger("pagedbackend")
SHUTDOWN_CHUNK = 64   # blocks copied to the host at a time when the pool is saved at shutdown


def run_block_moves(runner, sched, tier: Optional[DiskTier]) -> None:
    """Carry out ``sched``'s block moves (a ``SchedulerOutput``) on ``runner``."""
    if sched.tier_saves:   # a memcpy to the host; the files are written off the step
        for record, payload in zip(sched.tier_saves, runner.read_blocks([s.block_id for s in sched.tier_saves])):
            tier.save(record, payload)
    if sched.swap_out_pairs:   # a block swapped out may be handed to someone else in this step
        runner.swap_out(sched.swap_out_pairs)
    if sched.swap_in_pairs:
        runner.swap_in(sched.swap_in_pairs)
    if sched.copy_pairs:
        runner.copy_blocks(sched.copy_pairs)
    if sched.tier_loads:
        runner.write_blocks([block_id for block_id, _ in sched.tier_loads],
                            [tier.take_staged(key) for _, key in sched.tier_loads])
    if tier is not None:
        tier.discard_staged()


def save_cached_blocks(runner, pool, tier: DiskTier) -> None:
    """Queue every block the prefix cache holds and the tier lacks (at
    shutdown: no step runs), waiting for room in the write queue."""
    blocks = [b for b in pool.cached.values() if not tier.contains(b.block_hash)]
    for i in range(0, len(blocks), SHUTDOWN_CHUNK):
        chunk = blocks[i:i + SHUTDOWN_CHUNK]
        for block, payload in zip(chunk, runner.read_blocks([b.block_id for b in chunk])):
            tier.save(TierSave.of(block), payload, wait=True)


def model_identity(model_path: pathlib.Path) -> str:
    """The checkpoint a block's K/V came from: its folder, and the names,
    sizes and modification times of its config and weights."""
    h = hashlib.sha256(str(model_path).encode())
    for path in sorted(model_path.glob("*")):
        if path.suffix in (".json", ".safetensors", ".gguf", ".bin") and path.is_file():
            info = path.stat()
            h.update(f"{path.name}|{info.st_size}|{info.st_mtime_ns}".encode())
    return h.hexdigest()


def make_kv_tier(config, runner, model_key: bytes, block_manager, relay) -> Optional[DiskTier]:
    """The disk tier of ``config.kv_offload_dir`` (None: off), attached to
    the block manager (saves and loads) and the event relay (its events)."""
    if config.kv_offload_dir is None:
        return None
    if not hasattr(runner, "read_blocks") or getattr(runner, "kv_cache", None) is None:
        raise ValueError(f"kv_offload_dir needs a KV cache in this process; {type(runner).__name__} has none "
                         "(an encoder, or tensor parallelism)")
    if any(window is not None for window in runner.kv_layout.windows):
        logger.warning("kv_offload_dir is off: a model with sliding-window KV groups keeps no whole prefix "
                       "in its blocks (disable_hybrid_kv_cache_manager=True keeps every block)")
        return None
    layout = {**runner.kv_block_layout(), "model": model_key.decode("utf-8", "backslashreplace"),
              "weights": model_identity(pathlib.Path(config.model))}
    block_bytes = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
    tier = DiskTier(config.kv_offload_dir, int(config.kv_offloading_size * GiB), layout, block_bytes)
    block_manager.attach_tier(tier)
    relay.tier = tier   # its events published, and closed at shutdown after saving the pool's blocks
    tier.before_close = lambda: save_cached_blocks(runner, block_manager.pool, tier)
    return tier
