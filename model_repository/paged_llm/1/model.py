"""Triton Python-backend adapter: Triton request in, AsyncLLMEngine calls, Triton responses out.

``execute`` only queues each request and returns; an intake thread reads its
inputs and tokenises it (a long prompt holds up no one's ``execute``), and a
coroutine on an asyncio loop in a thread of its own streams the engine's
deltas through the request's response sender (decoupled mode). Inputs and
responses: ``pagedbackend.serving.triton.io``; metrics:
``pagedbackend.serving.triton.metrics``; living and dying with tritonserver
(parent watch, drain on SIGTERM): ``pagedbackend.serving.triton.lifecycle``.

If the engine itself fails, every open request gets an error and the model
unloads itself, so Triton stops reporting it ready (``pagedbackend.serving.triton.health``).
"""
import asyncio
import itertools
import json
import os
import queue
import threading
import time
import uuid

import triton_python_backend_utils as pb_utils

from pagedbackend.config import engine_config
from pagedbackend.engine import AsyncLLMEngine, EngineDeadError
from pagedbackend.errors import InvalidRequestError
from pagedbackend.serving.constants import SHUTTING_DOWN
from pagedbackend.serving.embeddings import check_runner
from pagedbackend.serving.images import decode_images, images_per_prompt
from pagedbackend.serving.triton.embeddings import EmbeddingJob, read_embedding_request
from pagedbackend.serving.triton.health import EngineFailurePolicy
from pagedbackend.serving.triton.image_pool import ImagePool
from pagedbackend.serving.triton.io import (FINAL, Job, accumulate, build_response, read_flags, read_optional_text,
                                            read_request, send_error, send_json)
from pagedbackend.serving.triton.lifecycle import (end_stub, log_to_stderr, on_sigterm, use_utf8_locale,
                                                   watch_listener, watch_server)
from pagedbackend.serving.triton.lora import ControlError, TritonAdapters, read_multi_lora
from pagedbackend.serving.triton.metrics import Metrics
from pagedbackend.serving.triton.settings import ModelSettings, image_limits, request_limits

TICK_S = 0.1             # cancellation poll period
STATS_EVERY_TICKS = 2    # gauges and counters refreshed every 0.2 s
DRAIN_S = 5.0            # at shutdown, time for open requests to get their final response


