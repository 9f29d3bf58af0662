"""Triton Python-backend adapter: Triton request in, AsyncLLMEngine calls, Triton responses out.

Tensors follow the public vLLM Triton backend. ``execute`` validates each request
and hands it to the engine, then returns at once; a coroutine on an asyncio loop
in a thread of its own streams the engine's deltas through the request's
response sender (decoupled mode). n > 1 and beam search: each response holds one
element per output (``text_output`` of shape [n], element i is output i; likewise
``finish_reason``, ``cumulative_logprob`` and ``num_output_tokens``).
"""
import asyncio
import itertools
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedbackend.async_engine import AsyncLLMEngine
from pagedbackend.sampling_params import SamplingParams
from pagedbackend.config import engine_config

TICK_S = 0.1             # cancellation poll period
STATS_EVERY_TICKS = 2    # gauges and counters refreshed every 0.2 s
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason",
         "return_cumulative_logprob", "return_num_input_tokens", "return_num_output_tokens")
# Request parameters that Triton itself defines; the rest are sampling parameters.
TRITON_PARAMETERS = {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout"}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class Job:
    """One request in flight and what has been sent for it so far."""
    request_id: str
    prompt: str
    flags: dict
    sender: object
    stream: object = None
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float = None
    cancelled: bool = False
    texts: dict = field(default_factory=dict)          # output index -> text so far
    num_tokens: dict = field(default_factory=dict)     # output index -> tokens so far
    reasons: dict = field(default_factory=dict)
    logprobs: dict = field(default_factory=dict)


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("paged_llm needs model_transaction_policy { decoupled: true }")
        self.engine = AsyncLLMEngine(engine_config(model_config.get("parameters", {})))
        self.metrics = Metrics({"model": args["model_name"], "version": args["model_version"]})
        self.jobs, self.jobs_lock = {}, threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name="paged_llm-responses", daemon=True)
        self.thread.start()

    def _run_loop(self):
        asyncio.set_event_loop(self.loop)
        ticker = self.loop.create_task(self._tick())
        self.loop.run_forever()
        ticker.cancel()
        self.loop.run_until_complete(asyncio.gather(ticker, return_exceptions=True))
        self.loop.close()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._submit(request, sender)
            except ValueError as exc:  # includes InvalidRequestError and bad UTF-8
                send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
            except Exception as exc:
                send_error(sender, f"could not start the request: {exc}", pb_utils.TritonError.INTERNAL)
            else:
                asyncio.run_coroutine_threadsafe(self._respond(job), self.loop)
        return None

    def _submit(self, request, sender) -> Job:
        prompt = read_text(request, "text_input")
        flags = {name: read_flag(request, name) for name in FLAGS}
        if flags["exclude_input_in_output"] is None:  # as the vLLM backend: prompt echoed unless streaming
            flags["exclude_input_in_output"] = bool(flags["stream"])
        elif flags["stream"] and not flags["exclude_input_in_output"]:
            raise ValueError("exclude_input_in_output=false is not allowed with stream=true")
        job = Job(uuid.uuid4().hex, prompt, flags, sender)
        job.stream = self.engine.add_request(job.request_id, prompt, read_sampling_params(request))
        with self.jobs_lock:
            self.jobs[job.request_id] = job
        return job

    async def _respond(self, job: Job):
        """Forward the engine's deltas: each one when streaming, else one final response."""
        out, final_sent = None, False
        try:
            async for out in job.stream:
                if out.error:
                    raise RuntimeError(f"engine failed: {out.error}")
                new_tokens = self._accumulate(job, out)
                if job.cancelled:
                    continue  # the abort's last delta; the client has gone
                if job.flags["stream"] and (new_tokens or out.finished):
                    if out.finished:
                        self._forget(job)
                    job.sender.send(self._response(job, out, delta=True), FINAL if out.finished else 0)
                    final_sent = out.finished
            if job.cancelled:
                self._forget(job)
                send_error(job.sender, "request cancelled", pb_utils.TritonError.CANCELLED)
            elif not final_sent:
                if out is None or not out.finished:
                    raise RuntimeError("engine stream ended before the request finished")
                self._forget(job)
                job.sender.send(self._response(job, out, delta=False), FINAL)
            final_sent = True
            self.metrics.observe("e2e_request_latency_seconds", time.monotonic() - job.arrival)
        except Exception as exc:
            self.engine.abort(job.request_id)
            self._forget(job)
            if not final_sent:
                try:
                    send_error(job.sender, str(exc), pb_utils.TritonError.INTERNAL)
                except Exception as send_exc:  # the client is gone
                    pb_utils.Logger.log_warn(f"paged_llm: {exc}; could not report it: {send_exc}")
        finally:
            self._forget(job)
            self.metrics.update(self.engine.stats())  # so usage returns to zero promptly

    def _accumulate(self, job: Job, out) -> int:
        """Fold a delta into the job; time-to-first-token and per-token time. Returns new tokens."""
        new_tokens = 0
        for o in out.outputs:
            job.texts[o.index] = job.texts.get(o.index, "") + o.text
            job.num_tokens[o.index] = job.num_tokens.get(o.index, 0) + len(o.token_ids)
            job.reasons[o.index] = o.finish_reason or job.reasons.get(o.index)
            job.logprobs[o.index] = o.cumulative_logprob
            new_tokens = max(new_tokens, len(o.token_ids))
        if new_tokens:
            now = time.monotonic()
            if job.last_token_time is None:
                self.metrics.observe("time_to_first_token_seconds", now - job.arrival)
            else:
                self.metrics.observe("time_per_output_token_seconds",
                                     (now - job.last_token_time) / new_tokens)
            job.last_token_time = now
        return new_tokens

    def _response(self, job: Job, out, delta: bool):
        indices = sorted(o.index for o in out.outputs) if delta else sorted(job.texts)
        if delta:
            parts = {o.index: (o.text, len(o.token_ids)) for o in out.outputs}
        else:
            prefix = "" if job.flags["exclude_input_in_output"] else job.prompt
            parts = {i: (prefix + job.texts[i], job.num_tokens[i]) for i in indices}
        tensors = [pb_utils.Tensor("text_output", np.array(
            [parts[i][0].encode("utf-8") for i in indices], dtype=np.object_))]
        if job.flags["return_finish_reason"]:
            tensors.append(pb_utils.Tensor("finish_reason", np.array(
                [str(job.reasons.get(i)) for i in indices], dtype=np.object_)))
        if job.flags["return_cumulative_logprob"]:
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(
                [math.nan if job.logprobs.get(i) is None else job.logprobs[i] for i in indices],
                dtype=np.float32)))
        if job.flags["return_num_input_tokens"]:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array(
                [len(out.prompt_token_ids)], dtype=np.uint32)))
        if job.flags["return_num_output_tokens"]:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array(
                [parts[i][1] for i in indices], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _forget(self, job: Job):
        """Stop watching a job for cancellation: its final response is due."""
        with self.jobs_lock:
            self.jobs.pop(job.request_id, None)

    async def _tick(self):
        """Poll cancellations every TICK_S and refresh engine gauges every few ticks."""
        for count in itertools.count():  # until the loop stops and cancels this task
            with self.jobs_lock:
                jobs = list(self.jobs.values())
            for job in jobs:
                if not job.cancelled and job.sender.is_cancelled():
                    job.cancelled = True
                    self.engine.abort(job.request_id)
            if count % STATS_EVERY_TICKS == 0:
                try:
                    self.metrics.update(self.engine.stats())
                except Exception as exc:
                    pb_utils.Logger.log_error(f"paged_llm: engine stats failed: {exc}")
            await asyncio.sleep(TICK_S)

    def finalize(self):
        with self.jobs_lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            self.engine.abort(job.request_id)
        deadline = time.monotonic() + 5.0
        while self.jobs and time.monotonic() < deadline:  # their final responses go out
            time.sleep(0.05)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10.0)
        self.engine.shutdown()


