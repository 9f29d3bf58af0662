"""Tensor parallelism, the wire: what rank 0 broadcasts each step, and how
the ranks meet.

Each step rank 0 broadcasts the step's inputs packed in one int64 tensor (two
for large prefills) over a gloo group: the flat batch and the block moves
(copies and swaps) that the workers must carry out before the forward, in the
order rank 0 carried them out. Ranks meet through a TCP store that carries
the engine config and each rank's load status; the default group (nccl on
CUDA, gloo on CPU) carries the row-parallel all-reduces.
"""
import os
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from pagedbackend.models.attention import AttentionMetadata
from pagedbackend.worker.batch import StepBatch

# Timeouts: EngineConfig.tp_timeout_s (collectives) and tp_rendezvous_s (loading),
# the same on every rank since workers read the config from the store. But
# workers wait for the next step as long as the server idles.
IDLE = timedelta(days=365)
CONFIG_KEY = "pagedbackend/config"

OP_STEP, OP_STOP = 1, 2
HEADER_LEN = 8   # op, tokens, seqs, block-table width, move words, attention groups; the rest reserved
# int64 words broadcast every step: the header and, when it fits, the payload.
# One broadcast instead of two halves the per-step cost on CPU (docs/tensor_parallel.md).
MESSAGE_LEN = 4096
COPY, SWAP_OUT, SWAP_IN = 0, 1, 2
Moves = List[Tuple[int, Sequence[Tuple[int, int]]]]


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed; the engine cannot continue."""


def pack_step(batch: StepBatch, moves: Moves) -> List[torch.Tensor]:
    """The tensors rank 0 broadcasts for one step: a fixed-size message holding
    the header and, when it fits, the payload (a decode batch of 64 sequences of
    512 tokens fits); a larger payload follows as a second tensor. Payload: token
    ids, positions, slots, cu_seqlens, seq lens, block tables, then each block
    move as (kind, n, src0, dst0, src1, dst1, ...). Slots and block tables come
    once per attention group of the batch (KV groups, ``core.kv_groups``)."""
    meta, metas = batch.meta, batch.metas
    num_seqs, width = meta.block_tables.shape
    words: List[int] = []
    for kind, pairs in moves:
        words += [kind, len(pairs)]
        for src, dst in pairs:
            words += [src, dst]
    payload = torch.cat([batch.input_ids, batch.positions, *(m.slot_mapping for m in metas),
                         meta.cu_seqlens_q.long(), meta.seq_lens.long(),
                         *(m.block_tables.long().flatten() for m in metas), torch.tensor(words, dtype=torch.long)])
    message = torch.empty(MESSAGE_LEN, dtype=torch.long)
    message[:6] = torch.tensor([OP_STEP, len(batch.input_ids), num_seqs, width, len(words), len(metas)])
    if len(payload) > MESSAGE_LEN - HEADER_LEN:
        return [message, payload]
    message[HEADER_LEN:HEADER_LEN + len(payload)] = payload
    return [message]


def stop_message() -> List[torch.Tensor]:
    message = torch.zeros(MESSAGE_LEN, dtype=torch.long)
    message[0] = OP_STOP
    return [message]


def receive_step(group) -> Optional[Tuple[StepBatch, Moves]]:
    """A worker's side of ``pack_step``; None when rank 0 says stop."""
    message = torch.empty(MESSAGE_LEN, dtype=torch.long)
    dist.broadcast(message, 0, group=group)
    tensors = [message]
    size = _payload_size(message)
    if size > MESSAGE_LEN - HEADER_LEN:
        tensors.append(torch.empty(size, dtype=torch.long))
        dist.broadcast(tensors[1], 0, group=group)
    return unpack_step(tensors)


def _payload_size(message: torch.Tensor) -> int:
    _, tokens, seqs, width, words, groups = message[:6].tolist()
    return (2 + groups) * tokens + 2 * seqs + 1 + groups * seqs * width + words


def unpack_step(tensors: List[torch.Tensor]) -> Optional[Tuple[StepBatch, Moves]]:
    """The batch (host tensors) and block moves of ``pack_step``'s tensors."""
    message = tensors[0]
    op, tokens, seqs, width, words, groups = message[:6].tolist()
    if op == OP_STOP:
        return None
    size = _payload_size(message)
    payload = tensors[1] if len(tensors) > 1 else message[HEADER_LEN:HEADER_LEN + size]
    parts = payload.split([tokens, tokens, *[tokens] * groups, seqs + 1, seqs, *[seqs * width] * groups, words])
    ids, pos, slots, (cu, lens), tables, flat = (parts[0], parts[1], parts[2:2 + groups], parts[2 + groups:4 + groups],
                                                 parts[4 + groups:4 + 2 * groups], parts[-1])
    cu, lens = cu.int(), lens.int()
    metas = [AttentionMetadata(slot_mapping=s, block_tables=t.view(seqs, width).int(), cu_seqlens_q=cu, seq_lens=lens)
             for s, t in zip(slots, tables)]
    moves: Moves = []
    flat, i = flat.tolist(), 0
    while i < len(flat):
        kind, n = flat[i], flat[i + 1]
        pairs = flat[i + 2:i + 2 + 2 * n]
        moves.append((kind, list(zip(pairs[0::2], pairs[1::2]))))
        i += 2 + 2 * n
    return StepBatch(ids, pos, metas[0], torch.empty(0, dtype=torch.long), metas if groups > 1 else []), moves


def apply_moves(runner, moves: Moves) -> None:
    do = {COPY: runner.copy_blocks, SWAP_OUT: runner.swap_out, SWAP_IN: runner.swap_in}
    for kind, pairs in moves:
        do[kind](pairs)


def threads_per_rank(local_ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // local_ranks)


def loaded_key(rank: int) -> str:
    return f"pagedbackend/loaded/{rank}"


def init_groups(device: torch.device, store, rank: int, world: int, timeout_s: float) -> None:
    """The default group carries the all-reduces, with a timeout
    (``EngineConfig.tp_timeout_s``) so that a hung rank fails."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def control_group(timeout: timedelta = IDLE):
    """Gloo (CPU) group for step messages. Workers wait in it, without a
    timeout, for as long as the server idles."""
    return dist.new_group(backend="gloo", timeout=timeout)
