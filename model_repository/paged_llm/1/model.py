"""Triton Python-backend adapter: Triton request in, AsyncLLMEngine calls, Triton responses out.

``execute`` validates each request and hands it to the engine, then returns at
once; a coroutine on an asyncio loop in a thread of its own streams the
engine's deltas through the request's response sender (decoupled mode).
Reading inputs and building responses: ``pagedbackend.serving.triton_io``;
metrics: ``pagedbackend.serving.metrics``.
"""
import asyncio
import itertools
import json
import threading
import time
import uuid

import triton_python_backend_utils as pb_utils

from pagedbackend.config import engine_config
from pagedbackend.engine import AsyncLLMEngine
from pagedbackend.serving.metrics import Metrics
from pagedbackend.serving.triton_io import (FINAL, Job, accumulate, build_response, read_flags,
                                            read_sampling_params, read_text, send_error)

TICK_S = 0.1             # cancellation poll period
STATS_EVERY_TICKS = 2    # gauges and counters refreshed every 0.2 s


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
        job = Job(uuid.uuid4().hex, prompt, read_flags(request), sender)
        # cumulative_logprob is computed only for requests that ask for it.
        job.stream = self.engine.add_request(job.request_id, prompt, read_sampling_params(request),
                                             cumulative_logprob=bool(job.flags["return_cumulative_logprob"]))
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
                new_tokens = accumulate(job, out)
                self.metrics.observe_tokens(out.metrics, job.last_token_time, new_tokens)
                if new_tokens and out.metrics is not None:
                    job.last_token_time = out.metrics.last_token_time
                if job.cancelled:
                    continue  # the abort's last delta; the client has gone
                if job.flags["stream"] and (new_tokens or out.finished):
                    if out.finished:
                        self._forget(job)
                    job.sender.send(build_response(job, out, delta=True), FINAL if out.finished else 0)
                    final_sent = out.finished
            if job.cancelled:
                self._forget(job)
                send_error(job.sender, "request cancelled", pb_utils.TritonError.CANCELLED)
            elif not final_sent:
                if out is None or not out.finished:
                    raise RuntimeError("engine stream ended before the request finished")
                self._forget(job)
                job.sender.send(build_response(job, out, delta=False), FINAL)
            final_sent = True
            self.metrics.observe_finished(out.metrics if out is not None else None)
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
