"""Decode steps replayed from CUDA graphs, as vLLM does.

A decode step of a small model on a GPU is bound by kernel launches, not by
the kernels: some 10 launches per layer, each a few microseconds of host
work. A CUDA graph records the launches of one whole step once and replays
them with a single call. A graph fixes every shape and every address it
read, so:

- each captured size ``B`` has its own graph; a decode step of ``n``
  sequences runs the graph of the smallest ``B >= n`` (``capture_sizes``:
  1, 2, 4, then multiples of 8 up to ``max_num_seqs``, 256 at most; larger
  steps, and any step with a prefill, run as before);
- the step's tensors are copied into static buffers that every graph reads
  (token ids, positions, cache slots, sequence lengths, block tables as wide
  as ``max_model_len`` needs; slots and tables once per KV group), and the
  logits come back in a static buffer;
- the ``B - n`` padding rows take token 0 at position 0, cache slot -1 (the
  KV write skips negative slots, so padding writes nothing) and length 1
  with whatever block their table row last held (any block id ever written
  there is a real block, so the one key they see is finite). Rows never mix
  in the linear layers, so the padding changes no real row.

Only attention kernels whose launch depends on nothing but the shapes can be
recorded: the Triton-lang kernels (``AttentionOps.graphs``), whose decode
plan is one query tile per sequence and whose loop over the keys reads each
sequence's length on the device. The reference twins size their gathers on
the host, so they never run from a graph.

``capture=False`` keeps the same buffers, padding and per-size steps but
runs each step directly instead of replaying a recording: that is how the
padding and the buffers are tested on a machine without CUDA.
"""
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from pagedbackend.models.attention import AttentionMetadata, step_context
from pagedbackend.worker.batch import StepBatch
from pagedbackend.worker.compiled import compile_failure

logger = logging.getLogger("pagedbackend")

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> List[int]:
    """Batch sizes that get a graph: 1, 2, 4, multiples of 8, and the cap
    ``min(max_num_seqs, limit)`` itself."""
    cap = min(max_num_seqs, limit)
    if cap < 1:
        raise ValueError(f"capture sizes need max_num_seqs >= 1, got {max_num_seqs}")
    sizes = [s for s in [1, 2, 4, *range(8, cap + 1, 8)] if s < cap]
    return sizes + [cap]


@dataclass
class _Buffers:
    """The static tensors every graph reads (and the logits it writes), as
    wide as the largest captured size; cache slots and block tables once per
    KV group."""
    input_ids: torch.Tensor     # int64 [M]
    positions: torch.Tensor     # int64 [M], or [3, M] for M-RoPE (runner.position_rows)
    slot_mapping: List[torch.Tensor]  # per KV group: int64 [M]
    seq_lens: torch.Tensor      # int32 [M]
    block_tables: List[torch.Tensor]  # per KV group: int32 [M, W]
    cu_seqlens_q: torch.Tensor  # int32 [M + 1]: 0, 1, ..., M (one query token per row)
    logits: torch.Tensor        # float32 [M, vocab]

    def meta(self, size: int, group: int = 0) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[group][:size],
                                 block_tables=self.block_tables[group][:size],
                                 cu_seqlens_q=self.cu_seqlens_q[:size + 1],
                                 seq_lens=self.seq_lens[:size])


