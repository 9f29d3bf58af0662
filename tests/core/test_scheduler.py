"""The scheduler on its own, with no model: what each step schedules under the
token budget and the sequence cap, preemption order, and the fairness rules
(prefill chunks, wide requests, passing a blocked group without starving it).
A step's "model" appends token 7 to every sequence that completes."""
import itertools

import pytest

from pagedbackend.config import EngineConfig
from pagedbackend.core.scheduler import Scheduler, SchedulerInputs, StepUpdate
from pagedbackend.core.sequence import GroupStatus, SequenceGroup
from pagedbackend.sampling_params import SamplingParams

_clock = itertools.count(1)


def make_scheduler(num_blocks=64, block_size=16, inputs=SchedulerInputs(), **config) -> Scheduler:
    settings = dict(block_size=block_size, max_num_seqs=16, max_num_batched_tokens=512,
                    long_prefill_token_threshold=128, enable_prefix_caching=False, watermark=0.0)
    return Scheduler(EngineConfig(**{**settings, **config}), num_blocks, max_model_len=4096, inputs=inputs)


def make_group(name, prompt_len, max_tokens, n=1, beams=False, temperature=1.0) -> SequenceGroup:
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0 if beams else temperature,
                            use_beam_search=beams, ignore_eos=True)
    prompt = [(hash(name) + i) % 1000 for i in range(prompt_len)]
    return SequenceGroup(name, None, prompt, params, float(next(_clock)), max_tokens)


def step(scheduler: Scheduler):
    """One step: schedule, then the engine's part (sample, fork, finish)."""
    out = scheduler.schedule()
    update = StepUpdate()
    for item in out.scheduled:
        if not item.need_logits:
            continue
        group, seq = item.group, item.seq
        if not group.forked and group.params.best_of > 1:
            children = [seq.fork(i) for i in range(1, group.params.best_of)]
            update.forks += [(seq, child) for child in children]
            group.seqs += children
            group.forked = True
            new = [seq] + children
        else:
            new = [seq]
        for s in new:
            s.append_token(7, None, None)
            if s.num_output_tokens >= group.max_tokens:
                s.finish_reason = "length"
                update.freed.append(s)
                group.seqs.remove(s)
                group.finished_seqs.append(s)
        if not group.seqs and group not in update.finished:
            update.finished.append(group)
    scheduler.update_from_output(out, update)
    return out


def tokens_of(out, group) -> int:
    return sum(item.num_new_tokens for item in out.scheduled if item.group is group)


def seqs_of(out, group) -> int:
    return sum(1 for item in out.scheduled if item.group is group)


def test_every_step_keeps_to_the_token_budget_and_the_sequence_cap():
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=6, max_num_batched_tokens=300)
    for i in range(10):
        scheduler.add(make_group(f"r{i}", 40 + 37 * i, 20))
    for _ in range(200):
        if not scheduler.has_unfinished:
            break
        out = step(scheduler)
        assert out.num_batched_tokens == sum(item.num_new_tokens for item in out.scheduled) <= 300
        assert len(out.scheduled) <= 6
    assert not scheduler.has_unfinished and scheduler.block_manager.num_used_blocks == 0


def test_a_long_prompt_is_computed_in_chunks_of_the_threshold_and_a_newcomer_starts_at_once():
    scheduler = make_scheduler(num_blocks=400, max_num_batched_tokens=512, long_prefill_token_threshold=128)
    long = make_group("long", 2000, 4)
    scheduler.add(long)
    first = step(scheduler)
    assert tokens_of(first, long) == 128
    canary = make_group("canary", 10, 2)
    scheduler.add(canary)
    second = step(scheduler)
    assert tokens_of(second, long) == 128 and tokens_of(second, canary) == 10   # its whole prompt, at once
    assert canary.seqs[0].num_output_tokens == 1


def test_without_a_threshold_a_prompt_takes_the_whole_budget():
    scheduler = make_scheduler(num_blocks=400, max_num_batched_tokens=512, long_prefill_token_threshold=0)
    long = make_group("long", 2000, 4)
    scheduler.add(long)
    assert tokens_of(step(scheduler), long) == 512


def test_a_wide_request_decodes_at_most_half_the_slots_while_others_wait_and_all_while_alone():
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=8)
    wide = make_group("wide", 8, 40, n=8)
    scheduler.add(wide)
    step(scheduler)                               # prefill, then 8 samples
    assert seqs_of(step(scheduler), wide) == 8    # alone: every sample decodes
    canary = make_group("canary", 8, 3)
    scheduler.add(canary)
    out = step(scheduler)
    assert seqs_of(out, canary) == 1 and seqs_of(out, wide) == 4
    # the samples take turns: the four that waited decode next
    advanced = sorted(s.num_output_tokens for s in wide.seqs)
    assert advanced[:4] == [2] * 4 and advanced[4:] == [3] * 4
    assert seqs_of(step(scheduler), wide) == 4
    while canary.status != GroupStatus.FINISHED:
        step(scheduler)
    assert seqs_of(step(scheduler), wide) == 8    # alone again


