"""Locust users that stream completions from the paged_llm model.

``GrpcStreamUser`` streams over tritonclient gRPC, ``HttpStreamUser`` over the
HTTP ``generate_stream`` endpoint (server-sent events), ``OpenAIStreamUser``
through the OpenAI-compatible API (``--openai-url``; ``/v1/completions``, or
``/v1/chat/completions`` with ``--openai-chat``). Besides the request
itself, each completion reports custom metrics as locust requests of type
``metric``: ``ttft`` (time to first token), ``tpot`` (time per output token
after the first), ``itl`` (every inter-token gap), ``e2e`` (end-to-end latency,
with the output tokens as its response length). Error responses and streams
that end early count as failures.

Workloads are seeded synthetic traces (loadtest/workloads.py). Arrivals are
either closed-loop (each user sends its next request when the last one ends:
fixed concurrency) or Poisson at ``--rate`` requests/s over the whole run, sent
without waiting for earlier replies. The run ends when the last of its
``--max-requests`` requests has ended, or at locust's ``--run-time``, whichever
comes first; ``--stats-json`` saves the complete statistics at the end
(loadtest/final_stats.py). Only loopback addresses are used.

    locust -f loadtest/locustfile.py GrpcStreamUser --headless -u 4 -r 4 -t 30s \
        --host http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --workload alpaca
    locust -f loadtest/locustfile.py OpenAIStreamUser --headless -u 4 -r 4 -t 30s \
        --host http://127.0.0.1:8000 --openai-url http://127.0.0.1:9000
"""
import itertools
import threading
import time

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # gRPC's blocking calls must yield to other users

import gevent  # noqa: E402
import gevent.event  # noqa: E402
import numpy as np  # noqa: E402
from gevent.pool import Pool  # noqa: E402
from locust import User, constant, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402

from client.streaming import ServerError, collect, grpc_stream, http_stream, openai_stream  # noqa: E402
from loadtest import final_stats, workloads  # noqa: E402,F401  (final_stats: --stats-json)

ALGORITHMS = {
    "greedy": {"temperature": 0.0},
    "sample": {"temperature": 0.8, "top_p": 0.95},
    "parallel": {"temperature": 0.8, "n": 2},
    "beam": {"temperature": 0.0, "use_beam_search": True, "n": 2},
}


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--workload", default="alpaca", choices=sorted(workloads.WORKLOADS),
                        help="synthetic trace the prompts and output lengths come from")
    parser.add_argument("--algorithm", default="greedy", choices=sorted(ALGORITHMS))
    parser.add_argument("--arrival", default="closed", choices=["closed", "poisson"])
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second (whole run)")
    parser.add_argument("--max-requests", type=int, default=100, help="stop after this many requests")
    parser.add_argument("--max-output-tokens", type=int, default=64, help="cap on each output length")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="cap on each prompt length")
    parser.add_argument("--tokenizer", default="", help="tokenizer folder (default: the default model)")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000", help="OpenAI-compatible API")
    parser.add_argument("--openai-chat", action="store_true",
                        help="OpenAIStreamUser: /v1/chat/completions (the prompt as the user's message)")
    parser.add_argument("--seed", type=int, default=0)


class Workload:
    """The run's requests, shared by every user of this process."""

    def __init__(self, opts):
        from transformers import AutoTokenizer

        from pagedbackend.models.default_model import resolve_model_path
        tokenizer = AutoTokenizer.from_pretrained(opts.tokenizer or resolve_model_path("default"))
        trace = workloads.make_trace(opts.workload, opts.max_requests, opts.seed)
        trace = [workloads.Request(min(r.prompt_len, opts.max_prompt_tokens),
                                   min(r.output_len, opts.max_output_tokens),
                                   min(r.prefix_len, opts.max_prompt_tokens)) for r in trace]
        self.prompts = workloads.make_text_prompts(trace, tokenizer, opts.seed)
        self.output_lens = [r.output_len for r in trace]
        self.params = ALGORITHMS[opts.algorithm]
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._ended = 0
        self.pool = Pool()
        self.all_ended = gevent.event.Event()  # every request has had its answer or its failure
        if not self.prompts:
            self.all_ended.set()

    def take(self):
        with self._lock:
            i = next(self._next)
        if i >= len(self.prompts):
            return None
        params = {**self.params, "max_tokens": self.output_lens[i], "ignore_eos": True, "seed": i}
        return self.prompts[i], params

    def ended(self):
        with self._lock:
            self._ended += 1
            if self._ended == len(self.prompts):
                self.all_ended.set()


WORKLOAD = None


@events.test_start.add_listener
def _build_workload(environment, **_):
    global WORKLOAD
    WORKLOAD = Workload(environment.parsed_options)
    gevent.spawn(_quit_when_all_ended, environment, WORKLOAD)


def _quit_when_all_ended(environment, workload):
    """End the run once the last request has ended. The run is stopped from
    this greenlet, never from a user's: a user that stops the runner kills
    itself, and with it whatever it was still waiting for."""
    workload.all_ended.wait()
    environment.runner.quit()


class _StreamingUser(User):
    abstract = True
    protocol = ""
    wait_time = constant(0)

    @task
    def send(self):
        opts = self.environment.parsed_options
        if opts.arrival == "poisson":
            users = max(1, self.environment.runner.user_count)
            gevent.sleep(np.random.exponential(users / opts.rate))
        job = WORKLOAD.take()
        if job is None:
            raise StopUser()  # the run ends when the requests in flight have ended
        if opts.arrival == "poisson":
            WORKLOAD.pool.spawn(self._request, *job)
        else:
            self._request(*job)

    def _stream(self, prompt, params):
        opts = self.environment.parsed_options
        if self.protocol == "grpc":
            return grpc_stream(prompt, params, url=opts.grpc_url, exclude_input=True)
        if self.protocol == "openai":
            return openai_stream(prompt, params, url=opts.openai_url, chat=opts.openai_chat)
        return http_stream(prompt, params, url=self.host, exclude_input=True)

    def _request(self, prompt, params):
        try:
            self._send_and_report(prompt, params)
        finally:
            WORKLOAD.ended()

    def _send_and_report(self, prompt, params):
        fire = self.environment.events.request.fire
        start = time.perf_counter()
        try:
            result = collect(self._stream(prompt, params))
            if not result.finish_reasons or any(r in (None, "None") for r in result.finish_reasons):
                raise ServerError("the stream ended before every output finished")
        except Exception as exc:  # error responses and broken streams are failures
            fire(request_type=self.protocol, name="request", response_time=1000 * (time.perf_counter() - start),
                 response_length=0, exception=exc, context={})
            return
        elapsed = 1000 * (time.perf_counter() - start)
        tokens = sum(result.num_output_tokens)
        fire(request_type=self.protocol, name="request", response_time=elapsed, response_length=tokens,
             exception=None, context={})
        metric = lambda name, ms, length=0: fire(request_type="metric", name=name, response_time=ms,
                                                 response_length=length, exception=None, context={})
        metric("e2e", elapsed, tokens)
        if result.ttft is not None:
            metric("ttft", 1000 * result.ttft)
        if result.time_per_output_token is not None:
            metric("tpot", 1000 * result.time_per_output_token)
        arrivals = sorted({d.time for d in result.deltas if d.index == 0 and d.num_tokens})
        for earlier, later in zip(arrivals, arrivals[1:]):
            metric("itl", 1000 * (later - earlier))


class GrpcStreamUser(_StreamingUser):
    protocol = "grpc"


class HttpStreamUser(_StreamingUser):
    protocol = "http"


class OpenAIStreamUser(_StreamingUser):
    protocol = "openai"