def read_text(request, name: str) -> str:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise ValueError(f"input {name} is required")
    value = tensor.as_numpy()
    if value.dtype != np.object_ or value.size != 1:
        raise ValueError(f"input {name} must be one BYTES element, got {value.dtype} of shape {list(value.shape)}")
    value = value.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def read_flag(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy()
    if value.dtype != np.bool_ or value.size != 1:
        raise ValueError(f"input {name} must be one BOOL element, got {value.dtype} of shape {list(value.shape)}")
    return bool(value.reshape(-1)[0])


def read_sampling_params(request) -> SamplingParams:
    """The sampling_parameters tensor (JSON), else the request's parameters (generate endpoint)."""
    if pb_utils.get_input_tensor_by_name(request, "sampling_parameters") is not None:
        return SamplingParams.from_json(read_text(request, "sampling_parameters"))
    params = json.loads(request.parameters() or "{}")
    return SamplingParams.from_dict({k: v for k, v in params.items()
                                     if k not in TRITON_PARAMETERS and not k.startswith("triton_")})


def send_error(sender, message: str, code):
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), FINAL)


class Metrics:
    """pagedbackend:* metric families on Triton's /metrics, labelled by model and version."""

    GAUGES = {  # name -> (EngineStats field, help)
        "kv_cache_usage_ratio": ("kv_usage", "Used KV blocks / total KV blocks (1 = full)."),
        "kv_blocks_used": ("num_used_blocks", "KV blocks in use."),
        "kv_blocks_total": ("num_total_blocks", "KV blocks in the device pool."),
        "num_requests_running": ("num_running", "Requests being decoded."),
        "num_requests_waiting": ("num_waiting", "Requests queued for admission."),
        "num_requests_swapped": ("num_swapped", "Requests swapped out to host memory."),
        "kv_positions_stored": ("stored_positions", "Token positions held in used KV blocks."),
        "kv_slots_allocated": ("allocated_slots", "Slots in used KV blocks (blocks x block size)."),
        "kv_blocks_shared": ("num_shared_blocks", "KV blocks referenced by more than one sequence."),
        "kv_blocks_cached_free": ("num_cached_free_blocks", "Free KV blocks still holding a reusable prefix."),
    }
    COUNTERS = {
        "prompt_tokens_total": ("prompt_tokens", "Prompt tokens admitted."),
        "generation_tokens_total": ("generation_tokens", "Tokens generated."),
        "num_preemptions_total": ("num_preemptions", "Sequence groups preempted."),
        "prefix_cache_hits_total": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
        "prefix_cache_queries_total": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    }
    HISTOGRAMS = {
        "time_to_first_token_seconds": ("Time from arrival to the first token.",
                                        [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]),
        "time_per_output_token_seconds": ("Time per output token after the first.",
                                          [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5]),
        "e2e_request_latency_seconds": ("Time from arrival to the final response.",
                                        [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600]),
    }

    def __init__(self, labels: dict):
        self.families = []  # each family must outlive its metrics
        self.gauges, self.counters, self.histograms, self.last = {}, {}, {}, {}
        try:
            for name, (attr, text) in self.GAUGES.items():
                self.gauges[attr] = self._family(name, text, pb_utils.MetricFamily.GAUGE).Metric(labels=labels)
            for name, (attr, text) in self.COUNTERS.items():
                self.counters[attr] = self._family(name, text, pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
                self.last[attr] = 0
            for name, (text, buckets) in self.HISTOGRAMS.items():
                family = self._family(name, text, pb_utils.MetricFamily.HISTOGRAM)
                self.histograms[name] = family.Metric(labels=labels, buckets=buckets)
        except pb_utils.TritonModelException as exc:  # metrics switched off in the server
            pb_utils.Logger.log_warn(f"paged_llm: no custom metrics: {exc}")
            self.gauges, self.counters, self.histograms = {}, {}, {}

    def _family(self, name, text, kind):
        family = pb_utils.MetricFamily(name=f"pagedbackend:{name}", description=text, kind=kind)
        self.families.append(family)
        return family

    def update(self, stats):
        for attr, gauge in self.gauges.items():
            gauge.set(float(getattr(stats, attr)))
        for attr, counter in self.counters.items():
            value = getattr(stats, attr)
            if value > self.last[attr]:
                counter.increment(float(value - self.last[attr]))
                self.last[attr] = value

    def observe(self, name: str, value: float):
        if name in self.histograms:
            self.histograms[name].observe(value)
