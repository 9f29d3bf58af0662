"""Stopping ``make serve`` by every documented route, with a long stream open
on each API: Ctrl-C or SIGTERM to make's process group, SIGTERM to the
launcher, SIGTERM to tritonserver. Every open stream ends at once with an
explicit error (on the OpenAI API an SSE error event, never a plain
``[DONE]``), tritonserver exits 0 without SIGKILL and nothing is left running."""
import json
import os
import pathlib
import signal
import subprocess
import threading
import time

import httpx
import pytest

from strict_json import strict_loads
from client import http_stream
from loadtest.tiny_model import build_tiny_llama
from pagedbackend.serving.constants import EXIT_TIMEOUT_S
from loadtest.harness.triton import free_port
from processes import alive, children_of, processes_mentioning

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
STREAM_TOKENS = 2000
# The exit timeout, the launcher's margin, and the time the streams take to close.
STOP_LIMIT_S = EXIT_TIMEOUT_S + 5 + 10


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_long"), max_position_embeddings=4096)


class Serve:
    """``make serve`` on free ports with the long-context tiny model."""

    def __init__(self, model: str, log_path: pathlib.Path):
        self.ports = {name: free_port() for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT")}
        env = {**os.environ, "PAGEDBACKEND_MODEL": model, "PAGEDBACKEND_NUM_KV_BLOCKS": "320",
               "PAGEDBACKEND_DEVICE": "cpu", "PAGEDBACKEND_COMPILE": "false"}
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.make = subprocess.Popen(["make", "-s", "-C", str(REPO), "-o", ".venv/.installed", "-o", ".venv/.step-built", "serve",
                                          *(f"{k}={v}" for k, v in self.ports.items())],
                                         env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.openai = f"http://127.0.0.1:{self.ports['OPENAI_PORT']}"
        self.http = f"http://127.0.0.1:{self.ports['HTTP_PORT']}"

    def wait_ready(self, timeout_s: float = 240) -> None:
        """Both APIs answer: the OpenAI /health (which asks Triton over gRPC)
        and Triton's HTTP endpoint, which tritonserver opens just after gRPC."""
        deadline, health = time.monotonic() + timeout_s, {}
        urls = {"openai": f"{self.openai}/health", "triton": f"{self.http}/v2/health/ready"}
        while time.monotonic() < deadline and self.make.poll() is None and set(health.values()) != {200}:
            for name, url in urls.items():
                try:
                    health[name] = httpx.get(url, timeout=2).status_code
                except httpx.HTTPError as exc:
                    health[name] = repr(exc)
            time.sleep(0.2)
        assert set(health.values()) == {200}, (health, self.log()[-3000:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def processes(self) -> dict:
        grpc = self.ports["GRPC_PORT"]
        tritonserver = processes_mentioning(f"--grpc-port={grpc}")
        return {"tritonserver": tritonserver, "stubs": children_of(tritonserver),
                "launcher": processes_mentioning(f"--grpc-port\0{grpc}"),
                "openai": processes_mentioning(f"--port\0{self.ports['OPENAI_PORT']}"),
                "make": [self.make.pid]}


def triton_stream(serve: Serve, outcome: dict, started: threading.Event) -> None:
    tokens = 0
    try:
        for delta in http_stream("Tell me a long story", {"max_tokens": STREAM_TOKENS, "ignore_eos": True},
                                 url=serve.http, exclude_input=True, timeout=120):
            tokens += delta.num_tokens
            started.set()
        outcome.update(result="finished", tokens=tokens)
    except Exception as exc:
        outcome.update(result="error", error=str(exc), tokens=tokens)


def openai_stream(serve: Serve, outcome: dict, started: threading.Event) -> None:
    events = []
    body = {"prompt": "Tell me a long story", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{serve.openai}/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
        outcome.update(result="ended", events=events)
    except httpx.HTTPError as exc:
        outcome.update(result="cut", error=repr(exc), events=events)


def signal_route(serve: Serve, route: str, procs: dict) -> None:
    if route == "make group SIGTERM":
        os.killpg(serve.make.pid, signal.SIGTERM)
    elif route == "make group SIGINT (Ctrl-C)":
        os.killpg(serve.make.pid, signal.SIGINT)
    elif route == "launcher SIGTERM":
        os.kill(procs["launcher"][0], signal.SIGTERM)
    else:
        os.kill(procs["tritonserver"][0], signal.SIGTERM)


ROUTES = ["make group SIGTERM", "make group SIGINT (Ctrl-C)", "launcher SIGTERM", "tritonserver SIGTERM"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("route", ROUTES)
def test_every_stop_route_ends_open_streams_with_an_error_and_exits_cleanly(long_context_model, tmp_path, route):
    serve = Serve(str(long_context_model), tmp_path / "make.log")
    try:
        serve.wait_ready()
        procs = serve.processes()
        assert all(len(procs[k]) == 1 for k in ("tritonserver", "launcher", "openai")) and procs["stubs"], procs
        outcomes = {"triton": {}, "openai": {}}
        threads = []
        for name, run in (("triton", triton_stream), ("openai", openai_stream)):
            started = threading.Event()
            thread = threading.Thread(target=run, args=(serve, outcomes[name], started), daemon=True)
            thread.start()
            deadline = time.monotonic() + 60
            while not started.wait(0.2) and thread.is_alive() and time.monotonic() < deadline:
                pass
            assert started.is_set(), f"the {name} stream did not start: {outcomes[name]} {serve.log()[-2000:]}"
            threads.append(thread)
        time.sleep(0.5)
        signalled = time.monotonic()
        signal_route(serve, route, procs)
        for thread in threads:
            thread.join(STOP_LIMIT_S)
        streams_s = time.monotonic() - signalled
        make_status = serve.make.wait(STOP_LIMIT_S)
        everything = [pid for pids in procs.values() for pid in pids]
        while any(alive(pid) for pid in everything) and time.monotonic() - signalled < STOP_LIMIT_S:
            time.sleep(0.1)
        left = [pid for pid in everything if alive(pid)]
    finally:
        if serve.make.poll() is None:
            os.killpg(serve.make.pid, signal.SIGKILL)
            serve.make.wait()
    log = serve.log()
    triton, openai = outcomes["triton"], outcomes["openai"]
    assert triton["result"] == "error" and "shutting down" in triton["error"], (triton, log[-3000:])
    assert 0 < triton["tokens"] < STREAM_TOKENS
    events = openai["events"]
    assert openai["result"] == "ended", (openai, log[-3000:])
    payloads = [strict_loads(e) for e in events if e != "[DONE]"]
    assert "error" in payloads[-1] and "shutting down" in payloads[-1]["error"]["message"], events[-3:]
    assert all(c["finish_reason"] is None for p in payloads[:-1] for c in p.get("choices", [])), events[-3:]
    assert streams_s < STOP_LIMIT_S and not left, (streams_s, left, log[-3000:])
    assert "stopped: tritonserver exited with status 0" in log, log[-3000:]
    assert "killed by" not in log and "Signal (11)" not in log, log[-3000:]
    if route in ("launcher SIGTERM", "tritonserver SIGTERM"):
        assert make_status == 0, log[-3000:]
