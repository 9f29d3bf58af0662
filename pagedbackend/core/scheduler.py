"""Iteration-level (continuous) batching with first-come-first-served preemption (PagedAttention,
section 4.5), in one loop under one token budget.

Every sequence's ``num_computed_tokens`` chases its token count: a step gives each scheduled
sequence the tokens it has not computed yet (a decode: one; a prompt: a chunk of it), plus, for a
decode, slots for the speculative tokens the engine will propose (``lookahead``). The same code
schedules running groups (decoding groups first, so a burst of prompts never delays a token of a
running stream), swapped-out groups coming back, and newly admitted ones:

- running groups, in scheduling order; when blocks run out, the newest running group is preempted
  (all its sequences at once) until the older one fits (first giving up its speculative slots);
- swapped-out groups come back, first in order first, when nothing was preempted in this step;
- waiting groups are admitted in order when nothing was preempted (a victim is not re-admitted at once).

Fairness, so that one request cannot hold up every newcomer:

- a prompt is computed at most ``long_prefill_token_threshold`` tokens per step, which bounds every
  step and leaves budget for newcomers;
- an encoder's input (``SequenceGroup.whole_prompt``) is never chunked, nor is an image whose tokens
  attend to each other (``whole_spans``, Gemma 3): it waits for a step with room for all of it;
- while other requests are present, one request's parallel samples decode at most half of
  ``max_num_seqs`` per step (the least advanced first; beams, which advance together, are exempt);
  it is admitted on those slots too;
- the oldest group that cannot be admitted or swapped back in (the blocker) does not stop younger
  groups that fit now, as long as the eventual needs (prompt plus ``max_tokens`` for every
  candidate) of every running group younger than the blocker, of the newcomer and of the blocker
  itself fit the pool and the sequence cap together. Older running groups finish and free their
  blocks, and younger ones can never hold what the blocker needs: it is admitted after the older
  ones are done, never starved.

A preempted group is either swapped to the host pool or, in recompute mode (or when host space is
short), stripped of its blocks and sent back to the waiting queue in arrival order, to be prefilled
again from its prompt and generated tokens, reusing whatever prefix blocks are still cached (or on
disk).
"""
import bisect
import time
from typing import Dict, List, Optional

from ..config import EngineConfig
from ..sampling_params import InvalidRequestError
from .block_manager import AllocStatus, BlockManager
from .capacity import Capacity
from .group_alloc import allocate_group
from .prefill_share import MIN_CHUNK
from .request_queue import RequestQueue
from .scheduled import ScheduledSeq, SchedulerInputs, SchedulerOutput, StepUpdate
from .encoder_budget import encoder_cut
from .whole_spans import chunk_outside_spans, whole_span_error
from .sequence import GroupStatus, Sequence, SequenceGroup

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerInputs", "SchedulerOutput", "StepUpdate"]

# Groups tried past a blocker in one step at most (each costs a prefix lookup).
PASS_SCAN = 16


class _Room:
    """What is left of one step: tokens under the budget, sequence slots."""

    def __init__(self, tokens: int, seqs: int, encoder: int = 0):
        self.tokens, self.seqs, self.encoder, self.encoder_budget = tokens, seqs, encoder, encoder


