"""Time from starting the launcher (``python -m pagedbackend.serve``, the
shipped model repository) to a model that serves: a cold start (empty kernel
and inductor caches, as on a fresh machine after ``make setup``: the prepared
model is reused through a link) and warm restarts on the caches it left.

Each start reports: seconds until ``/v2/models/paged_llm/ready``, the time
to first token and the latency of a request sent at that moment (ready means
served now), and seconds until the compiled step takes over
(``pagedbackend:model_step_compiled``).
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


def gauge(url: str, name: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[-1])
    except OSError:
        return None
    return None


def one_start(cache: pathlib.Path, timeout_s: float, log_path: pathlib.Path) -> dict:
    from client import generate
    from pagedbackend.serving.harness import free_port
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
        while time.perf_counter() - started < timeout_s and process.poll() is None:
            try:
                with urllib.request.urlopen(f"{http}/v2/models/paged_llm/ready", timeout=2) as reply:
                    if reply.status == 200:
                        ready = time.perf_counter() - started
                        break
            except OSError:
                time.sleep(0.1)
        if ready is None:
            raise RuntimeError(f"not ready after {timeout_s:.0f} s: {log_path.read_text()[-2000:]}")
        result = generate(PROMPT, {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                          protocol="http", url=http, timeout=timeout_s)
        compiled = None
        while time.perf_counter() - started < timeout_s:
            if gauge(metrics, "pagedbackend:model_step_compiled") == 1.0:
                compiled = time.perf_counter() - started
                break
            time.sleep(0.5)
        return {"ready_s": round(ready, 2), "first_request_ttft_s": round(result.token_times[0][0], 3),
                "first_request_latency_s": round(result.latency, 3),
                "compiled_step_serves_after_s": None if compiled is None else round(compiled, 1)}
    finally:
        process.terminate()
        process.wait(timeout=60)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-starts", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per start at most")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--quick", action="store_true", help="one warm start, no cold one")
    args = ap.parse_args(argv)
    from pagedbackend.config import cache_root
    from pagedbackend.models.default_model import DEFAULT_MODEL_NAME, prepare_default_model
    prepared = prepare_default_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        cache = pathlib.Path(tmp) / "cache"
        cache.mkdir()
        (cache / DEFAULT_MODEL_NAME).symlink_to(prepared)
        if args.quick:   # the machine's own caches, warm
            cache = cache_root()
        kinds = ([] if args.quick else ["cold"]) + ["warm"] * (1 if args.quick else args.warm_starts)
        for i, kind in enumerate(kinds):
            row = {"start": kind, **one_start(cache, args.timeout, pathlib.Path(tmp) / f"start{i}.log")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = write_result(args.out, "startup", {"rows": rows, "prompt": PROMPT})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