class TritonPythonModel:
    def initialize(self, args):
        self.watcher = watch_server()  # first: this stub must never outlive tritonserver
        use_utf8_locale()              # before anything reads text (inductor's compile does)
        log_to_stderr()
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("paged_llm needs model_transaction_policy { decoupled: true }")
        parameters = model_config.get("parameters", {})
        settings = ModelSettings.from_parameters(parameters)   # upper case: the model's own
        config = engine_config(parameters)                     # lower case: the engine's
        self.failure = EngineFailurePolicy(args["model_name"], settings.unload_on_engine_failure)
        # vllm_backend's multi_lora.json beside this file: read (or missed) before the engine loads.
        adapters = read_multi_lora(os.path.join(args["model_repository"], args["model_version"]),
                                   config.enable_lora)
        self.engine = AsyncLLMEngine(config, on_failure=self.failure.engine_failed)
        try:
            self.adapters = TritonAdapters(self.engine, config.enable_lora, adapters)
        except Exception:
            self.engine.shutdown()
            raise
        self.limits = request_limits(parameters, self.engine.max_model_len, self.engine.max_prompt_chars,
                                     images_per_prompt(config))
        self.image_limits = image_limits(parameters)
        self.image_pool = ImagePool(settings.image_workers, settings.image_queue)
        pb_utils.Logger.log_info("paged_llm: serving " + ", ".join(f"{k}={v}" for k, v in self.engine.describe().items()))
        self.metrics = Metrics({"model": args["model_name"], "version": args["model_version"]},
                               settings.metric_namespaces, self.engine.max_model_len)
        self.metrics.lora(config.enable_lora, settings.metric_namespaces)
        self.jobs, self.lock = {}, threading.Lock()
        self.embedding_jobs = set()    # EmbeddingJob answers in flight
        self.closing = None            # why new requests are refused, once draining
        self.drain_lock, self.drained = threading.Lock(), False
        self.intake = queue.SimpleQueue()
        self.loop = asyncio.new_event_loop()
        self.threads = [threading.Thread(target=self._run_loop, name="paged_llm-responses", daemon=True),
                        threading.Thread(target=self._run_intake, name="paged_llm-intake", daemon=True)]
        for thread in self.threads:
            thread.start()
        on_sigterm(self._drain)        # the launcher's SIGTERM to the server's process group
        watch_listener(self._drain)    # SIGTERM to tritonserver alone: its listener closes

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
            with self.lock:
                refused = self.closing or self.failure.refusal(self.engine.error)
                if not refused:
                    self.intake.put((request, sender))
            if refused:
                send_error(sender, refused, pb_utils.TritonError.UNAVAILABLE)
        return None

    def _run_intake(self):
        """Read, check and tokenise queued requests in arrival order, off Triton's execute thread."""
        for request, sender in iter(self.intake.get, None):
            self._answering_errors(sender, self._take, request, sender)

    def _take(self, request, sender):
        """Start one request; one with images goes to the image pool (decoded and added there)."""
        control = read_optional_text(request, "lora_control")
        if control is not None:   # adapters listed, loaded or unloaded, no generation
            send_json(sender, self.adapters.control(control))
            return
        embedding = read_embedding_request(request, self.limits, self.engine.runner)
        if embedding is not None:   # one embedding per input, one response (vllm_backend's)
            self._start(self._embed(EmbeddingJob(self.engine, embedding, request, sender,
                                                 self._observe_embedding)))
            return
        check_runner(self.engine.runner, "generate")
        mapped = read_request(request, self.limits)   # prompt, sampling parameters, adapter: checked
        if not mapped.multi_modal_data:
            self._start(self._respond(self._submit(request, sender, mapped)))
        elif not self.image_pool.try_submit(self._answering_errors, sender, self._submit_images,
                                            request, sender, mapped):
            if self.closing:
                raise EngineDeadError(self.closing)
            send_error(sender, self.image_pool.busy_message(), pb_utils.TritonError.UNAVAILABLE)

    def _submit_images(self, request, sender, mapped):
        """On the image pool: decode the request's images, then add it (the engine's processor runs here)."""
        if self.closing:
            raise EngineDeadError(self.closing)
        mapped.multi_modal_data = {"image": decode_images(mapped.multi_modal_data["image"], self.image_limits)}
        self._start(self._respond(self._submit(request, sender, mapped)))

    def _answering_errors(self, sender, work, *args):
        """``work(*args)``; what it raises is answered as the request's error."""
        try:
            work(*args)
        except ControlError as exc:
            send_error(sender, str(exc), pb_utils.TritonError.NOT_FOUND if exc.status == 404
                       else pb_utils.TritonError.INVALID_ARG)
        except ValueError as exc:  # includes InvalidRequestError and bad UTF-8
            send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
        except EngineDeadError as exc:
            send_error(sender, self.closing or str(exc), pb_utils.TritonError.UNAVAILABLE)
        except Exception as exc:
            send_error(sender, f"could not start the request: {exc!r}", pb_utils.TritonError.INTERNAL)

    def _start(self, respond):
        """Run a request's responding coroutine on the response loop."""
        try:
            asyncio.run_coroutine_threadsafe(respond, self.loop)
        except RuntimeError:  # the loop is closed (draining): the drain answers the job
            respond.close()

    def _submit(self, request, sender, mapped) -> Job:
        if self.closing:
            raise EngineDeadError(self.closing)
        lora_request = self.adapters.request_for(mapped.lora_name)
        prompt, params = mapped.prompt, mapped.params
        job = Job(uuid.uuid4().hex, prompt if isinstance(prompt, str) else "", read_flags(request), sender,
                  triton_id=request.request_id())
        job.n, job.logprobs_requested = params.n, params.logprobs is not None
        # cumulative_logprob is computed only for requests that ask for it.
        job.stream = self.engine.add_request(job.request_id, mapped.engine_prompt(), params,
                                             cumulative_logprob=bool(job.flags["return_cumulative_logprob"]),
                                             lora_request=lora_request)
        if not isinstance(prompt, str):   # what echo shows, decoded once the engine has checked the ids
            job.prompt = self.engine.tokenizer.decode(prompt)
        with self.lock:
            self.jobs[job.request_id] = job
            job.abort_reason = self.closing  # a drain that began meanwhile ends it too
        if job.abort_reason:
            self.engine.abort(job.request_id)
        return job

    async def _respond(self, job: Job):
        """Forward the engine's deltas: each one when streaming, else one final response."""
        out, final_sent = None, False
        try:
            async for out in job.stream:
                ended = job.cancelled or job.abort_reason
                if out.error and not ended:   # refused (a grammar the library cannot parse) or failed
                    raise InvalidRequestError(out.error) if out.refused else RuntimeError(out.error)
                new_tokens = accumulate(job, out)
                if not self.closing:
                    self.metrics.observe_tokens(out.metrics, job.last_token_time, new_tokens)
                if new_tokens and out.metrics is not None:
                    job.last_token_time = out.metrics.last_token_time
                if ended:
                    continue  # the abort's last delta: the client has gone, or the server is going
                if job.flags["stream"] and (new_tokens or out.finished):
                    if out.finished:
                        self._forget(job)
                        self._observe_finished(job, out)
                    job.sender.send(build_response(job, out, delta=True), FINAL if out.finished else 0)
                    final_sent = out.finished
            if not final_sent and (job.cancelled or job.abort_reason):
                self._forget(job)
                if out is not None:
                    self._observe_finished(job, out)
                send_error(job.sender, job.abort_reason or "request cancelled", pb_utils.TritonError.CANCELLED)
            elif not final_sent:
                if out is None or not out.finished:
                    raise RuntimeError("engine stream ended before the request finished")
                self._forget(job)
                self._observe_finished(job, out)
                job.sender.send(build_response(job, out, delta=False), FINAL)
            final_sent = True
        except Exception as exc:
            self.engine.abort(job.request_id)
            self._forget(job)
            if not final_sent:
                code = (pb_utils.TritonError.INVALID_ARG if isinstance(exc, InvalidRequestError)
                        else pb_utils.TritonError.INTERNAL)
                try:
                    send_error(job.sender, str(exc), code)
                except Exception as send_exc:  # the client is gone
                    pb_utils.Logger.log_warn(f"paged_llm: {exc}; could not report it: {send_exc}")
        finally:
            self._forget(job)
            if not self.closing:
                self.metrics.update(self.engine.stats())  # so usage returns to zero promptly

    def _observe_finished(self, job: Job, out):
        """A finished request's latencies and sizes, recorded before its final response
        so that a client holding the answer finds it counted."""
        if not self.closing:
            self.metrics.observe_finished(out.metrics, len(out.prompt_token_ids),
                                          sum(job.num_tokens.values()), job.n)

    async def _embed(self, job: EmbeddingJob):
        """Answer an embedding job, watched for cancellation and drain meanwhile."""
        with self.lock:
            self.embedding_jobs.add(job)
            if self.closing:
                job.abort(self.closing)
        try:
            await job.respond()
        finally:
            with self.lock:
                self.embedding_jobs.discard(job)

    def _observe_embedding(self, out):
        """An embedding's latencies and prompt length, as a request with no output tokens."""
        if not self.closing:
            self.metrics.observe_finished(out.metrics, len(out.prompt_token_ids), 0, 1)

    def _forget(self, job: Job):
        """Stop watching a job for cancellation: its final response is due."""
        with self.lock:
            self.jobs.pop(job.request_id, None)

    async def _tick(self):
        """Poll cancellations every TICK_S and refresh engine gauges every few
        ticks, until draining (both are calls into the server)."""
        for count in itertools.count():
            if self.closing:
                return
            with self.lock:
                jobs = list(self.jobs.values())
                embedding_jobs = list(self.embedding_jobs)
            for job in embedding_jobs:
                if job.end_reason is None and job.sender.is_cancelled():
                    job.abort("request cancelled")
            for job in jobs:
                if not job.cancelled and job.sender.is_cancelled():
                    job.cancelled = True
                    pb_utils.Logger.log_info(f"paged_llm: request {job.triton_id or job.request_id} "
                                             f"(engine id {job.request_id}) was cancelled by the client")
                    self.engine.abort(job.request_id)
            if count % STATS_EVERY_TICKS == 0:
                try:
                    self.metrics.update(self.engine.stats())
                except Exception as exc:
                    pb_utils.Logger.log_error(f"paged_llm: engine stats failed: {exc}")
            await asyncio.sleep(TICK_S)

    def _drain(self):
        """Refuse new requests, end every open one with a final response, stop
        the engine and join every thread. On SIGTERM, and again (a no-op) in finalize."""
        with self.drain_lock:
            if self.drained:
                return
            with self.lock:
                self.closing = SHUTTING_DOWN
                jobs = list(self.jobs.values())
                embedding_jobs = list(self.embedding_jobs)
                self.intake.put(None)
            for job in jobs:
                job.abort_reason = SHUTTING_DOWN
                self.engine.abort(job.request_id)
            for job in embedding_jobs:
                job.abort(SHUTTING_DOWN)
            self.image_pool.shutdown()   # what waits there is refused: the server is closing
            self._wait_for_jobs(DRAIN_S)
            self.engine.shutdown(timeout=10.0)  # any stream left gets a final output
            self._wait_for_jobs(2.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            for thread in self.threads:
                thread.join(timeout=5.0)
            self.failure.join(timeout=5.0)
            for job in list(self.jobs.values()):  # its coroutine never finished: answer it here
                try:
                    send_error(job.sender, SHUTTING_DOWN, pb_utils.TritonError.CANCELLED)
                except Exception:
                    pass
            pb_utils.Logger.log_info(f"paged_llm: drained; {len(jobs)} open request(s) ended")
            self.drained = True

    def _wait_for_jobs(self, seconds: float):
        deadline = time.monotonic() + seconds
        while (self.jobs or self.embedding_jobs) and time.monotonic() < deadline:
            time.sleep(0.02)

    def finalize(self):
        """Drain, then end the stub here (``lifecycle.end_stub``): tritonserver
        already has the stub's answer to finalize and waits only for it to exit."""
        self._drain()
        end_stub()
