"""The engine: scheduler, model runner and sampler, one step at a time.

``core_step()`` asks the scheduler for a batch, has the runner carry out its
block moves (``block_moves``: disk tier, swap, copy) and run the model once,
samples, applies the tokens (``token_updates``: forks, beams, stop tokens,
the length), hands the outcome to the scheduler (``update_from_output``: the
only place blocks change after a step) and reports each changed request
(``CoreOutput``). The output
processor makes text, stop strings, log-probabilities and deltas of the
reports off the step (``output_processor``), in this thread (``step()``) or
another (``AsyncLLMEngine``); sequences a stop string ends come back to
``finish()``. Requests become groups in ``input_processor``; speculation
(``spec_decode``) and structured outputs (``structured``) each enter the
step by one hook. The engine owns the tokenizer; the runner sees token ids.
"""
import dataclasses
import time
from typing import Dict, List, Optional, Sequence as Seq, Tuple

import torch

from ..config import EngineConfig
from ..core.prefill_share import PrefillShare
from ..core.scheduler import Scheduler, SchedulerInputs, StepUpdate
from ..core.sequence import Sequence, SequenceGroup
from ..lora import LoRARequest
from ..models.default_model import resolve_model_path
from ..sample import Sampler
from ..sampling_params import InvalidRequestError, SamplingParams
from ..spec_decode.speculator import make_speculator
from ..structured.queue import StructuredQueue
from .block_moves import make_kv_tier, run_block_moves
from .adapters import AdapterMethods, lora_manager, resolve_adapter, with_adapter
from .input_processor import PROMPT_CHARS_PER_TOKEN, InputProcessor, Prompt, fit_max_model_len, processor_for
from .core_outputs import CoreOutput, SeqFinish
from .kv_publisher import KVEventRelay
from .output_processor import OutputProcessor
from .outputs import EngineStats, RequestOutput
from .pooling import PoolingRequests, RequestParams
from .stats import engine_description, engine_stats, idle_leaks
from .step_sampler import StepSampler
from .token_updates import TokenUpdates
from .tokenizer import eos_token_ids, TokenizerLoad