def test_a_wide_request_is_admitted_on_half_the_slots_beside_a_running_one():
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=8)
    first = make_group("first", 8, 40, n=6)
    scheduler.add(first)
    step(scheduler)
    step(scheduler)
    second = make_group("second", 8, 40, n=8)
    scheduler.add(second)
    out = step(scheduler)
    assert second.status == GroupStatus.RUNNING and tokens_of(out, second) == 8


def test_beams_advance_together_even_when_others_are_present():
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=8)
    beams = make_group("beams", 8, 40, n=2, beams=True)
    beams.params.best_of = 6
    scheduler.add(beams)
    step(scheduler)
    scheduler.add(make_group("canary", 8, 3))
    assert seqs_of(step(scheduler), beams) == 6


def fill_with_running(scheduler, count, prompt_len, max_tokens):
    groups = [make_group(f"old{i}", prompt_len, max_tokens) for i in range(count)]
    for group in groups:
        scheduler.add(group)
    while any(g.status == GroupStatus.WAITING for g in groups):
        step(scheduler)
    return groups


def test_a_small_request_passes_a_group_that_does_not_fit_and_the_blocked_group_is_not_starved():
    # 64 blocks of 16. Four running groups of 8 blocks each (prompt 120, 8 more tokens).
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=16)
    old = fill_with_running(scheduler, 4, 120, 8)
    big = make_group("big", 16 * 40, 8)          # needs 41 blocks: more than the 32 free, fewer than 64
    scheduler.add(big)
    canary = make_group("canary", 10, 2)
    scheduler.add(canary)
    step(scheduler)
    assert big.status == GroupStatus.WAITING and canary.status == GroupStatus.RUNNING
    # A stream of small requests cannot hold the big one off: it starts once the old ones finish.
    steps = 0
    while big.status == GroupStatus.WAITING:
        scheduler.add(make_group(f"small{steps}", 10, 2))
        step(scheduler)
        steps += 1
        assert steps < 40, "the blocked group was starved"
    assert all(g.status == GroupStatus.FINISHED for g in old)


def test_a_newcomer_whose_need_would_crowd_out_the_blocked_group_waits_behind_it():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=16)
    fill_with_running(scheduler, 4, 120, 8)
    big = make_group("big", 16 * 40, 8)          # eventual need 42 blocks
    scheduler.add(big)
    middle = make_group("middle", 16 * 24, 8)    # fits the 32 free blocks now, but 26 + 42 > 64
    scheduler.add(middle)
    step(scheduler)
    assert big.status == GroupStatus.WAITING and middle.status == GroupStatus.WAITING


def test_blocks_run_out_and_the_newest_group_is_preempted_first():
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=8, preemption_mode="recompute")
    groups = [make_group(f"g{i}", 12, 40) for i in range(3)]
    for group in groups:
        scheduler.add(group)
    preempted = []
    for _ in range(30):
        out = step(scheduler)
        preempted += [g.request_id for g in out.preempted]
        if preempted:
            break
    assert preempted[0] == "g2"
    assert groups[2].status == GroupStatus.WAITING and groups[2].seqs[0].num_computed_tokens == 0


def test_admission_leaves_the_watermark_free():
    scheduler = make_scheduler(num_blocks=100, watermark=0.1)   # 10 blocks held back
    first = make_group("first", 16 * 85, 1)                     # 85 blocks: 15 left
    second = make_group("second", 16 * 6, 1)                    # 6 more would leave 9 < 10
    scheduler.add(first)
    scheduler.add(second)
    scheduler.schedule()
    assert first.status == GroupStatus.RUNNING and second.status == GroupStatus.WAITING


@pytest.mark.parametrize("width", [1, 2, 4])
def test_default_max_tokens_is_capped_so_every_candidate_fits_the_pool(width):
    scheduler = make_scheduler(num_blocks=96)
    fit = scheduler.capacity.max_tokens_that_fit(100, width, limit=4000)
    assert scheduler.capacity.max_blocks(100, fit, width) <= scheduler.capacity.usable_blocks
    assert scheduler.capacity.max_blocks(100, fit + 16, width) > scheduler.capacity.usable_blocks
    assert scheduler.capacity.admission_error(100, fit, width) is None


def prioritized(name, prompt_len, max_tokens, priority):
    group = make_group(name, prompt_len, max_tokens)
    group.priority = group.params.priority = priority
    return group


def test_priority_policy_admits_lower_values_first_and_fcfs_ignores_them():
    for policy, expected in (("priority", ["p0", "p3", "p5"]), ("fcfs", ["p5", "p0", "p3"])):
        scheduler = make_scheduler(num_blocks=400, max_num_seqs=1, scheduling_policy=policy)
        groups = [prioritized(f"p{p}", 10, 2, p) for p in (5, 0, 3)]
        for group in groups:
            scheduler.add(group)
        order = []
        while scheduler.has_unfinished:
            out = step(scheduler)
            order += [i.group.request_id for i in out.scheduled if i.group.request_id not in order]
        assert order == expected, policy


