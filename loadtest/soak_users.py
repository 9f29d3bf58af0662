"""Locust users for the soak (``python -m loadtest.soak``): streaming requests
over gRPC and HTTP, of which a share is cancelled part-way and a share is
deliberately bad.

Each task is one of:

- a normal stream (greedy, ``ignore_eos``): it must end with finish reason
  ``length`` and exactly ``max_tokens`` tokens; reported as ``ok`` with its
  time to first token as a ``ttft`` metric;
- a cancelled stream (``--cancel-ratio``): the client hangs up after 1-5
  deltas; reported as ``cancel``;
- a bad request (``--bad-ratio``), one of ``BAD_REQUESTS``: it must be refused
  with an error that names the problem; reported as ``bad:<kind>``.

Anything else (an error where none was due, a wrong token count, a success
where an error was due, a broken connection) is a locust failure: an
unexpected failure of the soak. Loopback addresses only.
"""
import random
import re
import time

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # gRPC's blocking calls must yield to other users

from locust import User, constant, events, task  # noqa: E402

from client.streaming import ServerError, collect, grpc_stream, http_stream  # noqa: E402
from loadtest import final_stats  # noqa: E402,F401  (--stats-json)

WORDS = ("the server keeps serving while clients come and go and some of them send "
         "strange things that it must refuse with a clear message").split()


def bad_requests(max_num_seqs: int, max_model_len: int, max_prompt_chars: int):
    """kind -> (prompt, sampling parameters, pattern the error must match)."""
    return {
        "negative-temperature": ("Hello", {"temperature": -1.0}, r"temperature"),
        "unknown-parameter": ("Hello", {"colour": "blue"}, r"colour"),
        "empty-prompt": ("", {"max_tokens": 4}, r"empty"),
        "too-many-sequences": ("Hello", {"n": max_num_seqs + 1, "temperature": 0.8, "max_tokens": 2},
                               r"max_num_seqs"),
        "prompt-over-char-limit": ("x" * (max_prompt_chars + 1), {"max_tokens": 2}, r"max_prompt_chars"),
        "prompt-over-context": ("word " * (max_model_len + 16), {"max_tokens": 2},
                                r"context length|max_prompt_chars"),
        "logprobs-beyond-vocabulary": ("Hello", {"max_tokens": 4, "logprobs": 1_000_000},
                                       r"logprobs|failed while sampling"),
        "stop-token-beyond-vocabulary": ("Hello", {"max_tokens": 4, "min_tokens": 1,
                                                   "stop_token_ids": [1_000_000_000]},
                                         r"stop_token_ids|vocabulary|failed while sampling"),
    }


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--cancel-ratio", type=float, default=0.10)
    parser.add_argument("--bad-ratio", type=float, default=0.05)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-words", type=int, default=120)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the server's setting")
    parser.add_argument("--max-model-len", type=int, default=8192, help="the server's setting")
    parser.add_argument("--max-prompt-chars", type=int, default=131072, help="the server's setting")
    parser.add_argument("--seed", type=int, default=0)


class _SoakUser(User):
    abstract = True
    protocol = ""
    wait_time = constant(0)
    _ids = iter(range(10 ** 9))

    def on_start(self):
        opts = self.environment.parsed_options
        self.rng = random.Random(opts.seed * 1000 + next(_SoakUser._ids))
        self.bad = bad_requests(opts.max_num_seqs, opts.max_model_len, opts.max_prompt_chars)

    def _stream(self, prompt, params):
        opts = self.environment.parsed_options
        if self.protocol == "grpc":
            return grpc_stream(prompt, params, url=opts.grpc_url, exclude_input=True, timeout=600)
        return http_stream(prompt, params, url=self.host, exclude_input=True, timeout=600)

    def _fire(self, name, start, exception=None, length=0):
        self.environment.events.request.fire(
            request_type=self.protocol, name=name, response_time=1000 * (time.perf_counter() - start),
            response_length=length, exception=exception, context={})

    @task
    def one_request(self):
        opts = self.environment.parsed_options
        draw = self.rng.random()
        if draw < opts.bad_ratio:
            self._bad(*self.rng.choice(sorted(self.bad.items())))
            return
        words = self.rng.randint(3, opts.max_prompt_words)
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(words))
        params = {"max_tokens": self.rng.randint(4, opts.max_output_tokens), "temperature": 0.0,
                  "ignore_eos": True}
        if draw < opts.bad_ratio + opts.cancel_ratio:
            self._cancelled(prompt, params)
        else:
            self._normal(prompt, params)

    def _normal(self, prompt, params):
        start = time.perf_counter()
        try:
            result = collect(self._stream(prompt, params))
            if result.finish_reasons != ["length"] or result.num_output_tokens != [params["max_tokens"]]:
                raise ServerError(f"expected {params['max_tokens']} tokens and finish reason length, got "
                                  f"{result.num_output_tokens} and {result.finish_reasons}")
        except Exception as exc:
            self._fire("ok", start, exc)
            return
        self._fire("ok", start, length=result.num_output_tokens[0])
        if result.ttft is not None:
            self.environment.events.request.fire(request_type="metric", name="ttft",
                                                 response_time=1000 * result.ttft, response_length=0,
                                                 exception=None, context={})

    def _cancelled(self, prompt, params):
        start = time.perf_counter()
        params = dict(params, max_tokens=max(params["max_tokens"], 16))
        hang_up_after = self.rng.randint(1, 5)
        deltas = self._stream(prompt, params)
        try:
            for received, _ in enumerate(deltas, start=1):
                if received >= hang_up_after:
                    break
        except Exception as exc:
            self._fire("cancel", start, exc)
            return
        finally:
            deltas.close()  # hangs up: the server must notice and free the request's blocks
        self._fire("cancel", start)

    def _bad(self, kind, spec):
        prompt, params, pattern = spec
        start = time.perf_counter()
        try:
            collect(self._stream(prompt, params))
        except ServerError as exc:
            if re.search(pattern, str(exc)):
                self._fire(f"bad:{kind}", start)
            else:
                self._fire(f"bad:{kind}", start, ServerError(f"refused, but not naming /{pattern}/: {exc}"))
            return
        except Exception as exc:
            self._fire(f"bad:{kind}", start, exc)
            return
        self._fire(f"bad:{kind}", start, ServerError("served a request that must be refused"))


class GrpcSoakUser(_SoakUser):
    protocol = "grpc"


class HttpSoakUser(_SoakUser):
    protocol = "http"
