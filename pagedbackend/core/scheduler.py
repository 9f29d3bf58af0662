"""Iteration-level (continuous) batching with first-come-first-served
preemption (PagedAttention, section 4.5).

Every step rebuilds the batch under one token budget and one sequence cap:

1. running groups that decode (one token per live sequence), oldest first;
   when blocks run out, the newest running group is preempted (all its
   sequences at once) until the older one fits;
2. running groups still prefilling take chunks of their prompt from the budget
   that is left, so long prompts never stall decodes;
3. swapped-out groups come back, oldest first, when nothing was preempted;
4. waiting groups are admitted in arrival order when nothing was preempted in
   this step (so a victim is not re-admitted at once).

Fairness, so that one request cannot hold up every newcomer:

- a prompt is computed at most ``long_prefill_token_threshold`` tokens per
  step, which bounds every step and leaves budget for newcomers;
- while other requests are present, one request's parallel samples decode at
  most half of ``max_num_seqs`` per step (the least advanced first; beams,
  which advance together, are exempt); it is admitted on those slots too;
- the oldest group that cannot be admitted or swapped back in (the blocker)
  does not stop younger groups that fit now, as long as the eventual needs
  (prompt plus ``max_tokens`` for every candidate) of every running group
  younger than the blocker, of the newcomer and of the blocker itself fit the
  pool and the sequence cap together. Older running groups finish and free
  their blocks, and younger ones can never hold what the blocker needs: it is
  admitted after the older ones are done, never starved.

A preempted group is either swapped to the host pool or, in recompute mode
(or when host space is short), stripped of its blocks and sent back to the
waiting queue in arrival order, to be prefilled again from its prompt and
generated tokens, reusing whatever prefix blocks are still cached.
"""
import bisect
import time
from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

from ..config import EngineConfig
from ..sampling_params import InvalidRequestError
from .block_manager import AllocStatus, BlockManager
from .kv_memory import reserved_positions
from .request_queue import RequestQueue
from .sequence import GroupStatus, Sequence, SequenceGroup

