"""The engine: scheduler, model runner and sampler, one step at a time.

``step()`` asks the scheduler for a batch, has the runner carry out the
scheduler's swap and copy mappings and run the model once, samples, updates
every sequence's tokens and text (parallel samples fork, beams re-parent,
stops end sequences), hands the outcome back to the scheduler
(``update_from_output``: the only place blocks change after a step) and
returns per-request output deltas. The engine owns the tokenizer; the runner
sees token ids only.
"""
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from typing import Dict, List, Optional, Sequence as Seq, Tuple

import torch

from ..config import EngineConfig
from ..core.scheduler import ScheduledSeq, Scheduler, StepUpdate
from ..core.sequence import GroupStatus, Sequence, SequenceGroup
from ..models.default_model import resolve_model_path
from ..sample import SampleRow, Sampler
from ..sample.structured import GrammarCompiler
from ..sampling_params import InvalidRequestError, SamplingParams
from .detokenizer import decode_new_text, find_stop_string
from .input_processor import PROMPT_CHARS_PER_TOKEN, InputProcessor, Prompt, fit_max_model_len
from .outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from .tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger("pagedbackend")


class _Background:
    """``work(*args)`` in a thread; ``result()`` waits and returns it, or raises its error."""

    def __init__(self, work, *args):
        self._value, self._error = None, None

        def run():
            try:
                self._value = work(*args)
            except BaseException as exc:   # raised again in result()
                self._error = exc
        self._thread = threading.Thread(target=run, name="pagedbackend-load", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class LLMEngine:
    def __init__(self, config: EngineConfig, runner=None, compile_in_background: bool = False):
        """``compile_in_background``: serve eager steps from the start and switch
        to the compiled step once it is built (``ModelRunner``); a server's choice."""
        model_path = resolve_model_path(config.model)
        self.config = config = dataclasses.replace(config, model=str(model_path))
        # The tokenizer (most of it importing transformers) loads beside the weights.
        tokenizer = _Background(load_tokenizer, model_path)
        if runner is None:
            from ..worker import make_executor
            runner = make_executor(config, compile_in_background)
        self.runner = runner
        self.tokenizer = tokenizer.result()
        self.eos_token_ids = eos_token_ids(model_path, self.tokenizer)
        self.vocab_size = runner.vocab_size
        # Prefix-cache keys cover everything that changes K/V besides the tokens.
        model_key = f"{model_path}|{config.dtype}|{config.quantization}".encode()
        self.max_model_len = fit_max_model_len(runner.max_model_len, runner.num_kv_blocks, config)
        self.scheduler = Scheduler(config, runner.num_kv_blocks, self.max_model_len, cache_salt=model_key)
        self.max_prompt_chars = config.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.max_model_len
        self.groups: Dict[str, SequenceGroup] = {}
        # Constrained requests whose grammar still compiles, held back from the scheduler.
        self.compiling: List[SequenceGroup] = []
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len,
                                     self.max_prompt_chars, self.scheduler, self.grammars)
        self.sampler = Sampler(config.seed)
        self.stats = EngineStats()
        # Timings of the latest step (seconds): all of it, the model forward,
        # scheduling, and sampling with the sequence updates.
        self.last_step_seconds = self.last_forward_seconds = 0.0
        self.last_schedule_seconds = self.last_sample_seconds = 0.0

    @property
    def block_manager(self):
        """The scheduler's block manager, for statistics and tests (read only)."""
        return self.scheduler.block_manager

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Prompt, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None,
                    cumulative_logprob: bool = False) -> SequenceGroup:
        """Validate and queue a request; raises InvalidRequestError if it can never be served.
        ``cumulative_logprob``: compute it even when the parameters do not need it."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        group = self.make_group(request_id, prompt, params, arrival_time, cumulative_logprob)
        self.add_group(group)
        return group

    def make_group(self, request_id: str, prompt: Prompt, params: Optional[SamplingParams] = None,
                   arrival_time: Optional[float] = None,
                   cumulative_logprob: bool = False) -> SequenceGroup:
        """Check a request against the model and the pool and build its group
        (``InputProcessor.make_group``). Touches no engine state, so any
        thread may call it."""
        return self.inputs.make_group(request_id, prompt, params, arrival_time, cumulative_logprob)

    def add_group(self, group: SequenceGroup) -> None:
        if group.request_id in self.groups:
            raise InvalidRequestError(f"request id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        self.stats.prompt_tokens += len(group.prompt_token_ids)
        if group.grammar is not None:
            self.stats.structured_requests += 1
            if not group.grammar.done():
                self.compiling.append(group)
                return
            group.seqs[0].constraint = group.grammar.matcher()
        self.scheduler.add(group)

    def _take_compiled(self) -> List[RequestOutput]:
        """Hand the requests whose grammar has compiled to the scheduler; end
        those whose compile failed. With nothing else to run, wait a little
        for the first compile rather than spin."""
        if self.compiling and not self.scheduler.has_unfinished:
            self.compiling[0].grammar.wait(0.05)
        outputs, waiting = [], []
        for group in self.compiling:
            if not group.grammar.done():
                waiting.append(group)
                continue
            group.metrics.grammar_compile_time = group.grammar.seconds
            try:
                group.seqs[0].constraint = group.grammar.matcher()
            except Exception as exc:
                self.stats.rejected_requests += 1
                outputs.append(self._end_with_error(group, str(exc)))
                continue
            self.scheduler.add(group)
        self.compiling = waiting
        return outputs

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Stop a request and free its blocks at once; returns its final output."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        if group in self.compiling:
            self.compiling.remove(group)
        self.scheduler.remove(group)
        for seq in group.seqs:
            seq.finish_reason = "abort"
        group.finished_seqs += group.seqs
        group.seqs = []
        group.metrics.finished_time = time.time()
        self.stats.aborted_requests += 1
        return self._output(group, finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def check_idle(self) -> List[str]:
        """Call when no request is left: every KV block must be free (or free and
        cached) and nothing tracked. A violation is logged and counted
        (``EngineStats.idle_leak_checks_failed``); returns the violations."""
        leaks = self.scheduler.idle_leaks()
        if self.groups:
            leaks.append(f"{len(self.groups)} request(s) still tracked")
        if leaks:
            self.stats.idle_leak_checks_failed += 1
            logger.error("engine idle but not clean: %s", "; ".join(leaks))
        return leaks

    # ------------------------------------------------------------ the step
    def step(self) -> List[RequestOutput]:
        start = time.perf_counter()
        outputs = self._take_compiled() if self.compiling else []
        sched = self.scheduler.schedule()
        self.last_schedule_seconds = time.perf_counter() - start
        outputs += [self._reject(group, msg) for group, msg in sched.rejected]
        # Order matters: a block swapped out may be handed to someone else in this step.
        if sched.swap_out_pairs:
            self.runner.swap_out(sched.swap_out_pairs)
        if sched.swap_in_pairs:
            self.runner.swap_in(sched.swap_in_pairs)
        if sched.copy_pairs:
            self.runner.copy_blocks(sched.copy_pairs)
        if sched.is_empty:
            self.last_step_seconds = time.perf_counter() - start
            return outputs
        forward_start = time.perf_counter()
        logits = self.runner.execute_model(sched.scheduled)
        self.last_forward_seconds = time.perf_counter() - forward_start

        sample_start = time.perf_counter()
        update = StepUpdate()
        failed: Dict[str, Tuple[SequenceGroup, str]] = {}
        with torch.inference_mode():
            if any(item.prompt_logits for item in sched.scheduled):
                logits = self._take_prompt_logprobs(logits, sched.scheduled, failed)
            touched = self._sample_and_update(logits, [i for i in sched.scheduled if i.need_logits],
                                              update, failed)
        self.scheduler.update_from_output(sched, update)
        self.last_sample_seconds = time.perf_counter() - sample_start
        for group in touched:
            if group.request_id not in failed:
                self._isolated(group, failed, "building its output",
                               lambda: outputs.append(self._output(group, finished=group.is_finished)))
        outputs.extend(self._fail_group(group, message) for group, message in failed.values())
        self.stats.num_steps += 1
        self.stats.last_step_tokens = sched.num_batched_tokens
        self.last_step_seconds = time.perf_counter() - start
        self.stats.step_seconds += self.last_step_seconds
        self.stats.forward_seconds += self.last_forward_seconds
        self.stats.sample_seconds += self.last_sample_seconds
        return [o for o in outputs if o is not None]

    def _sample_and_update(self, logits: torch.Tensor, completing: Seq[ScheduledSeq],
                           update: StepUpdate, failed: Dict) -> List[SequenceGroup]:
        """Sample every completing sequence and apply the tokens. A group whose
        share raises is recorded in ``failed`` and left out; the others go on."""
        owners = []   # (group, seq, its sample rows)
        beams = defaultdict(list)
        for row, item in enumerate(completing):
            group, seq = item.group, item.seq
            if group.is_beam_search:
                beams[group].append((seq, row))
                continue
            copies = group.params.best_of if not group.forked else 1
            owners.append((group, seq, [self._sample_row(group, seq, row, seq.index + i)
                                        for i in range(copies)]))
        touched: Dict[str, SequenceGroup] = {}
        for (group, seq, _), samples in zip(owners, self._sample_owners(logits, owners, failed)):
            if group.request_id in failed:
                continue
            if self._isolated(group, failed, "applying its tokens",
                              lambda: self._apply_samples(group, seq, samples, update), update):
                touched[group.request_id] = group
        for group, seq_rows in beams.items():
            done = []
            if self._isolated(group, failed, "a beam search step",
                              lambda: done.append(self._beam_step(group, seq_rows, logits, update)), update):
                if done[0]:
                    touched[group.request_id] = group
        return [g for g in touched.values() if g.request_id not in failed]

    def _take_prompt_logprobs(self, logits: torch.Tensor, scheduled: Seq[ScheduledSeq],
                              failed: Dict) -> torch.Tensor:
        """Record the prompt log-probabilities that this step's chunks give
        (the logits of position p score the prompt token at p + 1) and return
        the logits of the rows to sample, one per entry that needs logits."""
        row, sample_rows = 0, []
        for item in scheduled:
            count = len(item.token_ids) if item.prompt_logits else int(item.need_logits)
            if item.prompt_logits:
                group = item.group
                self._isolated(group, failed, "computing prompt log-probabilities",
                               lambda: self._prompt_logprobs(group, item, logits[row:row + count]))
            if item.need_logits:
                sample_rows.append(row + count - 1)
            row += count
        return logits[sample_rows]

    def _prompt_logprobs(self, group: SequenceGroup, item: ScheduledSeq, logits: torch.Tensor) -> None:
        prompt, have = group.prompt_token_ids, len(group.prompt_logprobs)
        # Row j is position start + j; it scores the token at start + j + 1.
        first = have - 1 - item.start_pos
        count = min(len(prompt) - have, logits.shape[0] - first)
        if first < 0 or count <= 0:
            return
        logprobs = torch.log_softmax(logits[first:first + count].float(), dim=-1)
        targets = torch.tensor(prompt[have:have + count], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > chosen).sum(dim=1) + 1
        k = group.params.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k else None
        decode = self.tokenizer.decode
        for j, token in enumerate(prompt[have:have + count]):
            entries = {token: Logprob(float(chosen[j]), int(ranks[j]), decode([token]))}
            if top is not None:
                for rank, (value, other) in enumerate(zip(top.values[j].tolist(), top.indices[j].tolist()), 1):
                    if other != token:
                        entries[other] = Logprob(value, rank, decode([other]))
            group.prompt_logprobs.append(entries)

    def _sample_owners(self, logits: torch.Tensor, owners, failed: Dict) -> List[list]:
        """Samples per owner: the whole batch at once; should that raise, each
        owner alone, so that only the owners whose rows raise fail."""
        rows = [r for _, _, owner_rows in owners for r in owner_rows]
        if not rows:
            return []
        try:
            samples = self.sampler(logits, rows)
        except Exception:
            per_owner = []
            for group, _, owner_rows in owners:
                result = []
                self._isolated(group, failed, "sampling",
                               lambda: result.extend(self.sampler(logits, owner_rows)))
                per_owner.append(result)
            return per_owner
        per_owner, k = [], 0
        for _, _, owner_rows in owners:
            per_owner.append(samples[k:k + len(owner_rows)])
            k += len(owner_rows)
        return per_owner

    def _isolated(self, group: SequenceGroup, failed: Dict, what: str, work,
                  update: Optional[StepUpdate] = None) -> bool:
        """Run one request's share of a step. If it raises, the request alone
        fails: it is recorded in ``failed`` (with the reason, also logged) and
        whatever it added to ``update`` that would hand it blocks is withdrawn."""
        marks = (len(update.forks), len(update.finished)) if update is not None else None
        try:
            work()
            return True
        except Exception as exc:
            if update is not None:
                del update.forks[marks[0]:]
                del update.finished[marks[1]:]
            message = f"request {group.request_id} failed while {what}: {type(exc).__name__}: {exc}"
            logger.error("%s", message, exc_info=True)
            failed.setdefault(group.request_id, (group, message))
            return False

    def _sample_row(self, group: SequenceGroup, seq: Sequence, row: int, index: int) -> SampleRow:
        params = group.params
        suppress = ()
        if seq.num_output_tokens < params.min_tokens:
            suppress = sorted(self.eos_token_ids | set(params.stop_token_ids))
        key = (params.seed, index, seq.num_output_tokens) if params.seed is not None else None
        if not params.has_logits_processing:
            return SampleRow(row, params, suppress, key, group.wants_logprob, constraint=seq.constraint)
        return SampleRow(row, params, suppress, key, group.wants_logprob, seq.token_ids,
                         seq.num_prompt_tokens, group.bad_words_ids, seq.constraint)

    def _apply_samples(self, group: SequenceGroup, seq: Sequence, samples, update: StepUpdate) -> None:
        now = time.time()
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        new_seqs = [seq]
        if not group.forked:
            # Parallel sampling: every candidate shares the prompt's blocks.
            for i in range(1, len(samples)):
                child = seq.fork(i)
                if seq.constraint is not None:   # each candidate follows the grammar on its own
                    child.constraint = seq.constraint.fork()
                update.forks.append((seq, child))
                new_seqs.append(child)
            group.seqs = list(new_seqs)
            group.forked = True
        for s, sample in zip(new_seqs, samples):
            s.append_token(sample.token_id, sample.logprob, self._logprobs(sample))
            if s.constraint is not None and not s.constraint.accept_token(sample.token_id):
                raise RuntimeError(f"token {sample.token_id} was sampled outside the structured-output "
                                   "grammar's mask")
            self.stats.generation_tokens += 1
            self._check_stop(group, s, sample.token_id)
            if s.finished:
                update.freed.append(s)
                group.seqs.remove(s)
                group.finished_seqs.append(s)
        if not group.seqs:
            self._finish_group(group, update)

    def _logprobs(self, sample) -> Optional[Dict[int, Logprob]]:
        """The sample's top log-probabilities as vLLM's Logprob entries, with
        rank and text; None when the request did not ask for them."""
        if sample.top_logprobs is None:
            return None
        # The sampled token first, then the top ones by rank, as vLLM lists them.
        entries = {sample.token_id: Logprob(sample.logprob, sample.rank,
                                            self.tokenizer.decode([sample.token_id]))}
        for rank, (token, logprob) in enumerate(sample.top_logprobs.items(), start=1):
            if token != sample.token_id:
                entries[token] = Logprob(logprob, rank, self.tokenizer.decode([token]))
        return entries

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token_id: int) -> None:
        params = group.params
        new_text = decode_new_text(self.tokenizer, seq, params.skip_special_tokens)
        if seq.constraint is not None and seq.constraint.is_terminated():   # the grammar took its end
            seq.finish_reason = "stop"
            return
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
                return
            if token_id in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token_id
                return
            if params.stop_list:
                stop = find_stop_string(seq, len(new_text), params.stop_list,
                                        params.include_stop_str_in_output)
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if seq.num_output_tokens >= group.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _beam_step(self, group: SequenceGroup, seq_rows, logits: torch.Tensor, update: StepUpdate) -> bool:
        live = group.seqs
        if len(seq_rows) < len(live):
            # Some beams are still being recomputed after a preemption: hold the
            # ones that are done by recomputing their last token next step.
            update.held.update(seq.seq_id for seq, _ in seq_rows)
            return False
        row_of = {seq.seq_id: row for seq, row in seq_rows}
        rows = [row_of[s.seq_id] for s in live]
        params = group.params
        beam_logits = logits[rows]
        if live[0].num_output_tokens < params.min_tokens:
            beam_logits[:, sorted(self.eos_token_ids | set(params.stop_token_ids))] = float("-inf")
        logprobs = torch.log_softmax(beam_logits, dim=-1)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        result = group.beam.step([s.token_ids for s in live], [s.cumulative_logprob for s in live],
                                 logprobs, live[0].num_output_tokens, group.max_tokens, stop_ids)
        now = time.time()
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        self.stats.generation_tokens += len(live)
        if result.done:
            update.freed.extend(live)
            group.seqs = []
            self._finish_group(group, update)
            return True
        # Re-parent: a beam chosen twice is forked (blocks shared), one not chosen is freed.
        used = set()
        next_beams = []
        for parent_idx, token, _ in result.continuations:
            parent = live[parent_idx]
            if parent.seq_id in used:
                child = parent.fork(len(next_beams))
                update.forks.append((parent, child))
                next_beams.append(child)
            else:
                used.add(parent.seq_id)
                next_beams.append(parent)
        update.freed.extend(seq for seq in live if seq.seq_id not in used)
        for seq, (_, token, score) in zip(next_beams, result.continuations):
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
        group.seqs = next_beams
        return False

    def _finish_group(self, group: SequenceGroup, update: StepUpdate) -> None:
        group.status = GroupStatus.FINISHED
        group.metrics.finished_time = time.time()
        update.finished.append(group)
        self.groups.pop(group.request_id, None)
        self.stats.finished_requests += 1

    def _fail_group(self, group: SequenceGroup, message: str) -> RequestOutput:
        """End a request whose handling raised: every block it holds goes back,
        and its final output carries the error (finish reason ``abort``)."""
        self.stats.failed_requests += 1
        group.metrics.finished_time = time.time()   # it ran: its latencies count
        return self._end_with_error(group, message)

    def _reject(self, group: SequenceGroup, message: str) -> RequestOutput:
        """End a request the scheduler refused (it can never fit)."""
        self.stats.rejected_requests += 1
        return self._end_with_error(group, message)

    def _end_with_error(self, group: SequenceGroup, message: str) -> RequestOutput:
        self.groups.pop(group.request_id, None)
        self.scheduler.remove(group)   # wherever it stands; frees what it holds
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             [CompletionOutput(0, "", [], finish_reason="abort")], True,
                             dataclasses.replace(group.metrics), error=message)

    # ------------------------------------------------------------ outputs
    def _output(self, group: SequenceGroup, finished: bool) -> Optional[RequestOutput]:
        if group.streams_deltas:
            seqs = sorted(group.seqs + group.finished_seqs, key=lambda s: s.index)
            outputs = [self._delta(group, s) for s in seqs]
        elif not finished:
            return None
        elif group.is_beam_search and group.beam.finished:
            outputs = [self._beam_output(group, i, h) for i, h in enumerate(group.beam.best(group.params.n))]
        else:
            seqs = group.finished_seqs + group.seqs
            if group.params.best_of > group.params.n:
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)
            outputs = [self._delta(group, s, index=i) for i, s in enumerate(seqs[:group.params.n])]
        prompt_logprobs = None
        if group.prompt_logprobs is not None and not group.needs_prompt_logits and not group.prompt_logprobs_sent:
            prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                             finished, dataclasses.replace(group.metrics), prompt_logprobs=prompt_logprobs)

    def _delta(self, group: SequenceGroup, seq: Sequence, index: Optional[int] = None) -> CompletionOutput:
        """New tokens and text since the last delta. Text that might still turn
        into a stop string is held back until it cannot."""
        text = seq.output_text
        end = len(text)
        params = group.params
        if not seq.finished and params.stop_list and not params.include_stop_str_in_output:
            end = max(seq.num_sent_chars, end - (max(len(s) for s in params.stop_list) - 1))
        new_text = text[seq.num_sent_chars:end]
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_sent_tokens:]
        seq.num_sent_chars = end
        seq.num_sent_tokens = seq.num_output_tokens
        top = None if params.logprobs is None else (seq.logprobs[-len(new_ids):] if new_ids else [])
        return CompletionOutput(seq.index if index is None else index, new_text, new_ids,
                                seq.cumulative_logprob if group.wants_logprob else None, top,
                                seq.finish_reason, seq.stop_reason, seq.num_output_tokens)

    def _beam_output(self, group: SequenceGroup, index: int, hyp) -> CompletionOutput:
        ids = hyp.token_ids[len(group.prompt_token_ids):]
        text = self.tokenizer.decode(ids, skip_special_tokens=group.params.skip_special_tokens)
        stop_ids = self.eos_token_ids | set(group.params.stop_token_ids)
        reason = "stop" if ids and ids[-1] in stop_ids and not group.params.ignore_eos else "length"
        return CompletionOutput(index, text, ids, hyp.cumulative_logprob, None, reason, None, len(ids))

    # ------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        bm, sch, st = self.block_manager, self.scheduler, self.stats
        st.num_running = len(sch.running)
        st.num_waiting = len(sch.waiting)
        st.num_swapped = len(sch.swapped)
        st.num_used_blocks = bm.num_used_blocks
        st.num_total_blocks = bm.num_total_blocks
        st.kv_usage = bm.usage
        st.num_swap_blocks = bm.num_swap_blocks
        st.num_free_swap_blocks = bm.num_free_swap_blocks
        st.num_shared_blocks = bm.num_shared_blocks
        st.num_cached_free_blocks = bm.num_cached_free_blocks
        st.stored_positions = bm.stored_positions()
        st.allocated_slots = bm.num_used_blocks * bm.block_size
        st.num_swap_preemptions = sch.num_swap_preemptions
        st.num_recompute_preemptions = sch.num_recompute_preemptions
        st.num_preemptions = sch.num_swap_preemptions + sch.num_recompute_preemptions
        st.prefix_cache_queries = bm.prefix_queries
        st.prefix_cache_hits = bm.prefix_hits
        st.compiled_step = getattr(self.runner, "compiled", None) is not None
        st.structured_mask_seconds = self.sampler.mask_seconds
        st.grammar_compiles = self.grammars.compiles
        st.num_waiting += len(self.compiling)
        governor = getattr(self.runner, "wait_governor", None)
        st.cpu_contended = governor is not None and governor.contended
        return EngineStats(**st.__dict__)