class LLMEngine(AdapterMethods):
    def __init__(self, config: EngineConfig, runner=None, compile_in_background: bool = False):
        """``compile_in_background``: serve eager steps from the start and switch
        to the compiled step once it is built (``ModelRunner``); a server's choice."""
        model_path = resolve_model_path(config.model)
        self.config = config = dataclasses.replace(config, model=str(model_path)).resolved(model_path)
        # The tokenizer (most of it importing transformers) loads beside the weights.
        tokenizer = TokenizerLoad(model_path)
        if runner is None:
            from ..worker import make_executor
            runner = make_executor(config, compile_in_background)
        self.runner = runner
        self.tokenizer = tokenizer.result()
        self.eos_token_ids = eos_token_ids(model_path, self.tokenizer)
        self.vocab_size = runner.vocab_size
        # Prefix-cache keys cover everything that changes K/V besides the tokens.
        model_key = f"{model_path}|{config.dtype}|{config.quantization}".encode()
        # Each KV group's sliding window (None: full attention; core.kv_groups).
        windows = runner.kv_layout.windows
        self.max_model_len = fit_max_model_len(runner.max_model_len, runner.num_kv_blocks, config, windows)
        self.prefill_share = (PrefillShare(config.tpot_target_s, config.long_prefill_token_threshold
                                           or config.max_num_batched_tokens) if config.tpot_target_s else None)
        self.lora = lora_manager(config, runner)   # None unless enable_lora
        self.speculator = make_speculator(config, runner, compile_in_background)
        inputs = SchedulerInputs(
            lookahead=self.speculator.lookahead if self.speculator is not None else None,
            prefill_caps=self.prefill_share.caps_for if self.prefill_share is not None else None,
            adapter_room=self.lora.fits if self.lora is not None else None)
        self.scheduler = Scheduler(config, runner.num_kv_blocks, self.max_model_len, cache_salt=model_key,
                                   kv_windows=windows, inputs=inputs)
        self.kv_events = KVEventRelay(config.kv_events_config, config.enable_prefix_caching, self.block_manager.pool,
                                      "GPU" if runner.device.type == "cuda" else "CPU")
        self.kv_tier = make_kv_tier(config, runner, model_key, self.block_manager, self.kv_events)   # kv_offload_dir
        self.max_prompt_chars = config.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.max_model_len
        self.groups: Dict[str, SequenceGroup] = {}
        self.structured = StructuredQueue(config, self.tokenizer, self.vocab_size, self.eos_token_ids)
        # Constrained requests whose grammar still compiles (held back from the scheduler), the compiler.
        self.compiling, self.grammars = self.structured.compiling, self.structured.grammars
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, self.max_prompt_chars,
                                     self.scheduler, self.grammars, processor_for(runner, config, model_path))
        self.sampler = Sampler(config.seed)
        self.stats = EngineStats()
        self.tokens = TokenUpdates(self.eos_token_ids, self.max_model_len, self.stats)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.step_sampler = StepSampler(self.sampler, self.tokens, self.eos_token_ids, self.speculator)
        self.pooling = PoolingRequests.for_model(runner, config, model_path)
        # Timings of the latest step (seconds): all of it, the model forward,
        # scheduling, and sampling with the sequence updates.
        self.last_step_seconds = self.last_forward_seconds = 0.0
        self.last_schedule_seconds = self.last_sample_seconds = 0.0

    def describe(self) -> Dict[str, object]:
        """What serves, for a log line at start (``engine_description``)."""
        return engine_description(self)

    @property
    def block_manager(self):
        """The scheduler's block manager, for statistics and tests (read only)."""
        return self.scheduler.block_manager

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Prompt, params: Optional[RequestParams] = None,
                    arrival_time: Optional[float] = None, cumulative_logprob: bool = False,
                    priority: Optional[int] = None,
                    lora_request: Optional[LoRARequest] = None) -> SequenceGroup:
        """Validate and queue a request; raises InvalidRequestError if it can never be served.
        ``params``: ``PoolingParams`` make it an embedding request (``engine.pooling``);
        ``cumulative_logprob``: compute it even when the parameters do not need it;
        ``priority``: vLLM's argument (replaces ``params.priority``);
        ``lora_request``: the adapter it runs with (loaded now if it is new)."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        group = self.make_group(request_id, prompt, params, arrival_time, cumulative_logprob, priority,
                                lora_request)
        self.add_group(group)
        return group

    def make_group(self, request_id: str, prompt: Prompt, params: Optional[RequestParams] = None,
                   arrival_time: Optional[float] = None, cumulative_logprob: bool = False,
                   priority: Optional[int] = None,
                   lora_request: Optional[LoRARequest] = None) -> SequenceGroup:
        """Check a request against the model and the pool and build its group
        (``InputProcessor.make_group``), with its adapter, whose key joins the
        group's prefix-cache namespace. Changes no step state (a new adapter
        is read from its folder here), so any thread may call it."""
        if PoolingRequests.wants(params):
            return self.pooling.make_group(self.inputs, request_id, prompt, params, arrival_time, priority)
        adapter = resolve_adapter(self.lora, lora_request)   # first: a refused one leaves nothing behind
        return with_adapter(self.inputs.make_group(request_id, prompt, params, arrival_time, cumulative_logprob,
                                                   priority), adapter)

    def add_group(self, group: SequenceGroup) -> None:
        if group.request_id in self.groups:
            raise InvalidRequestError(f"request id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        self.stats.prompt_tokens += len(group.prompt_token_ids)
        if group.lora is not None:
            self.lora.count_request(group.lora)
        if group.grammar is not None:   # queued once parsed and compiled (StructuredQueue)
            self.stats.structured_requests += 1
            self.structured.add(group)
            return
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Stop a request and free its blocks at once; returns its final output."""
        outputs = self.outputs.process([self.abort_core(request_id)] if request_id in self.groups else [])[0]
        return outputs[0] if outputs else None

    def abort_core(self, request_id: str) -> Optional[CoreOutput]:
        """``abort_request``'s core: the request's final report."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.structured.remove(group)
        self.scheduler.remove(group)
        self.pooling.forget(request_id)
        self._spec_done([], group.seqs)
        for seq in group.seqs:
            if seq.constraint is not None:   # queued grammar work is dropped
                seq.constraint.close()
            seq.finish_reason = "abort"
        group.finished_seqs += group.seqs
        group.seqs = []
        group.metrics.finished_time = time.time()
        self.stats.aborted_requests += 1
        return self.tokens.report(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def check_idle(self) -> List[str]:
        """Call when no request is left: every KV block must be free (or free and
        cached) and nothing tracked (``stats.idle_leaks``); returns the violations."""
        return idle_leaks(self)

    # ------------------------------------------------------------ the step
    def step(self) -> List[RequestOutput]:
        """A core step and its outputs, built in this thread; sequences ended
        by a stop string are freed before it returns."""
        outputs, finishes = self.outputs.process(self.core_step())
        while finishes:
            more, finishes = self.outputs.process(self.finish(finishes))
            outputs += more
        return outputs

    def core_step(self) -> List[CoreOutput]:
        start = time.perf_counter()
        ready, refused = self.structured.take_compiled(idle=not self.scheduler.has_unfinished)
        for group in ready:
            self.scheduler.add(group)
        outputs = [self._end_with_error(group, message, ran=False) for group, message in refused]
        sched = self.scheduler.schedule()
        self.last_schedule_seconds = time.perf_counter() - start
        outputs += [self._end_with_error(group, msg, ran=False) for group, msg in sched.rejected]
        run_block_moves(self.runner, sched, self.kv_tier)   # disk saves, swaps, copies, disk loads
        self._adapters_for_step(sched.scheduled)
        if self.speculator is not None:   # drafts proposed into the scheduled entries
            self.speculator.before_forward(sched, self.stats)
        if sched.is_empty:
            self.last_step_seconds = time.perf_counter() - start
            self.kv_events.flush()
            return outputs
        self.structured.before_forward(sched.scheduled)
        forward_start = time.perf_counter()
        hidden = [] if any(item.return_hidden for item in sched.scheduled) else None   # pooling's rows
        logits = self.runner.execute_model(sched.scheduled, *(() if hidden is None else (hidden,)))
        self.last_forward_seconds = time.perf_counter() - forward_start

        sample_start = time.perf_counter()
        update = StepUpdate()
        failed: Dict[str, Tuple[SequenceGroup, str]] = {}
        with torch.inference_mode():
            if any(item.prompt_logits for item in sched.scheduled):
                logits = self.step_sampler.take_prompt_logprobs(logits, sched.scheduled, failed)
            touched = self.step_sampler.sample_and_apply(
                logits, [i for i in sched.scheduled if i.need_logits], update, failed)
            if hidden is not None:
                touched += self.pooling.take(sched.scheduled, hidden, update, self.tokens, failed)
        for group in update.finished:
            self.groups.pop(group.request_id, None)
        self.scheduler.update_from_output(sched, update)
        self._spec_done(update.finished, update.freed)
        self.last_sample_seconds = time.perf_counter() - sample_start
        outputs += [self.tokens.report(group) for group in touched if group.request_id not in failed]
        outputs.extend(self._end_with_error(group, message, True, own) for group, message, own in failed.values())
        self.stats.num_steps += 1
        self.stats.last_step_tokens = sched.num_batched_tokens
        self.last_step_seconds = time.perf_counter() - start
        if self.prefill_share is not None:
            self.prefill_share.observe(sched.num_batched_tokens, self.last_step_seconds)
        self.stats.step_seconds += self.last_step_seconds
        self.stats.forward_seconds += self.last_forward_seconds
        self.stats.sample_seconds += self.last_sample_seconds
        self.kv_events.flush()
        return outputs

    def finish(self, finishes: Seq[SeqFinish]) -> List[CoreOutput]:
        """End what the output processor found ended: a sequence at a stop
        string (freed at once; a request with none left finishes) or a request
        whose output failed. Returns the final reports of the requests that ended."""
        reports = []
        for end in finishes:
            group = self.groups.get(end.request_id)
            self.stats.generation_tokens -= end.dropped
            if end.error is not None and group is not None:
                reports.append(self._end_with_error(group, end.error, ran=True))
            elif end.error is not None:
                self.stats.failed_requests += 1
            elif group is not None and (seq := self.tokens.stop_seq(group, end)) is not None:
                self.scheduler.free_seq(seq)
                if not group.seqs:   # its last sequence: the request ends
                    self.scheduler.remove(group)
                    del self.groups[group.request_id]
                    reports.append(self.tokens.report(group))
                self._spec_done([group] if not group.seqs else [], [seq])
        return reports

    def _end_with_error(self, group: SequenceGroup, message: str, ran: bool, own_fault: bool = False) -> CoreOutput:
        """End a request that cannot go on: one whose handling raised (``ran``:
        it counts as failed and its latencies count; ``own_fault``: refused all
        the same) or one refused before it ran (the scheduler's, a grammar
        that failed to compile). Every block it holds goes back; its final
        output carries the error."""
        if ran:
            self.stats.failed_requests += 1
            group.metrics.finished_time = time.time()
        else:
            self.stats.rejected_requests += 1
        self.groups.pop(group.request_id, None)
        self.scheduler.remove(group)   # wherever it stands; frees what it holds
        self.pooling.forget(group.request_id)
        self._spec_done([], group.seqs)
        for seq in group.seqs:
            if seq.constraint is not None:
                seq.constraint.close()
        return self.tokens.report(group, error=message, refused=not ran or own_fault)

    def _spec_done(self, groups: Seq[SequenceGroup], seqs: Seq[Sequence]) -> None:
        """Speculation learns of finished requests and forgets sequences that are gone."""
        if self.speculator is not None:
            self.speculator.after_step(groups, seqs)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (published as
        ``AllBlocksCleared`` when none is held). From the engine's thread."""
        self.block_manager.pool.reset_prefix_cache()
        self.kv_events.flush()

    def get_stats(self) -> EngineStats:
        """A snapshot of the counters and of the pool, queues and step (``engine_stats``)."""
        return engine_stats(self)