class DecodeGraphs:
    """One recorded decode step per size in ``sizes`` for ``runner`` (a
    ``ModelRunner`` on CUDA with graph-safe attention kernels). ``run``
    serves a prepared decode batch that ``fits``."""

    def __init__(self, runner, sizes: List[int], capture: bool = True):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {sizes}")
        if not runner.attention_ops.graphs:
            raise ValueError("the attention backend plans each step on the host; only the "
                             "triton backend's kernels can be replayed from a graph")
        self.runner = runner
        self.sizes = sorted(set(sizes))
        self.capture = capture
        self.replays: Dict[int, int] = {size: 0 for size in self.sizes}
        device, largest = runner.device, self.sizes[-1]
        width = -(-runner.max_model_len // runner.block_size)
        ints = dict(device=device, dtype=torch.int32)
        groups = len(runner.kv_layout.groups)
        self.buffers = b = _Buffers(
            input_ids=torch.zeros(largest, dtype=torch.long, device=device),
            positions=torch.zeros((*runner.position_rows, largest), dtype=torch.long, device=device),
            slot_mapping=[torch.full((largest,), -1, dtype=torch.long, device=device) for _ in range(groups)],
            seq_lens=torch.ones(largest, **ints),
            block_tables=[torch.zeros((largest, width), **ints) for _ in range(groups)],
            cu_seqlens_q=torch.arange(largest + 1, **ints),
            logits=torch.zeros((largest, runner.vocab_size), dtype=torch.float32, device=device))
        self._steps: Dict[int, Callable[[], None]] = {}
        pool = torch.cuda.graph_pool_handle() if capture else None
        # Largest first: the smaller graphs reuse the larger ones' pool memory.
        for size in reversed(self.sizes):
            step = self._step_of(size)
            step()   # compiles every kernel of this size (no compile may happen in a capture)
            if capture:
                step = self._record(step, pool)
            self._steps[size] = step

    def _step_of(self, size: int) -> Callable[[], None]:
        """The forward of ``size`` rows over the static buffers, its logits
        into the static logits buffer."""
        runner, b = self.runner, self.buffers
        host_cu, host_lens = torch.arange(size + 1, dtype=torch.int32), torch.ones(size, dtype=torch.int32)
        metas = []
        for group, window in runner.attention_groups:   # a plan per attention group, on its KV group's buffers
            meta = b.meta(size, group)
            meta.plan = runner.attention_ops.plan(
                host_cu, host_lens, block_tables=meta.block_tables, slot_mapping=meta.slot_mapping,
                block_size=runner.block_size, num_heads=runner.num_heads,
                num_kv_heads=runner.model.num_kv_heads, device=runner.device, window=window)
            metas.append(meta)
        forward, logits_of = runner.step_functions()
        ids, positions, out = b.input_ids[:size], b.positions[..., :size], b.logits[:size]

        def step() -> None:
            with torch.inference_mode(), step_context(runner.kv_caches, metas, runner.attention_ops,
                                                      runner.layer_group, kv_scales=runner.kv_scales):
                out.copy_(logits_of(forward(ids, positions)))
        return step

    @staticmethod
    def _record(step: Callable[[], None], pool) -> Callable[[], None]:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        torch.cuda.synchronize()
        return graph.replay

    def size_for(self, num_seqs: int) -> Optional[int]:
        """The smallest captured size that holds ``num_seqs`` rows (None: none does)."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def fits(self, batch: StepBatch) -> bool:
        """Whether ``batch`` is a decode step a graph serves: one token and
        logits for every sequence, no more sequences than the largest size."""
        n = batch.meta.seq_lens.numel()
        return (batch.input_ids.numel() == n and batch.logits_rows.numel() == n
                and n <= self.sizes[-1]
                and batch.meta.block_tables.shape[1] <= self.buffers.block_tables[0].shape[1])

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` of a decode batch (host tensors) that fits."""
        n = batch.meta.seq_lens.numel()
        size = self.size_for(n)
        b = self.buffers
        width = batch.meta.block_tables.shape[1]
        b.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        b.positions[..., :n].copy_(batch.positions, non_blocking=True)
        b.seq_lens[:n].copy_(batch.meta.seq_lens, non_blocking=True)
        for meta, slots, tables in zip(batch.metas, b.slot_mapping, b.block_tables):   # per KV group
            slots[:n].copy_(meta.slot_mapping, non_blocking=True)
            tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
            if size > n:
                slots[n:size].fill_(-1)
        if size > n:   # padding rows: token 0 at position 0, no cache write, one key
            b.input_ids[n:size].zero_()
            b.positions[..., n:size].zero_()
            b.seq_lens[n:size].fill_(1)
        self._steps[size]()
        self.replays[size] += 1
        return b.logits[:n].clone()


def decode_graphs_for(runner) -> Optional[DecodeGraphs]:
    """The runner's decode graphs, captured now, when its settings and device
    allow them (None otherwise; one log line says why when a capture fails)."""
    config = runner.config
    if runner.device.type != "cuda" or config.enforce_eager:
        return None
    if not runner.attention_ops.graphs:
        logger.info("pagedbackend: decode steps run without CUDA graphs: attention_backend=%s "
                    "plans each step on the host", config.attention_backend)
        return None
    try:
        return DecodeGraphs(runner, capture_sizes(config.max_num_seqs))
    except Exception as exc:   # an op that syncs with the host, or a driver without graphs
        logger.warning("pagedbackend: decode steps run without CUDA graphs: capture failed (%s)",
                       compile_failure(exc))
        logger.debug("pagedbackend: CUDA graph capture failed", exc_info=True)
        torch.cuda.synchronize()
        return None