BlockMapping = List[Tuple[int, int]]
# Groups tried past a blocker in one step at most (each costs a prefix lookup).
PASS_SCAN = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: what the model runner computes for it.

    ``token_ids`` are the tokens whose K/V are computed now, starting at
    position ``start_pos``; ``block_table`` covers all of them;
    ``need_logits`` says the step completes the sequence (sample it)."""
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int            # computed this step, from seq.num_computed_tokens
    token_ids: List[int] = field(default_factory=list)
    start_pos: int = 0
    block_table: List[int] = field(default_factory=list)
    need_logits: bool = False
    prompt_logits: bool = False    # the logits of every token of the chunk (prompt_logprobs)


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


@dataclass
class StepUpdate:
    """What sampling decided for the sequences of one step, for
    ``Scheduler.update_from_output``: new sequences that share a parent's
    blocks (parallel samples, beams), sequences that are done (their blocks go
    back), groups that are finished, and sequences whose last token must be
    computed again next step (a beam held while its siblings are recomputed)."""
    forks: List[Tuple[Sequence, Sequence]] = field(default_factory=list)   # (parent, child)
    freed: List[Sequence] = field(default_factory=list)
    finished: List[SequenceGroup] = field(default_factory=list)
    held: Set[int] = field(default_factory=set)                           # seq ids


class Scheduler:
    """Owns the block manager: admission, the step's batch, preemption, and
    the blocks' fate after each step (``update_from_output``)."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 cache_salt: bytes = b""):
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {config.preemption_mode!r}")
        self.config = config
        self.max_model_len = max_model_len
        self.bm = BlockManager(num_kv_blocks, config.block_size, num_swap_blocks=config.swap_space_blocks,
                               enable_prefix_caching=config.enable_prefix_caching,
                               watermark=config.watermark, cache_salt=cache_salt)
        self.priority = config.scheduling_policy == "priority"
        self.waiting = RequestQueue(self.order_key)
        self.swapped = RequestQueue(self.order_key)
        self.running: List[SequenceGroup] = []   # kept in scheduling order (order_key)
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0

    @property
    def block_manager(self) -> BlockManager:
        """Read-only use outside the scheduler: statistics and tests."""
        return self.bm

    # ------------------------------------------------------------ admission
    def reserve_tokens(self, final_len: int) -> int:
        """Positions a contiguous-reservation baseline (``kv_reservation``)
        holds for a request from admission on; 0 when paged."""
        scheme = self.config.kv_reservation
        return 0 if scheme == "paged" else reserved_positions(scheme, final_len, self.max_model_len)

    @property
    def usable_blocks(self) -> int:
        return self.bm.num_total_blocks - self.bm.watermark_blocks

    def max_blocks(self, prompt_len: int, max_tokens: int, width: int) -> int:
        """KV blocks a request needs, alone in the pool, to finish: its prompt's
        blocks (shared by every candidate) plus each candidate's blocks for its
        output, one more each for a copied partial block."""
        bs = self.bm.block_size
        paged = _cdiv(prompt_len, bs) + width * (_cdiv(max_tokens, bs) + 1)
        return max(paged, _cdiv(self.reserve_tokens(prompt_len + max_tokens), bs))

    def max_tokens_that_fit(self, prompt_len: int, width: int, limit: int) -> int:
        """The most tokens (at most ``limit``) each of ``width`` candidates may
        generate after a ``prompt_len`` prompt with the whole request still
        fitting the pool alone: the default ``max_tokens`` of a request that
        sets none (0 when not even one token fits)."""
        low, high = 0, limit
        while low < high:   # max_blocks grows with max_tokens
            mid = (low + high + 1) // 2
            if self.max_blocks(prompt_len, mid, width) <= self.usable_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def admission_error(self, prompt_len: int, max_tokens: int, width: int) -> Optional[str]:
        """Why a request can never run, or None: the one admission check, used
        at submission (so nothing that cannot run is ever queued)."""
        if width > self.config.max_num_seqs:
            return (f"the request needs {width} sequences at once (n / best_of) but "
                    f"max_num_seqs is {self.config.max_num_seqs}")
        need = self.max_blocks(prompt_len, max_tokens, width)
        if need > self.usable_blocks:
            return (f"request needs up to {need} KV blocks (prompt {prompt_len} tokens, "
                    f"max_tokens {max_tokens}, {width} candidate(s), block size "
                    f"{self.bm.block_size}) but the pool offers {self.usable_blocks}")
        return None

    def check_admissible(self, group: SequenceGroup) -> None:
        message = self.admission_error(len(group.prompt_token_ids), group.max_tokens,
                                       self._max_live_seqs(group))
        if message is not None:
            raise InvalidRequestError(message)

    # ------------------------------------------------------------ queue changes
    def order_key(self, group: SequenceGroup) -> tuple:
        """Scheduling order: arrival (fcfs), or priority then arrival (priority)."""
        return (group.priority, group.arrival_time) if self.priority else (group.arrival_time,)

    def add(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.WAITING
        self.waiting.push(group)

    def _run(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.RUNNING
        bisect.insort(self.running, group, key=self.order_key)

    def remove(self, group: SequenceGroup) -> None:
        """Take a group out of whichever queue holds it and free all its blocks."""
        self.waiting.remove(group)
        self.swapped.remove(group)
        if group in self.running:
            self.running.remove(group)
        for seq in group.seqs:
            if self.bm.has_seq(seq.seq_id):
                self.bm.free(seq.seq_id)
        group.status = GroupStatus.FINISHED

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def idle_leaks(self) -> List[str]:
        """With no request in any queue, every block must be back in the pools
        (free, or free but still cached) and no sequence may hold a table;
        returns what is not so."""
        bm, leaks = self.bm, []
        queued = len(self.waiting) + len(self.running) + len(self.swapped)
        if queued:
            leaks.append(f"{queued} group(s) still queued")
        if bm.num_used_blocks:
            leaks.append(f"{bm.num_used_blocks} KV block(s) still in use")
        if bm.num_free_swap_blocks != bm.num_swap_blocks:
            leaks.append(f"{bm.num_swap_blocks - bm.num_free_swap_blocks} host block(s) still in use")
        if bm.num_seqs:
            leaks.append(f"{bm.num_seqs} sequence(s) still hold a block table")
        return leaks

    # ------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        seq_cap = self.config.max_num_seqs
        crowded = len(self.running) + len(self.waiting) + len(self.swapped) > 1

        # 1. decodes, oldest first, preempting the newest groups for blocks
        for group in list(self.running):
            if group.status != GroupStatus.RUNNING or self._is_prefilling(group):
                continue
            seqs = self._decode_seqs(group, crowded)
            if len(seqs) > budget or len(seqs) > seq_cap:
                continue
            if not self._make_room(group, seqs, out):
                continue  # the group itself was preempted
            for seq in seqs:
                out.copy_pairs += self.bm.append_slots(seq.seq_id, seq.num_tokens)
                out.scheduled.append(ScheduledSeq(group, seq, 1))
            budget -= len(seqs)
            seq_cap -= len(seqs)

        # 2. prefill chunks of running groups
        for group in self.running:
            if not self._is_prefilling(group) or budget == 0 or seq_cap < len(group.seqs):
                continue
            seq_cap -= len(group.seqs)
            budget = self._schedule_prefill(group, budget, out)

        # 3. swapped groups return, first in order first
        while self.swapped and not out.preempted:
            group = self.swapped.peek()
            live = group.seqs
            ids = [s.seq_id for s in live]
            if len(live) > budget or len(live) > seq_cap:
                break
            needed = self.bm.blocks_to_swap_in(ids) + len(live)
            if self.bm.num_free_blocks - needed < self.bm.watermark_blocks:
                break
            self.swapped.pop()
            out.swap_in_pairs += self.bm.swap_in(ids)
            self._run(group)
            if self._is_prefilling(group):
                seq_cap -= len(live)
                budget = self._schedule_prefill(group, budget, out)
                continue
            for seq in live:
                out.copy_pairs += self.bm.append_slots(seq.seq_id, seq.num_tokens)
                out.scheduled.append(ScheduledSeq(group, seq, 1))
            budget -= len(live)
            seq_cap -= len(live)

        # 4. admission of waiting groups, in order, past a blocker when it is safe
        if not out.preempted:
            budget = self._admit(out, budget, seq_cap)

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        now = time.time()
        for item in out.scheduled:   # what the model runner reads
            seq = item.seq
            if item.group.metrics.first_scheduled_time is None:
                item.group.metrics.first_scheduled_time = now
            item.start_pos = seq.num_computed_tokens
            item.token_ids = seq.token_ids[item.start_pos:item.start_pos + item.num_new_tokens]
            item.block_table = self.bm.get_block_table(seq.seq_id)
            item.need_logits = item.start_pos + item.num_new_tokens == seq.num_tokens
            item.prompt_logits = item.group.needs_prompt_logits and item.start_pos < seq.num_prompt_tokens
        return out

    def update_from_output(self, out: SchedulerOutput, update: StepUpdate) -> None:
        """After the forward pass and sampling: count the computed tokens (and
        register full blocks in the prefix cache), share blocks with forked
        sequences, return the blocks of finished ones, retire finished groups."""
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start_pos + item.num_new_tokens
            if seq.seq_id in update.held:
                seq.num_computed_tokens -= 1
            if self.bm.has_seq(seq.seq_id):
                self.bm.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        for parent, child in update.forks:
            self.bm.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
        for seq in update.freed:
            self.bm.free(seq.seq_id)
        for group in update.finished:
            group.status = GroupStatus.FINISHED
            if group in self.running:
                self.running.remove(group)

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _is_prefilling(group: SequenceGroup) -> bool:
        return any(s.num_uncomputed_tokens > 1 for s in group.seqs)

    def _admit(self, out: SchedulerOutput, budget: int, seq_cap: int) -> int:
        """Admit waiting groups in scheduling order while the step has budget.
        The first that cannot be admitted (or the first swapped-out group)
        becomes the blocker; at most PASS_SCAN later groups are tried past it,
        each under ``_may_pass``. Under the priority policy a group that does
        not fit preempts running groups of lower priority (higher value) first."""
        blocker = self.swapped.peek()
        passed, tried = [], 0
        while self.waiting and budget > 0 and tried <= PASS_SCAN:
            group = self.waiting.pop()
            if group in out.preempted:   # preempted in this very step: not back at once
                passed.append(group)
                continue
            token_lists = [s.token_ids for s in group.seqs]
            reserve = self.reserve_tokens(len(group.prompt_token_ids) + group.max_tokens)
            # A cached prefix has no logits: prompt_logprobs computes the whole prompt.
            reuse = not group.needs_prompt_logits
            status = self.bm.can_allocate(token_lists, reserve, group.cache_salt, reuse)
            if status == AllocStatus.NEVER:  # cannot happen after check_admissible; kept as a guard
                out.rejected.append((group, f"request {group.request_id} can never fit the KV pool"))
                continue
            if blocker is None and self.priority:
                while not (status == AllocStatus.OK and self._step_slots(group) <= seq_cap):
                    victim = self._lower_priority_victim(group)
                    if victim is None:
                        break
                    seq_cap += sum(1 for item in out.scheduled if item.group is victim)
                    budget += sum(item.num_new_tokens for item in out.scheduled if item.group is victim)
                    self._preempt(victim, out)
                    status = self.bm.can_allocate(token_lists, reserve, group.cache_salt, reuse)
            fits = status == AllocStatus.OK and self._step_slots(group) <= seq_cap
            if not fits or (blocker is not None and not self._may_pass(blocker, group)):
                blocker = blocker or group
                passed.append(group)
                tried += blocker is not group
                continue
            for seq in group.seqs:
                seq.num_computed_tokens = self.bm.allocate(seq.seq_id, seq.token_ids, reserve, group.cache_salt,
                                                           reuse)
            if group.metrics.num_cached_prompt_tokens == 0:
                group.metrics.num_cached_prompt_tokens = group.seqs[0].num_computed_tokens
            self._run(group)
            seq_cap -= self._step_slots(group)
            budget = self._schedule_prefill(group, budget, out)
        for group in passed:
            self.waiting.push(group)
        return budget

    def _lower_priority_victim(self, group: SequenceGroup) -> Optional[SequenceGroup]:
        """The running group last in order whose priority is lower than ``group``'s."""
        if self.running and self.running[-1].priority > group.priority:
            return self.running[-1]
        return None

    @staticmethod
    def _max_live_seqs(group: SequenceGroup) -> int:
        return len(group.seqs) if group.forked else group.params.best_of

    @property
    def _share(self) -> int:
        """Sequences one request may decode per step while others are present."""
        return max(1, self.config.max_num_seqs // 2)

    def _step_slots(self, group: SequenceGroup) -> int:
        """Sequence slots a group takes per step when others share the steps."""
        width = self._max_live_seqs(group)
        return width if group.is_beam_search else min(width, self._share)

    def _decode_seqs(self, group: SequenceGroup, crowded: bool) -> List[Sequence]:
        """The group's sequences that decode this step: all of them, or while
        others are present at most ``_share`` of its parallel samples, the least
        advanced first (so they take turns)."""
        live = group.seqs
        if not crowded or group.is_beam_search or len(live) <= self._share:
            return live
        return sorted(live, key=lambda s: (s.num_tokens, s.index))[:self._share]

    def _eventual_blocks(self, group: SequenceGroup) -> int:
        return self.max_blocks(len(group.prompt_token_ids), group.max_tokens, group.params.best_of)

    def _may_pass(self, blocker: SequenceGroup, group: SequenceGroup) -> bool:
        """Whether ``group`` may be admitted before the older ``blocker``: the
        eventual needs of the running groups younger than the blocker, of
        ``group`` and of the blocker fit the pool and the sequence cap at once."""
        after = self.order_key(blocker)
        younger = [g for g in self.running if self.order_key(g) > after]
        blocks = sum(self._eventual_blocks(g) for g in younger + [group, blocker])
        slots = sum(self._step_slots(g) for g in younger + [group, blocker])
        return blocks <= self.usable_blocks and slots <= self.config.max_num_seqs

    def _schedule_prefill(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int:
        """Chunks for a group's sequences, each at most
        ``long_prefill_token_threshold`` tokens; blocks for their prompts were
        taken at admission, but a sequence that finished its prefill early may
        need one more block for its next token."""
        cap = self.config.long_prefill_token_threshold or budget
        for seq in group.seqs:
            chunk = min(seq.num_uncomputed_tokens, budget, cap)
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

    def _make_room(self, group: SequenceGroup, seqs: List[Sequence], out: SchedulerOutput) -> bool:
        """Preempt the newest running groups until ``seqs`` of ``group`` can grow
        by one token each. False if ``group`` itself had to go."""
        while True:
            needed = sum(self.bm.blocks_to_append(s.seq_id, s.num_tokens) for s in seqs)
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
            self.swapped.push(group)
            self.num_swap_preemptions += 1
            return
        for seq in group.seqs:
            self.bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
        group.status = GroupStatus.WAITING
        self.waiting.push(group)
        self.num_recompute_preemptions += 1
