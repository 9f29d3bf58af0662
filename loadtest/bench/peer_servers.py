"""The three servers of ``python -m loadtest.bench peers`` on loopback ports,
and one streaming request to each.

- ours: tritonserver through the project's launcher (``python -m
  pagedbackend.serve``), HTTP ``generate_stream`` (server-sent events);
- vLLM's CPU build: its OpenAI server, ``/v1/completions`` with ``stream``;
- llama.cpp's ``llama-server``: ``/completion`` with ``stream``.

Every stream function yields the number of new tokens of each event as it
arrives; the driver stamps the times.

Speculative decoding (vLLM 0.32 CPU and llama.cpp 11434, SmolLM2, this CPU):
vLLM takes ``--speculative-config JSON`` (``vllm(..., speculative_config=)``:
``ngram`` and ``draft_model`` run on its CPU backend); llama.cpp's server a
draft GGUF with ``-md F --spec-type draft-simple --spec-draft-n-max N``
(``llama(..., draft_gguf=, draft_max=)``; this build removed ``--draft-max``
and, without ``--spec-type``, loads the draft and never uses it) or a
draftless n-gram type (``spec_type="ngram-simple"``). Both count drafted and
accepted tokens in ``*:spec_decode_*`` counters on ``/metrics`` (llama.cpp
with ``--metrics``, always passed here): ``spec_counters`` reads them and
``draft_acceptance`` compares two readings. llama.cpp also reports one
request's ``draft_n`` / ``draft_n_accepted`` in its ``timings``.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable, Dict, Iterator, List, Optional, Sequence

HOST = "127.0.0.1"


def vllm_env(threads: int, env_file: Optional[str] = None, offline: bool = False) -> Dict[str, str]:
    """vLLM's CPU settings (RECIPES.md): ``env_file`` (shell ``export`` lines,
    read by bash) first, then what a fair side-by-side needs if it is unset;
    the thread count is always ``threads``, as for every other system."""
    env = dict(os.environ)
    if env_file:
        dump = subprocess.run(["bash", "-c", f'set -a; source "{env_file}"; env -0'],
                              check=True, capture_output=True).stdout
        env = dict(item.split("=", 1) for item in dump.decode().split("\0") if "=" in item)
    env.update({"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"})
    # A run held to AVX2 (ATEN_CPU_CAPABILITY=avx2, as a CPU without AVX-512):
    # vLLM 0.32's CPU build emits only token 0 when torch is held so, so its
    # GEMMs are held by oneDNN's and MKL's own variables instead (the rest of
    # vLLM keeps the CPU's instruction sets; BENCHMARKS.md, "peers").
    if env.pop("ATEN_CPU_CAPABILITY", "").strip().lower() == "avx2":
        env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        env.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                       "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                       # vLLM 0.32's AOT compile cache never reloads on CPU; the inductor one does.
                       "VLLM_USE_AOT_COMPILE": "0"}.items():
        env.setdefault(key, value)
    if offline:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def exit_description(returncode: int) -> str:
    """How a process ended, in words: its exit status, or the signal that
    killed it (SIGILL named as an instruction the CPU will not run)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    why = (" (an instruction this CPU will not run: build the binary for this machine)"
           if -returncode == signal.SIGILL else "")
    return f"was killed by {name}{why}"


def error_text(exc: BaseException, limit: int = 2000) -> str:
    """``exc`` as one string of at most about ``limit`` characters, keeping its
    start and its end (a server's last log lines say why it stopped)."""
    text = f"{type(exc).__name__}: {exc}"
    if len(text) <= limit:
        return text
    head = limit // 4
    return f"{text[:head]}\n[...]\n{text[-(limit - head):]}"