def test_under_priority_the_lowest_priority_running_group_is_preempted_first():
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=8, scheduling_policy="priority")
    low = prioritized("low", 12, 40, 9)       # oldest, but least important
    high = [prioritized(f"high{i}", 12, 40, 0) for i in range(2)]
    for group in [low] + high:
        scheduler.add(group)
    preempted = []
    for _ in range(30):
        preempted += [g.request_id for g in step(scheduler).preempted]
        if preempted:
            break
    assert preempted[0] == "low"


def test_a_high_priority_arrival_preempts_lower_priority_work_to_start_at_once():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=8, scheduling_policy="priority")
    batch = [prioritized(f"batch{i}", 100, 40, 5) for i in range(4)]   # 7 blocks each with output: pool full
    for group in batch:
        scheduler.add(group)
    for _ in range(3):
        step(scheduler)
    urgent = prioritized("urgent", 100, 8, 0)
    scheduler.add(urgent)
    out = step(scheduler)
    assert urgent.status == GroupStatus.RUNNING and tokens_of(out, urgent) > 0
    assert out.preempted and all(g.priority == 5 for g in out.preempted)
    while scheduler.has_unfinished:   # the preempted ones still finish
        step(scheduler)
    assert all(g.status == GroupStatus.FINISHED for g in batch)
    assert scheduler.block_manager.num_used_blocks == 0


def test_the_waiting_queue_is_a_heap_with_removal_from_the_middle():
    from pagedbackend.core.request_queue import RequestQueue
    queue = RequestQueue(lambda g: (g.priority, g.arrival_time))
    groups = [prioritized(f"g{i}", 4, 1, p) for i, p in enumerate([3, 1, 2, 1, 0])]
    for group in groups:
        queue.push(group)
    queue.remove(groups[2])
    assert [g.request_id for g in queue] == ["g4", "g1", "g3", "g0"] and len(queue) == 4
    assert queue.peek() is groups[4] and queue.pop() is groups[4] and groups[2] not in queue
    with pytest.raises(ValueError, match="already queued"):
        queue.push(groups[1])


def test_speculative_slots_are_held_for_one_step_and_those_of_rejected_tokens_given_back():
    scheduler = make_scheduler(num_blocks=16, block_size=4, enable_prefix_caching=True,
                               inputs=SchedulerInputs(lookahead=lambda num_decoding: 5))
    group = make_group("r", prompt_len=10, max_tokens=50, temperature=0.0)
    scheduler.add(group)
    first = step(scheduler)   # the prompt: no speculative slots for a prefill
    assert [item.num_lookahead for item in first.scheduled] == [0]
    out = scheduler.schedule()
    [item] = out.scheduled
    seq, bm = item.seq, scheduler.block_manager
    assert (item.num_new_tokens, item.num_lookahead, out.num_batched_tokens) == (1, 5, 6)
    assert bm.num_tokens(seq.seq_id) == 11 + 5 and len(bm.get_block_table(seq.seq_id)) == 4
    item.set_drafts([8, 8, 9, 9])   # four of the five slots proposed
    assert item.token_ids == [7, 8, 8, 9, 9] and item.num_logit_rows == 5
    # Verification: the first draft is already refused; token 3 comes instead.
    seq.append_token(3, None, None)
    scheduler.update_from_output(out, StepUpdate(uncomputed={seq.seq_id: 4}))
    assert (seq.num_computed_tokens, seq.num_tokens) == (11, 12)
    assert bm.num_tokens(seq.seq_id) == 11 and len(bm.get_block_table(seq.seq_id)) == 3
    bm.check_invariants()
    # Next step: draft 5 kept, draft 6 rejected in favour of token 4.
    out = scheduler.schedule()
    [item] = out.scheduled
    item.set_drafts([5, 6])
    seq.append_token(5, None, None)
    seq.append_token(4, None, None)
    scheduler.update_from_output(out, StepUpdate(uncomputed={seq.seq_id: 1}))
    assert (seq.num_computed_tokens, seq.num_tokens) == (13, 14)
    assert bm.num_tokens(seq.seq_id) == 13 and bm.num_used_blocks == 4
    bm.check_invariants()
    # The prefix cache holds the full blocks of verified, computed tokens, never
    # a block that held a rejected draft (positions 11-15 did in the first step).
    table = bm.get_block_table(seq.seq_id)
    cached = sorted(bm.pool.cached.values(), key=lambda b: table.index(b.block_id))
    assert [b.token_ids for b in cached] == [tuple(seq.token_ids[i:i + 4]) for i in (0, 4, 8)]


def test_no_speculative_slots_for_beams_or_past_max_tokens():
    scheduler = make_scheduler(num_blocks=64, block_size=4, inputs=SchedulerInputs(lookahead=lambda num_decoding: 4))
    beams = make_group("beams", prompt_len=8, max_tokens=20, n=2, beams=True)
    short = make_group("short", prompt_len=8, max_tokens=3, temperature=0.0)
    for group in (beams, short):
        scheduler.add(group)
    step(scheduler)
    out = scheduler.schedule()
    looks = {(item.group.request_id, item.num_lookahead) for item in out.scheduled}
    # One token out of three: at most one more can follow the one computed now.
    assert looks == {("beams", 0), ("short", 1)}
