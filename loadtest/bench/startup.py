"""Time from starting the launcher (``python -m pagedbackend.serve``, the
shipped model repository) to a model that serves, and how fast it serves at
once: a cold start (empty kernel and inductor caches, as on a fresh machine:
the prepared model is reused through a link) after what ``make setup`` does
for the compiled step (``--prepare-only --build-step``, timed), warm
restarts on the caches it left, and with ``--no-package`` a first start
that finds no step package and builds it while serving.

Each start reports: seconds until ``/v2/models/paged_llm/ready``, the time
to first token and the latency of a request sent at that moment (ready means
served now), seconds until the compiled step serves
(``pagedbackend:model_step_compiled``), and, paired, the output tokens/s of
``--streams`` streams sent the moment the server is ready against the same
run once a minute has passed since ready.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

from .common import write_result

PROMPT = "The capital of France is"
TOPICS = ("the sea", "a city at night", "an old map", "a winter garden", "a train journey", "the moon",
          "a kitchen", "a library")


def gauge(url: str, name: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[-1])
    except OSError:
        return None
    return None


def burst(http: str, streams: int, max_tokens: int, timeout_s: float) -> dict:
    """``streams`` greedy requests at once, ``max_tokens`` each: output tokens/s."""
    from client import http_stream

    from .specdecode import closed_loop, summarise
    prompts = [f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (note {i})." for i in range(streams)]

    def stream(prompt):
        params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        for delta in http_stream(prompt, params, url=http, exclude_input=True, timeout=timeout_s):
            yield delta.num_tokens
    row = summarise(closed_loop(stream, prompts, streams))
    return {"tok_s": row["tok_s"], "tpot_ms_p50": row["tpot_ms_p50"], "errors": row["errors"]}


def one_start(cache: pathlib.Path, args, log_path: pathlib.Path) -> dict:
    from client import generate
    from loadtest.harness.triton import free_port
    ports = [free_port() for _ in range(3)]
    env = {**os.environ, "PAGEDBACKEND_CACHE": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)   # beside the prepared model, in this cache
    http, metrics = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[2]}/metrics"
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "pagedbackend.serve", "--http-port", str(ports[0]),
                                    "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = None
        while time.perf_counter() - started < args.timeout and process.poll() is None:
            try:
                with urllib.request.urlopen(f"{http}/v2/models/paged_llm/ready", timeout=2) as reply:
                    if reply.status == 200:
                        ready = time.perf_counter() - started
                        break
            except OSError:
                time.sleep(0.1)
        if ready is None:
            raise RuntimeError(f"not ready after {args.timeout:.0f} s: {log_path.read_text()[-2000:]}")
        row = {"ready_s": round(ready, 2), "compiled_at_ready": gauge(metrics, "pagedbackend:model_step_compiled") == 1.0}
        result = generate(PROMPT, {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                          protocol="http", url=http, timeout=args.timeout)
        row.update(first_request_ttft_s=round(result.token_times[0][0], 3),
                   first_request_latency_s=round(result.latency, 3))
        if args.streams:
            row["at_ready"] = burst(http, args.streams, args.max_tokens, args.timeout)
        compiled = None
        while time.perf_counter() - started < args.timeout:
            if gauge(metrics, "pagedbackend:model_step_compiled") == 1.0:
                compiled = time.perf_counter() - started
                break
            time.sleep(0.5)
        row["compiled_step_serves_after_s"] = None if compiled is None else round(compiled, 1)
        if args.streams:
            time.sleep(max(0.0, ready + args.later - (time.perf_counter() - started)))
            row["later"] = burst(http, args.streams, args.max_tokens, args.timeout)
            later = row["later"]["tok_s"]
            row["at_ready_vs_later"] = round(row["at_ready"]["tok_s"] / later, 3) if later else None
        return row
    finally:
        process.terminate()
        process.wait(timeout=60)


def setup_build(cache: pathlib.Path, log_path: pathlib.Path) -> float:
    """What ``make setup`` does for the compiled step, in ``cache``; its seconds."""
    env = {**os.environ, "PAGEDBACKEND_CACHE": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        subprocess.run([sys.executable, "-m", "pagedbackend.serve", "--prepare-only", "--build-step"],
                       env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return round(time.perf_counter() - started, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-starts", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32, help="streams of the paired runs (0: none)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per stream")
    ap.add_argument("--later", type=float, default=60.0, help="seconds after ready of the second run")
    ap.add_argument("--no-package", action="store_true", help="also a first start without make setup's "
                                                              "package (it builds one while serving)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per start at most")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--quick", action="store_true", help="one warm start on this machine's caches")
    args = ap.parse_args(argv)
    from pagedbackend.config import cache_root
    from pagedbackend.models.default_model import DEFAULT_MODEL_NAME, prepare_default_model
    prepared = prepare_default_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        def fresh_cache(name):
            cache = pathlib.Path(tmp) / name
            cache.mkdir()
            (cache / DEFAULT_MODEL_NAME).symlink_to(prepared)
            return cache
        if args.no_package:
            row = {"start": "first, no package", **one_start(fresh_cache("bare"), args, pathlib.Path(tmp) / "bare.log")}
            rows.append(row)
            print(json.dumps(row), flush=True)
        cache = cache_root() if args.quick else fresh_cache("cache")
        kinds = ["warm"] if args.quick else ["cold"] + ["warm"] * args.warm_starts
        for i, kind in enumerate(kinds):
            row = {"start": kind}
            if kind == "cold":
                row["setup_build_s"] = setup_build(cache, pathlib.Path(tmp) / "setup.log")
            row.update(one_start(cache, args, pathlib.Path(tmp) / f"start{i}.log"))
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = write_result(args.out, "startup", {"rows": rows, "prompt": PROMPT, "streams": args.streams,
                                              "max_tokens": args.max_tokens, "later_s": args.later})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