class Scheduler:
    """Owns the block manager: admission, the step's batch, preemption, and
    the blocks' fate after each step (``update_from_output``)."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 cache_salt: bytes = b"", kv_windows: Optional[List[Optional[int]]] = None,
                 inputs: SchedulerInputs = SchedulerInputs()):
        """``kv_windows``: each KV group's sliding window (None: full
        attention; default one group of full attention); ``inputs``: what the
        engine's features decide for each step (``SchedulerInputs``)."""
        self.config = config
        self.max_model_len = max_model_len
        self.bm = BlockManager(num_kv_blocks, config.block_size, num_swap_blocks=config.swap_space_blocks,
                               enable_prefix_caching=config.enable_prefix_caching,
                               watermark=config.watermark, cache_salt=cache_salt, windows=kv_windows or [None],
                               step_tokens=config.max_num_batched_tokens)
        self.capacity = Capacity(config, self.bm, max_model_len)
        self.priority = config.scheduling_policy == "priority"
        self.waiting = RequestQueue(self.order_key)
        self.swapped = RequestQueue(self.order_key)
        self.running: List[SequenceGroup] = []   # kept in scheduling order (order_key)
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.inputs = inputs
        # This step's answers of ``inputs`` (read by prefill_share.caps_for too).
        self.num_lookahead = 0
        self.prefill_caps: Optional[Dict[int, int]] = None

    @property
    def block_manager(self) -> BlockManager:
        """Read-only use outside the scheduler: statistics and tests."""
        return self.bm

    def check_admissible(self, group: SequenceGroup) -> None:
        message = self.capacity.admission_error(len(group.prompt_token_ids), group.max_tokens,
                                                self.capacity.max_live_seqs(group))
        message = message or whole_span_error(group.whole_spans, self.config.max_num_batched_tokens)
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

    def free_seq(self, seq: Sequence) -> None:
        """Free the blocks of one sequence that ended outside a step (a stop string)."""
        if self.bm.has_seq(seq.seq_id):
            self.bm.free(seq.seq_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def idle_leaks(self) -> List[str]:
        """With no request in any queue, every block must be back in the pools
        (free, or free but still cached) and no sequence may hold a table;
        returns what is not so."""
        bm, leaks = self.bm, []
        if queued := len(self.waiting) + len(self.running) + len(self.swapped):
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
        inputs = self.inputs
        if inputs.lookahead is not None:
            self.num_lookahead = inputs.lookahead(sum(len(g.seqs) for g in self.running))
        if inputs.prefill_caps is not None:
            self.prefill_caps = inputs.prefill_caps(self)
        out = SchedulerOutput()
        room = _Room(self.config.max_num_batched_tokens, self.config.max_num_seqs,
                     self.config.max_num_encoder_input_tokens or self.config.max_num_batched_tokens)
        crowded = len(self.running) + len(self.waiting) + len(self.swapped) > 1
        for group in sorted(self.running, key=self._is_prefilling):   # stable: decodes first, in order
            if group.status == GroupStatus.RUNNING:   # not preempted earlier in this loop
                self._schedule_group(group, room, out, crowded)
        while self.swapped and not out.preempted:
            group = self.swapped.peek()
            ids = [s.seq_id for s in group.seqs]
            needed = self.bm.blocks_to_swap_in(ids) + len(ids)
            if len(ids) > min(room.tokens, room.seqs) or self.bm.num_free_blocks - needed < self.bm.watermark_blocks \
                    or not self._adapter_fits(group):
                break
            self.swapped.pop()
            out.swap_in_pairs += self.bm.swap_in(ids)
            self._run(group)
            self._schedule_group(group, room, out, crowded)
        if not out.preempted:
            self._admit(out, room, crowded)
        out.num_batched_tokens = self.config.max_num_batched_tokens - room.tokens
        out.tier_saves, out.tier_loads = self.bm.take_tier_moves()   # the disk tier's (tier_moves)
        now = time.time()
        for item in out.scheduled:   # what the model runner reads
            seq = item.seq
            if item.group.metrics.first_scheduled_time is None:
                item.group.metrics.first_scheduled_time = now
            item.start_pos = seq.num_computed_tokens
            item.token_ids = seq.token_ids[item.start_pos:item.start_pos + item.num_new_tokens]
            item.block_table = self.bm.get_block_table(seq.seq_id)
            if self.bm.num_groups > 1:
                item.block_tables = self.bm.get_block_tables(seq.seq_id)
            # A pooling request samples nothing: it takes its rows' hidden states.
            item.return_hidden = item.group.pooling is not None
            item.token_type_start = item.group.token_type_start
            item.mm_items = tuple(item.group.mm_items)   # image rows; M-RoPE positions (decodes too)
            item.need_logits = item.start_pos + item.num_new_tokens == seq.num_tokens and not item.return_hidden
            item.prompt_logits = item.group.needs_prompt_logits and item.start_pos < seq.num_prompt_tokens
        return out

    def update_from_output(self, out: SchedulerOutput, update: StepUpdate) -> None:
        """After the forward pass and sampling: count the computed tokens (and
        register full blocks in the prefix cache), give back the slots of
        speculative tokens that were not kept, share blocks with forked
        sequences, return the blocks of finished ones, retire finished groups."""
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = (item.start_pos + item.num_new_tokens + item.num_draft_tokens
                                       - update.uncomputed.get(seq.seq_id, 0))
            if self.bm.has_seq(seq.seq_id):
                if item.num_lookahead:
                    self.bm.truncate(seq.seq_id, seq.num_computed_tokens)
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

    # ------------------------------------------------------------ one group
    @staticmethod
    def _is_prefilling(group: SequenceGroup) -> bool:
        return any(s.num_uncomputed_tokens > 1 for s in group.seqs)

    def _schedule_group(self, group: SequenceGroup, room: _Room, out: SchedulerOutput,
                        crowded: bool) -> None:
        """Schedule a running group's sequences: the tokens each has not
        computed (a prompt at most ``long_prefill_token_threshold`` at a time),
        speculative slots for decodes, blocks for all of them (preempting the
        newest groups when the pool is short)."""
        prefilling = self._is_prefilling(group)
        seqs = group.seqs if prefilling else self._decode_seqs(group, crowded)
        if not seqs or len(seqs) > room.seqs or room.tokens < (1 if prefilling else len(seqs)):
            return
        cap = self.config.long_prefill_token_threshold or room.tokens
        caps = self.prefill_caps
        tokens, plan = room.tokens, []
        for seq in seqs:
            chunk = min(seq.num_uncomputed_tokens, tokens, cap if caps is None else caps.get(seq.seq_id, MIN_CHUNK))
            spans = [(seq.num_computed_tokens, seq.num_tokens)] if group.whole_prompt else group.whole_spans
            chunk = chunk_outside_spans(seq.num_computed_tokens, chunk, spans, tokens)
            if chunk == 0 and spans:
                return   # computed whole (an encoder's prompt, a Gemma 3 image): it waits for room
            if group.mm_items and chunk > 0:   # images the chunk starts: within the encoder's budget
                chunk, used = encoder_cut(group.mm_items, seq.num_computed_tokens, chunk, room.encoder,
                                          room.encoder == room.encoder_budget)
                room.encoder -= used
            if chunk > 0:
                plan.append([seq, chunk, 0])
                tokens -= chunk
        if not prefilling:
            look = self._lookahead(group, len(plan), tokens)
            for entry in plan:   # never past the context, nor past the request's last token
                seq = entry[0]
                entry[2] = 0 if seq.num_output_tokens == 0 else max(0, min(
                    look, self.max_model_len - seq.num_tokens, group.max_tokens - seq.num_output_tokens - 1))
        if not self._make_room(group, plan, out):
            return   # the group itself was preempted
        for seq, chunk, look in plan:
            step_end = seq.num_computed_tokens + chunk + look
            target = max(step_end, self.bm.num_tokens(seq.seq_id))
            out.copy_pairs += self.bm.append_slots(seq.seq_id, target, step_end)
            out.scheduled.append(ScheduledSeq([], 0, [], group=group, seq=seq, num_new_tokens=chunk,
                                              num_lookahead=look))
            room.tokens -= chunk + look
        room.seqs -= len(seqs)

    def _lookahead(self, group: SequenceGroup, num_seqs: int, tokens_left: int) -> int:
        """Speculative slots per decoding sequence of ``group`` this step."""
        if (not self.num_lookahead or not num_seqs or group.is_beam_search or group.needs_prompt_logits
                or self.config.kv_reservation != "paged"):
            return 0
        return max(0, min(self.num_lookahead, tokens_left // num_seqs))

    def _blocks_for(self, plan) -> int:
        return sum(self.bm.blocks_to_append(seq.seq_id, max(seq.num_computed_tokens + chunk + look,
                                                            self.bm.num_tokens(seq.seq_id)),
                                            seq.num_computed_tokens + chunk + look)
                   for seq, chunk, look in plan)

    def _make_room(self, group: SequenceGroup, plan, out: SchedulerOutput) -> bool:
        """Free blocks for ``plan`` (lists of sequence, tokens, lookahead): first
        drop its speculative slots, then preempt the newest running groups.
        False if ``group`` itself had to go."""
        if self._blocks_for(plan) > self.bm.num_free_blocks:
            for entry in plan:
                entry[2] = 0
        while self._blocks_for(plan) > self.bm.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is group:
                return False
        return True

    def _decode_seqs(self, group: SequenceGroup, crowded: bool) -> List[Sequence]:
        """The group's sequences that decode this step: all of them, or while
        others are present at most ``share`` of its parallel samples, the least
        advanced first (so they take turns)."""
        live, share = group.seqs, self.capacity.share
        if not crowded or group.is_beam_search or len(live) <= share:
            return live
        return sorted(live, key=lambda s: (s.num_tokens, s.index))[:share]

    # ------------------------------------------------------------ admission
    def _admit(self, out: SchedulerOutput, room: _Room, crowded: bool) -> None:
        """Admit waiting groups in scheduling order while the step has budget.
        The first that cannot be admitted (or the first swapped-out group)
        becomes the blocker; at most PASS_SCAN later groups are tried past it,
        each under ``_may_pass``. Under the priority policy a group that does
        not fit preempts running groups of lower priority (higher value) first."""
        blocker = self.swapped.peek()
        passed, tried = [], 0
        while self.waiting and room.tokens > 0 and tried <= PASS_SCAN:
            group = self.waiting.pop()
            if group in out.preempted:   # preempted in this very step: not back at once
                passed.append(group)
                continue
            token_lists = [s.token_ids for s in group.seqs]
            reserve = self.capacity.reserve_tokens(len(group.prompt_token_ids) + group.max_tokens)
            # A cached prefix has no logits or hidden states (SequenceGroup.reuses_cached_prefix).
            reuse = group.reuses_cached_prefix
            status = self.bm.can_allocate(token_lists, reserve, group.cache_salt, reuse, group.block_keys)
            if status == AllocStatus.NEVER:  # cannot happen after check_admissible; kept as a guard
                out.rejected.append((group, f"request {group.request_id} can never fit the KV pool"))
                continue
            if blocker is None and self.priority:
                status = self._preempt_for(group, token_lists, reserve, reuse, status, room, out)
            fits = (status == AllocStatus.OK and self.capacity.step_slots(group) <= room.seqs
                    and self._adapter_fits(group))
            if not fits or (blocker is not None and not self._may_pass(blocker, group)):
                blocker = blocker or group
                passed.append(group)
                tried += blocker is not group
                continue
            computed = allocate_group(self.bm, [s.seq_id for s in group.seqs], token_lists, reserve,
                                      group.cache_salt, reuse, group.block_keys)
            if computed is None:   # a sibling's new blocks evicted a prefix block counted on (group_alloc)
                blocker = blocker or group
                passed.append(group)
                continue
            for seq, cached in zip(group.seqs, computed):
                seq.num_computed_tokens = cached
            if group.metrics.num_cached_prompt_tokens == 0:
                group.metrics.num_cached_prompt_tokens = group.seqs[0].num_computed_tokens
            self._run(group)
            self._schedule_group(group, room, out, crowded)
        for group in passed:
            self.waiting.push(group)

    def _adapter_fits(self, group: SequenceGroup) -> bool:
        return self.inputs.adapter_room is None or self.inputs.adapter_room(group, self.running)

    def _preempt_for(self, group, token_lists, reserve, reuse, status, room: _Room,
                     out: SchedulerOutput) -> AllocStatus:
        """Under the priority policy: preempt running groups of lower priority
        until ``group`` fits; returns its allocation status then."""
        while not (status == AllocStatus.OK and self.capacity.step_slots(group) <= room.seqs):
            if not (self.running and self.running[-1].priority > group.priority):
                break
            victim = self.running[-1]
            mine = [item for item in out.scheduled if item.group is victim]
            room.seqs += len(mine)
            room.tokens += sum(item.num_new_tokens + item.num_lookahead for item in mine)
            self._preempt(victim, out)
            status = self.bm.can_allocate(token_lists, reserve, group.cache_salt, reuse, group.block_keys)
        return status

    def _may_pass(self, blocker: SequenceGroup, group: SequenceGroup) -> bool:
        """Whether ``group`` may be admitted before the older ``blocker``: the
        eventual needs of the running groups younger than the blocker, of
        ``group`` and of the blocker fit the pool and the sequence cap at once."""
        after = self.order_key(blocker)
        groups = [g for g in self.running if self.order_key(g) > after] + [group, blocker]
        blocks = sum(self.capacity.eventual_blocks(g) for g in groups)
        slots = sum(self.capacity.step_slots(g) for g in groups)
        return blocks <= self.capacity.usable_blocks and slots <= self.config.max_num_seqs

    # ------------------------------------------------------------ preemption
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
