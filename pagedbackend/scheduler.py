"""Iteration-level (continuous) batching with first-come-first-served
preemption (PagedAttention, section 4.5).

Every step rebuilds the batch under one token budget and one sequence cap:

1. running groups that decode (one token per live sequence), oldest first;
   when blocks run out, the newest running group is preempted (all its
   sequences at once) until the older one fits;
2. running groups still prefilling take chunks of their prompt from the budget
   that is left, so long prompts never stall decodes;
3. swapped-out groups come back, oldest first, when nothing was preempted;
4. waiting groups are admitted in arrival order (head-of-line: the first that
   does not fit stops admission), only when no group is swapped out and no
   group was preempted in this step (so a victim is not re-admitted at once).

A preempted group is either swapped to the host pool or, in recompute mode
(or when host space is short), stripped of its blocks and sent back to the
waiting queue in arrival order, to be prefilled again from its prompt and
generated tokens, reusing whatever prefix blocks are still cached.
"""
import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Tuple

from .block_manager import AllocStatus, BlockManager
from .config import EngineConfig
from .sequence import GroupStatus, Sequence, SequenceGroup

BlockMapping = List[Tuple[int, int]]


@dataclass
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int            # computed this step, from seq.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this step every token of the sequence is computed: sample it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: List[ScheduledSeq] = field(default_factory=list)
    copy_pairs: BlockMapping = field(default_factory=list)
    swap_out_pairs: BlockMapping = field(default_factory=list)
    swap_in_pairs: BlockMapping = field(default_factory=list)
    preempted: List[SequenceGroup] = field(default_factory=list)
    rejected: List[Tuple[SequenceGroup, str]] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {config.preemption_mode!r}")
        self.config = config
        self.bm = block_manager
        self.waiting: List[SequenceGroup] = []   # kept in arrival order
        self.running: List[SequenceGroup] = []   # kept in arrival order
        self.swapped: Deque[SequenceGroup] = deque()
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0

    # ------------------------------------------------------------ queue changes
    def add(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.WAITING
        self._insert_by_arrival(self.waiting, group)

    @staticmethod
    def _insert_by_arrival(queue: List[SequenceGroup], group: SequenceGroup) -> None:
        keys = [g.arrival_time for g in queue]
        queue.insert(bisect.bisect_right(keys, group.arrival_time), group)

    def remove(self, group: SequenceGroup) -> None:
        """Take a group out of whichever queue holds it and free all its blocks."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        for seq in group.seqs:
            if self.bm.has_seq(seq.seq_id):
                self.bm.free(seq.seq_id)
        group.status = GroupStatus.FINISHED

    def free_seq(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        seq_cap = self.config.max_num_seqs

        # 1. decodes, oldest first, preempting the newest groups for blocks
        for group in list(self.running):
            if group.status != GroupStatus.RUNNING or self._is_prefilling(group):
                continue
            live = group.seqs
            if len(live) > budget or len(live) > seq_cap:
                continue
            if not self._make_room(group, out):
                continue  # the group itself was preempted
            for seq in live:
                out.copy_pairs += self.bm.append_slots(seq.seq_id, seq.num_tokens)
                out.scheduled.append(ScheduledSeq(group, seq, 1))
            budget -= len(live)
            seq_cap -= len(live)

        # 2. prefill chunks of running groups
        for group in self.running:
            if not self._is_prefilling(group) or budget == 0 or seq_cap < len(group.seqs):
                continue
            seq_cap -= len(group.seqs)
            budget = self._schedule_prefill(group, budget, out)

        # 3. swapped groups return, oldest first
        while self.swapped and not out.preempted:
            group = self.swapped[0]
            live = group.seqs
            ids = [s.seq_id for s in live]
            if len(live) > budget or len(live) > seq_cap:
                break
            needed = self.bm.blocks_to_swap_in(ids) + len(live)
            if self.bm.num_free_blocks - needed < self.bm.watermark_blocks:
                break
            self.swapped.popleft()
            out.swap_in_pairs += self.bm.swap_in(ids)
            group.status = GroupStatus.RUNNING
            self._insert_by_arrival(self.running, group)
            if self._is_prefilling(group):
                seq_cap -= len(live)
                budget = self._schedule_prefill(group, budget, out)
                continue
            for seq in live:
                out.copy_pairs += self.bm.append_slots(seq.seq_id, seq.num_tokens)
                out.scheduled.append(ScheduledSeq(group, seq, 1))
            budget -= len(live)
            seq_cap -= len(live)

        # 4. admission of waiting groups, in arrival order
        while self.waiting and not self.swapped and not out.preempted and budget > 0:
            group = self.waiting[0]
            if self._max_live_seqs(group) > seq_cap:
                break
            token_lists = [s.token_ids for s in group.seqs]
            status = self.bm.can_allocate(token_lists, group.reserve_tokens)
            if status == AllocStatus.NEVER:
                self.waiting.pop(0)
                out.rejected.append((group, self._never_fits_message(group)))
                continue
            if status == AllocStatus.LATER:
                break
            self.waiting.pop(0)
            for seq in group.seqs:
                seq.num_computed_tokens = self.bm.allocate(seq.seq_id, seq.token_ids, group.reserve_tokens)
            group.status = GroupStatus.RUNNING
            self._insert_by_arrival(self.running, group)
            seq_cap -= self._max_live_seqs(group)
            budget = self._schedule_prefill(group, budget, out)

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _is_prefilling(group: SequenceGroup) -> bool:
        return any(s.num_uncomputed_tokens > 1 for s in group.seqs)

    @staticmethod
    def _max_live_seqs(group: SequenceGroup) -> int:
        return len(group.seqs) if group.forked else group.params.best_of

    def _schedule_prefill(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int:
        """Chunks for a group's sequences; blocks for their prompts were taken at
        admission, but a sequence that finished its prefill early may need one
        more block for its next token."""
        for seq in group.seqs:
            chunk = min(seq.num_uncomputed_tokens, budget)
            if chunk <= 0:
                continue
            needed = self.bm.blocks_to_append(seq.seq_id, seq.num_tokens)
            if needed > self.bm.num_free_blocks:
                continue
            if needed:
                out.copy_pairs += self.bm.append_slots(seq.seq_id, seq.num_tokens)
            out.scheduled.append(ScheduledSeq(group, seq, chunk))
            budget -= chunk
        return budget

    def _make_room(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Preempt the newest running groups until ``group`` can grow by one token
        per sequence. False if ``group`` itself had to go."""
        while True:
            needed = sum(self.bm.blocks_to_append(s.seq_id, s.num_tokens) for s in group.seqs)
            if needed <= self.bm.num_free_blocks:
                return True
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is group:
                return False

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.running.remove(group)
        out.preempted.append(group)
        group.num_preemptions += 1
        ids = [s.seq_id for s in group.seqs]
        # Anything this group already put into this step's batch is withdrawn.
        out.scheduled = [s for s in out.scheduled if s.group is not group]
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(ids):
            out.swap_out_pairs += self.bm.swap_out(ids)
            group.status = GroupStatus.SWAPPED
            self.swapped.append(group)
            self.swapped = deque(sorted(self.swapped, key=lambda g: g.arrival_time))
            self.num_swap_preemptions += 1
            return
        for seq in group.seqs:
            self.bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
        group.status = GroupStatus.WAITING
        self._insert_by_arrival(self.waiting, group)
        self.num_recompute_preemptions += 1

    def _never_fits_message(self, group: SequenceGroup) -> str:
        need = sum(-(-s.num_tokens // self.bm.block_size) for s in group.seqs)
        return (f"request {group.request_id} needs {need} KV blocks for its tokens but the pool "
                f"has {self.bm.num_total_blocks} (block size {self.bm.block_size})")