class Server:
    """A server process in its own process group: ``start`` waits until
    ``ready_path`` answers 200; ``stop`` sends SIGTERM, then SIGKILL."""

    def __init__(self, name: str, command: List[str], port: int, ready_path: str,
                 env: Optional[Dict[str, str]] = None, ready_timeout_s: float = 600.0):
        self.name, self.command, self.port, self.ready_path = name, command, port, ready_path
        self.env, self.ready_timeout_s = env, ready_timeout_s
        self.url = f"http://{HOST}:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"peers-{name}-", suffix=".log", delete=False)
        self.process: Optional[subprocess.Popen] = None
        self.ready_s: Optional[float] = None
        self.engine_counters: Optional[Callable[[], Dict[str, float]]] = None  # ours only
        # Run once ready, before any timed request (ours: until the compiled step serves).
        self.settle: Optional[Callable[[], None]] = None
        self.settle_s: Optional[float] = None

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        started = time.perf_counter()
        self.process = subprocess.Popen(self.command, env=self.env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        while time.perf_counter() - started < self.ready_timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} {exit_description(self.process.returncode)}; "
                                   f"its log ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as reply:
                    if reply.status == 200:
                        self.ready_s = time.perf_counter() - started
                        if self.settle is not None:
                            self.settle()
                            self.settle_s = time.perf_counter() - started
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        text = pathlib.Path(self.log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def ours(model: str, port: int, threads: int, settings: Dict[str, object], repo_dir: str) -> Server:
    """tritonserver with our model, through the launcher, engine settings in a
    copy of the model repository."""
    from loadtest.harness.triton import free_port
    from pagedbackend.serving.repository import make_model_repository
    repo = make_model_repository(repo_dir, {"model": model, **settings})
    metrics_port = free_port()
    command = [sys.executable, "-m", "pagedbackend.serve", "--model-repository", str(repo),
               "--http-port", str(port), "--grpc-port", str(free_port()),
               "--metrics-port", str(metrics_port)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    server = Server("ours", command, port, "/v2/health/ready", env)
    server.engine_counters = lambda: engine_counters(f"http://{HOST}:{metrics_port}/metrics")
    if str(settings.get("compile", True)).lower() not in ("false", "0"):
        server.settle = lambda: wait_for_gauge(f"http://{HOST}:{metrics_port}/metrics",
                                               "pagedbackend:model_step_compiled", 1.0)
    return server


def gauge_value(url: str, name: str) -> Optional[float]:
    """One gauge from a Prometheus text page (the first series), or None."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[-1])
    return None


def wait_for_gauge(url: str, name: str, value: float, timeout_s: float = 900.0) -> None:
    """Until the gauge reads ``value`` (our server compiles its step after it is ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if gauge_value(url, name) == value:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not reach {value} within {timeout_s:.0f} s")


ENGINE_COUNTERS = ("engine_steps_total", "engine_step_seconds_total", "engine_forward_seconds_total",
                   "engine_sample_seconds_total", "generation_tokens_total")


def engine_counters(url: str, settle_s: float = 5.0) -> Dict[str, float]:
    """Our engine's step counters from tritonserver's ``/metrics``, summed over
    models, once two scrapes 0.2 s apart agree (at most ``settle_s``): the
    model reports its counters one after another, and a scrape between two of
    them (a step's time counted, its forward not yet) would put that step's
    forward into the next difference without its step."""
    def scrape() -> Dict[str, float]:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        values = dict.fromkeys(ENGINE_COUNTERS, 0.0)
        for line in text.splitlines():
            name, _, rest = line.partition("{")
            name = name.removeprefix("pagedbackend:")
            if name in values and line.startswith("pagedbackend:"):
                values[name] += float(rest.rsplit(" ", 1)[-1])
        return values
    deadline, values = time.monotonic() + settle_s, scrape()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        again = scrape()
        if again == values:
            break
        values = again
    return values


def step_breakdown(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """Mean step, forward and sampling time inside the server between two scrapes."""
    delta = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
    steps = delta["engine_steps_total"]
    if steps <= 0:
        return {}
    return {"server_steps": int(steps),
            "server_step_ms_mean": round(1000 * delta["engine_step_seconds_total"] / steps, 2),
            "server_forward_ms_mean": round(1000 * delta["engine_forward_seconds_total"] / steps, 2),
            "server_sample_ms_mean": round(1000 * delta["engine_sample_seconds_total"] / steps, 2),
            "server_tokens_per_step": round(delta["generation_tokens_total"] / steps, 2)}


def vllm(python: str, model_dir: str, port: int, threads: int, max_num_seqs: int,
         env_file: Optional[str] = None, speculative_config: Optional[dict] = None) -> Server:
    """vLLM's OpenAI server; ``speculative_config`` (e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``)
    goes to ``--speculative-config`` as JSON."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs),
               "--host", HOST, "--port", str(port)]
    if speculative_config:
        command += ["--speculative-config", json.dumps(speculative_config)]
    return Server("vllm", command, port, "/health", vllm_env(threads, env_file))


# llama.cpp's draftless speculative types whose draft length and n-gram size have flags of their own.
LLAMA_NGRAM_FLAGS = {"ngram-simple": ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m"),
                     "ngram-map-k": ("--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m"),
                     "ngram-map-k4v": ("--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m")}


def llama_spec_args(draft_gguf: Optional[str] = None, draft_max: int = 4,
                    spec_type: Optional[str] = None, ngram_size: int = 3) -> List[str]:
    """llama-server's speculative flags: a draft GGUF (``draft-simple``: this
    build does not infer the type from an ordinary model, so without
    ``--spec-type`` the draft is loaded and never used) drafting ``draft_max``
    tokens, or a draftless type (``ngram-simple``: the ``draft_max`` tokens that
    followed the last earlier match of the last ``ngram_size`` tokens)."""
    if spec_type is None and draft_gguf is None:
        return []
    spec_type = spec_type or "draft-simple"
    args = ["--spec-type", spec_type]
    if draft_gguf:
        args += ["-md", draft_gguf]
    if spec_type.startswith("draft") or draft_gguf:
        args += ["--spec-draft-n-max", str(draft_max)]
    if spec_type in LLAMA_NGRAM_FLAGS:
        size_n, size_m = LLAMA_NGRAM_FLAGS[spec_type]
        args += [size_n, str(ngram_size), size_m, str(draft_max)]
    elif spec_type == "ngram-mod":
        args += ["--spec-ngram-mod-n-match", str(ngram_size), "--spec-ngram-mod-n-min", "1",
                 "--spec-ngram-mod-n-max", str(draft_max)]
    return args


def llama(binary: str, gguf: str, port: int, threads: int, slots: int, name: str = "llama",
          draft_gguf: Optional[str] = None, draft_max: int = 4, spec_type: Optional[str] = None,
          ngram_size: int = 3, extra_args: Sequence[str] = ()) -> Server:
    """Continuous batching is on by default; each slot holds 512 positions.
    ``draft_gguf`` / ``spec_type``: speculative decoding (``llama_spec_args``);
    ``/metrics`` is on, for ``spec_counters``. A ``GGML_NATIVE`` build on a CPU
    that reports AMX but refuses it dies of SIGILL on a quantised GGUF (target
    or draft): build with ``-mno-amx-*`` or pass ``extra_args=["--no-repack"]``."""
    command = [binary, "-m", gguf, "--host", HOST, "--port", str(port), "-np", str(slots),
               "-c", str(512 * slots), "-t", str(threads), "-tb", str(threads), "--no-webui", "--metrics"]
    command += llama_spec_args(draft_gguf, draft_max, spec_type, ngram_size) + list(extra_args)
    return Server(name, command, port, "/health")


# ---------------------------------------------------------------- draft acceptance

_SPEC_LINE = re.compile(r'^(vllm|llamacpp):spec_decode_(num_\w+?)(_total|_created)?(?:\{([^}]*)\})? (\S+)$')


def parse_spec_counters(text: str) -> Dict[str, float]:
    """The ``spec_decode_*`` counters of a Prometheus page, vLLM's (``vllm:``)
    or llama.cpp's (``llamacpp:``), summed over series: ``num_drafts``
    (verifications), ``num_draft_tokens``, ``num_accepted_tokens`` and
    ``num_accepted_tokens_per_pos[i]``."""
    values: Dict[str, float] = {}
    for line in text.splitlines():
        match = _SPEC_LINE.match(line.strip())
        if match and match.group(3) != "_created":   # vLLM's creation timestamps
            position = re.search(r'position="(\d+)"', match.group(4) or "")
            key = match.group(2) + (f"[{position.group(1)}]" if position else "")
            values[key] = values.get(key, 0.0) + float(match.group(5))
    return values


def spec_counters(server_or_url) -> Dict[str, float]:
    """A peer's speculative counters now, from its ``/metrics`` (a ``Server`` or
    a base URL); empty when it exports none or does not answer."""
    url = getattr(server_or_url, "url", server_or_url).rstrip("/")
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            return parse_spec_counters(reply.read().decode())
    except OSError:
        return {}


def draft_acceptance(before: Dict[str, float], after: Dict[str, float]) -> Optional[dict]:
    """Draft tokens, accepted tokens, their ratio, mean tokens accepted per
    verification and the share of verifications accepting position i, between
    two ``spec_counters`` readings; None when nothing was drafted."""
    grew = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafted = grew.get("num_draft_tokens", 0.0)
    if drafted <= 0:
        return None
    accepted = grew.get("num_accepted_tokens", 0.0)
    verifications = grew.get("num_drafts", 0.0)
    positions = sorted((int(k.split("[")[1][:-1]), v) for k, v in grew.items()
                       if k.startswith("num_accepted_tokens_per_pos["))
    return {"draft_tokens": int(drafted), "accepted_tokens": int(accepted),
            "acceptance_rate": round(accepted / drafted, 4), "verifications": int(verifications),
            "accepted_per_verification": round(accepted / verifications, 3) if verifications else None,
            "accepted_per_position": [round(v / verifications, 4) for _, v in positions] if verifications else []}


# ---------------------------------------------------------------- streams

def _events(url: str, body: dict, timeout: float) -> Iterator[dict]:
    from client.streaming import sse_events
    return sse_events(url, body, timeout)


def stream_ours(url: str, prompt: str, max_tokens: int, timeout: float) -> Iterator[int]:
    from client import http_stream
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    for delta in http_stream(prompt, params, url=url, exclude_input=True, timeout=timeout):
        yield delta.num_tokens


def stream_vllm(url: str, model: str, prompt, max_tokens: int, timeout: float) -> Iterator[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    for event in _events(url + "/v1/completions", body, timeout):
        for choice in event.get("choices", []):
            ids = choice.get("token_ids")
            yield len(ids) if ids is not None else int(bool(choice.get("text")))


def stream_llama(url: str, prompt, max_tokens: int, timeout: float,
                 timings: Optional[dict] = None) -> Iterator[int]:
    """``timings``: filled with the last event's ``timings`` (with a draft model,
    ``draft_n`` and ``draft_n_accepted`` of this request)."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": False, "stream": True, "return_tokens": True}
    for event in _events(url + "/completion", body, timeout):
        if timings is not None and isinstance(event.get("timings"), dict):
            timings.update(event["timings"])
        ids = event.get("tokens")
        yield len(ids) if ids is not None else int(bool(event.get("content")))


def complete_llama(url: str, prompt_ids: List[int], max_tokens: int, timeout: float) -> List[int]:
    """One non-streamed request of token ids; returns the generated ids."""
    body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True}
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return list(json.load(reply).get("tokens") or [])
