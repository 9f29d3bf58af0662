"""NVIDIA's AIPerf against our OpenAI API and vLLM's CPU server, with the same
flags, at several concurrencies: its metrics side by side.

AIPerf (``aiperf`` 0.13.0 on PyPI) runs in a virtual environment of its own:
``--aiperf`` or ``BENCH_AIPERF`` names its ``aiperf`` command; without one it is
installed on demand into ``$PAGEDBACKEND_CACHE/aiperf-venv`` (about a minute;
never part of ``make setup``). vLLM is found as in ``peers`` (``--vllm-python``
/ ``BENCH_VLLM_PYTHON``); a missing one is skipped with a message.

Each run: synthetic prompts of ``--isl`` tokens (AIPerf's own, seeded),
``--osl`` output tokens forced with ``ignore_eos`` and ``min_tokens``,
streamed ``/v1/completions``, ``--request-count`` requests per concurrency
after a warm-up. Our server is the shipped configuration (tritonserver and the
OpenAI API of ``make serve``), measured once its compiled step serves.

Where a first token's time goes: each server's Prometheus metrics are read
before and after each AIPerf run (warm-up included) and the means of the
run's requests reported beside AIPerf's TTFT: the engine's time from arrival
to the first token (``vllm:time_to_first_token_seconds``, both servers) and
its parts, waiting to be scheduled (``vllm:request_queue_time_seconds``) and
prefill (``vllm:request_prefill_time_seconds``); for ours also Triton's queue
before the model sees a request (``nv_inference_queue_duration_us``). What
AIPerf sees beyond the engine's TTFT is the HTTP front end, the gateway and
Triton, and the client itself.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional

from . import peer_servers
from .common import tool_command, write_result
from .peers import cpu_model

AIPERF_VERSION = "0.13.0"
# AIPerf's metric tags, the statistic we report of each, and its key in our rows.
METRICS = [("output_token_throughput", "avg", "output_token_throughput"),
           ("request_throughput", "avg", "request_throughput"),
           ("time_to_first_token", "p50", "time_to_first_token"),
           ("time_to_first_token", "avg", "time_to_first_token_avg"),
           ("inter_token_latency", "p50", "inter_token_latency"),
           ("inter_token_latency", "avg", "inter_token_latency_avg"),
           ("request_latency", "p50", "request_latency"), ("request_count", "avg", "request_count")]


def run_aiperf(aiperf: str, url: str, model: str, tokenizer: str, concurrency: int, requests: int,
               args, artifacts: pathlib.Path) -> dict:
    command = [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "completions",
               "--streaming", "--tokenizer", tokenizer, "--isl", str(args.isl), "--isl-stddev", "0",
               "--osl", str(args.osl), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
               "--extra-inputs", f"min_tokens:{args.osl}", "--concurrency", str(concurrency),
               "--request-count", str(requests), "--warmup-request-count", str(min(8, requests)),
               "--random-seed", str(args.seed), "--artifact-dir", str(artifacts), "--ui-type", "none"]
    started = time.perf_counter()
    # Not HF_HUB_OFFLINE: AIPerf then looks for the folder in the hub's cache, not on disk.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.time_limit, env=env)
    summary = next(iter(artifacts.rglob("profile_export_aiperf.json")), None)
    if done.returncode != 0 or summary is None:
        raise RuntimeError(f"aiperf exited with {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    return {"concurrency": concurrency, "requests": requests, "wall_s": round(time.perf_counter() - started, 1),
            **read_summary(json.loads(summary.read_text())), "command": " ".join(command)}


def read_summary(data: dict) -> Dict[str, Optional[float]]:
    """The metrics we report from AIPerf's profile_export_aiperf.json."""
    records = data.get("records", data)
    out = {}
    for tag, stat, key in METRICS:
        record = records.get(tag) if isinstance(records, dict) else None
        out[key] = None if not isinstance(record, dict) else record.get(stat)
    errors = data.get("error_summary") or []
    out["errors"] = sum(e.get("count", 1) for e in errors) if isinstance(errors, list) else errors
    return out


# Histograms (Prometheus sum and count) whose mean per request the run reports, and their scale to seconds.
SERVER_TIMES = {"vllm:time_to_first_token_seconds": ("engine_ttft_s", 1.0),
                "vllm:request_queue_time_seconds": ("engine_queue_s", 1.0),
                "vllm:request_prefill_time_seconds": ("engine_prefill_s", 1.0)}
TRITON_QUEUE = ("nv_inference_queue_duration_us", "nv_inference_request_success")


def scrape(metrics_url: Optional[str]) -> Dict[str, float]:
    """Every sample of the Prometheus text at ``metrics_url``, summed over labels ({} if unreachable)."""
    if not metrics_url:
        return {}
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    samples: Dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                samples[name] = samples.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
            except ValueError:
                pass
    return samples


def server_times(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, Optional[float]]:
    """Mean seconds per request of the server's own histograms over one run."""
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    out: Dict[str, Optional[float]] = {}
    for metric, (key, scale) in SERVER_TIMES.items():
        count = delta(metric + "_count")
        out[key] = round(delta(metric + "_sum") * scale / count, 4) if count > 0 else None
    queue_us, requests = delta(TRITON_QUEUE[0]), delta(TRITON_QUEUE[1])
    out["triton_queue_s"] = round(queue_us / 1e6 / requests, 4) if requests > 0 and TRITON_QUEUE[0] in after else None
    return out


