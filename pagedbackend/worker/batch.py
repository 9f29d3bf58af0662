"""One step's flat batch: every sequence's new tokens back to back, with the
attention metadata that every layer of the forward shares.

Built once per step on the host, checked (token ids in the vocabulary, block
ids in the pool, tables long enough) before any tensor reaches the device.
"""
import itertools
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Sequence

import torch

from pagedbackend.core.scheduled import SeqEntry
from pagedbackend.models.attention import AttentionMetadata

__all__ = ["SeqEntry", "StepBatch", "build_step_batch"]


@dataclass
class StepBatch:
    """One step's flat batch; ``logits_rows``: rows whose logits are returned
    (per entry in order, ``SeqEntry.num_logit_rows`` of its last rows).
    ``meta``: the attention metadata of KV group 0; ``groups``: every
    group's, ``meta`` first, when the model has several (else empty);
    ``lora``: the rows' adapters (``lora.punica.LoRAMapping``; None: none)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    groups: List[AttentionMetadata] = field(default_factory=list)
    lora: Optional[Any] = None

    def to(self, device: torch.device) -> "StepBatch":
        to = dict(device=device, non_blocking=True)
        # Every group's query layout and lengths are the same tensors: moved once.
        cu_seqlens_q, seq_lens = self.meta.cu_seqlens_q.to(**to), self.meta.seq_lens.to(**to)

        def moved(meta: AttentionMetadata) -> AttentionMetadata:
            return replace(meta, slot_mapping=meta.slot_mapping.to(**to), block_tables=meta.block_tables.to(**to),
                           cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
        groups = [moved(m) for m in self.groups]
        return StepBatch(self.input_ids.to(**to), self.positions.to(**to),
                         groups[0] if groups else moved(self.meta), self.logits_rows.to(**to), groups,
                         None if self.lora is None else self.lora.to(device))

    @property
    def metas(self) -> List[AttentionMetadata]:
        """The metadata of every KV group (one when the model has one group)."""
        return self.groups or [self.meta]


def build_step_batch(entries: Sequence[SeqEntry], block_size: int, max_model_len: int,
                     vocab_size: int, num_blocks: int, num_groups: int = 1) -> StepBatch:
    """The flat batch of ``entries`` as host tensors (attention plan not set),
    with the block tables and slots of each of ``num_groups`` KV groups."""
    if not entries:
        raise ValueError("execute_model needs at least one entry")
    bs = block_size
    input_ids: List[int] = []
    positions: List[int] = []
    q_lens, seq_lens = [], []
    tables: List[List[List[int]]] = [[] for _ in range(num_groups)]
    for i, entry in enumerate(entries):
        n = len(entry.token_ids)
        end = entry.start_pos + n
        if n == 0 or entry.start_pos < 0:
            raise ValueError(f"entry {i} needs at least one token and start_pos >= 0 "
                             f"(got {n} tokens at start_pos {entry.start_pos})")
        if end > max_model_len:
            raise ValueError(f"entry {i} reaches {end} positions, beyond max_model_len {max_model_len}")
        needed = -(-end // bs)
        group_tables = _group_tables(i, entry, num_groups)
        for table, rows in zip(group_tables, tables):
            if len(table) < needed:
                raise ValueError(f"entry {i}: block table has {len(table)} blocks, "
                                 f"{end} positions need {needed} (block_size {bs})")
            rows.append(table[:needed])
        input_ids.extend(entry.token_ids)
        positions.extend(range(entry.start_pos, end))
        q_lens.append(n)
        seq_lens.append(end)
    width = max(len(t) for t in tables[0])
    block_tables = [torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32) for rows in tables]
    ids = torch.tensor(input_ids, dtype=torch.long)
    for group_blocks in block_tables:
        _check_ranges(ids, group_blocks, vocab_size, num_blocks)

    pos = torch.tensor(positions, dtype=torch.long)
    seq_of_token = torch.repeat_interleave(torch.arange(len(entries)), torch.tensor(q_lens))
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    if any(e.prompt_logits or e.num_draft_tokens for e in entries):
        rows = []
        for e, end in zip(entries, cu_seqlens_q[1:].tolist()):
            rows += range(end - e.num_logit_rows, end)
        logits_rows = torch.tensor(rows, dtype=torch.long)
    else:
        logits_rows = (cu_seqlens_q[1:] - 1)[torch.tensor([e.need_logits for e in entries])]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    metas = [AttentionMetadata(slot_mapping=group_blocks[seq_of_token, pos // bs].long() * bs + pos % bs,
                               block_tables=group_blocks, cu_seqlens_q=cu_seqlens_q, seq_lens=lens)
             for group_blocks in block_tables]
    return StepBatch(ids, pos, metas[0], logits_rows.long(), metas if num_groups > 1 else [])


def _group_tables(i: int, entry: SeqEntry, num_groups: int) -> List[List[int]]:
    """The entry's block table of each KV group. One table may serve every
    group only for a prefill from position 0 whose K/V are never read again
    (a warm-up, a calibration pass): the groups' layers would overwrite each
    other's K/V in shared blocks."""
    if entry.block_tables is None or num_groups == 1:
        if num_groups > 1 and entry.start_pos > 0:
            raise ValueError(f"entry {i} reads cached positions but gives one block table for "
                             f"{num_groups} KV groups; give each group's (SeqEntry.block_tables)")
        return [entry.block_table] * num_groups
    if len(entry.block_tables) != num_groups:
        raise ValueError(f"entry {i} has block tables for {len(entry.block_tables)} KV groups, "
                         f"the model has {num_groups}")
    return entry.block_tables


def _check_ranges(ids: torch.Tensor, block_tables: torch.Tensor, vocab_size: int,
                  num_blocks: int) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        token = int(ids[bad.nonzero()[0, 0]])
        raise ValueError(f"token id {token} is outside the vocabulary (size {vocab_size})")
    if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks:
        raise ValueError(f"block table refers to a block outside 0..{num_blocks - 1}")