def run_system(name: str, start_server, url: str, model: str, tokenizer: str, aiperf: str, args,
               out_dir: pathlib.Path, metrics_url=None) -> List[dict]:
    rows = []
    with start_server() as server:
        metrics = metrics_url(server) if callable(metrics_url) else metrics_url
        for concurrency in args.concurrency:
            requests = args.request_count or max(16, 3 * concurrency)
            try:
                before = scrape(metrics)
                row = run_aiperf(aiperf, url, model, tokenizer, concurrency, requests, args,
                                 out_dir / f"{name.replace(' ', '_')}-c{concurrency}")
                row.update(server_times(before, scrape(metrics)))
            except Exception as exc:
                row = {"concurrency": concurrency, "error": peer_servers.error_text(exc)}
            row["system"] = name
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    return rows


class _Ours:
    """tritonserver (shipped settings) and the OpenAI API in front of it."""

    def __init__(self, model: str, port: int, threads: int):
        self.model, self.port, self.threads = model, port, threads

    def __enter__(self):
        from loadtest.harness.triton import TritonServer
        from pagedbackend.serving.repository import make_model_repository
        from loadtest.harness.openai import OpenAIServer
        self.tmp = tempfile.mkdtemp(prefix="bench-aiperf-")
        repo = make_model_repository(self.tmp, {"model": self.model})
        env = {"OMP_NUM_THREADS": str(self.threads)} if self.threads else {}
        self.triton = TritonServer(repo, env=env, ready_timeout_s=900, wait_for_compiled_step=True)
        self.triton.start()
        self.api = OpenAIServer(self.triton.grpc_url, tokenizer=self.model, port=self.port)
        self.api.start()
        return self

    def __exit__(self, *exc):
        self.api.stop()
        self.triton.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def main(argv=None):
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench aiperf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default=env("BENCH_AIPERF"), help="the aiperf command (else installed here)")
    ap.add_argument("--vllm-python", default=env("BENCH_VLLM_PYTHON"), help="Python of vLLM's venv")
    ap.add_argument("--vllm-env", default=env("BENCH_VLLM_ENV"), help="shell file of exports for vLLM")
    ap.add_argument("--systems", default="ours,vllm")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--request-count", type=int, default=None, help="requests per run (default 3 x concurrency, >= 16)")
    ap.add_argument("--isl", type=int, default=200)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's --max-num-seqs (ours: the shipped 64)")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds per aiperf run at most")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--quick", action="store_true", help="concurrency 2, 4 requests of 16 tokens, ours only")
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.systems = [s for s in args.systems.split(",") if s]
    if args.quick:
        args.concurrency, args.request_count, args.isl, args.osl, args.systems = [2], 4, 32, 16, ["ours"]
    from pagedbackend.models.default_model import resolve_model_path
    from loadtest.harness.triton import free_port
    model_dir = str(resolve_model_path("default"))
    aiperf = tool_command(args.aiperf, "aiperf-venv", "aiperf", [[f"aiperf=={AIPERF_VERSION}"]])
    out_dir = pathlib.Path(args.out) / "aiperf"
    rows, skipped = [], []
    if "ours" in args.systems:
        port = free_port()
        rows += run_system("ours", lambda: _Ours("default", port, args.threads), f"http://127.0.0.1:{port}",
                           "paged_llm", model_dir, aiperf, args, out_dir,
                           metrics_url=lambda server: server.triton.metrics_url)
    if "vllm" in args.systems:
        python = args.vllm_python if args.vllm_python and os.access(args.vllm_python, os.X_OK) else None
        if python is None:
            skipped.append(f"vLLM: no Python at {args.vllm_python!r} (--vllm-python / BENCH_VLLM_PYTHON)")
        else:
            port = free_port()
            rows += run_system("vLLM CPU", lambda: peer_servers.vllm(python, model_dir, port, args.threads,
                                                                     args.max_num_seqs, args.vllm_env),
                               f"http://127.0.0.1:{port}", model_dir, model_dir, aiperf, args, out_dir,
                               metrics_url=f"http://127.0.0.1:{port}/metrics")
    for message in skipped:
        print(f"skipped: {message}", flush=True)
    ours = {r["concurrency"]: r for r in rows if r["system"] == "ours" and "error" not in r}
    for r in rows:
        base = ours.get(r["concurrency"])
        if r["system"] != "ours" and base and r.get("output_token_throughput"):
            r["ours_vs_this"] = round(base["output_token_throughput"] / r["output_token_throughput"], 2)
            if base.get("time_to_first_token_avg") and r.get("time_to_first_token_avg"):
                r["ours_ttft_avg_vs_this"] = round(base["time_to_first_token_avg"] / r["time_to_first_token_avg"], 2)
    path = write_result(args.out, "aiperf", {"cpu_model": cpu_model(), "isl": args.isl, "osl": args.osl,
                                             "rows": rows, "peers_skipped": skipped})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
