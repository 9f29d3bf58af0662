"""A short headless locust run against a tritonserver this command starts.

    python -m loadtest.run_locust --out results/loadtest [--model default] \
        [--users 4] [--run-time 30s] [--max-requests 40] [--workload alpaca] \
        [--protocol grpc|http|both|openai] [--arrival closed|poisson --rate 2]

``--protocol openai`` also starts the OpenAI-compatible API in front of the
server and sends the requests through it.

Writes ``summary.json`` and ``summary.csv`` (p50/p90/p99 of time to first
token, time per output token, inter-token latency and end-to-end latency,
request and token throughput, failures) plus locust's own CSV files. Exits
non-zero if any request failed.
"""
import argparse
import contextlib
import csv
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

LOCUSTFILE = pathlib.Path(__file__).with_name("locustfile.py")
METRICS = ("ttft", "tpot", "itl", "e2e")


def run_locust(http_url: str, grpc_url: str, out_dir, users: int = 4, run_time: str = "30s",
               max_requests: int = 40, workload: str = "alpaca", protocol: str = "grpc",
               arrival: str = "closed", rate: float = 1.0, algorithm: str = "greedy",
               max_output_tokens: int = 32, tokenizer: str = "", timeout: float = 900,
               openai_url: str = "") -> dict:
    """Run locust headless against a running server and summarise its final statistics."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    classes = {"grpc": ["GrpcStreamUser"], "http": ["HttpStreamUser"],
               "both": ["GrpcStreamUser", "HttpStreamUser"], "openai": ["OpenAIStreamUser"]}[protocol]
    users = max(users, len(classes))
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *classes, "--headless",
           "-u", str(users), "-r", str(users), "--run-time", run_time, "--stop-timeout", "120",
           "--csv", str(out / "locust"), "--stats-json", str(out / "locust_final.json"),
           "--host", http_url, "--grpc-url", grpc_url,
           "--workload", workload, "--algorithm", algorithm, "--arrival", arrival, "--rate", str(rate),
           "--max-requests", str(max_requests), "--max-output-tokens", str(max_output_tokens),
           "--only-summary", "--loglevel", "WARNING"]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    if openai_url:
        cmd += ["--openai-url", openai_url]
    env = {**os.environ, "PYTHONPATH": str(LOCUSTFILE.parent.parent)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    (out / "locust.log").write_text(proc.stdout + proc.stderr)
    summary = summarise(out / "locust_final.json", seconds)
    summary.update(command=" ".join(cmd[1:]), locust_exit_code=proc.returncode, workload=workload,
                   protocol=protocol, users=users, arrival=arrival,
                   rate=rate if arrival == "poisson" else None)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["metric", "count", "p50_ms", "p90_ms", "p99_ms", "mean_ms"])
        for name in METRICS:
            m = summary["metrics"].get(name)
            if m:
                writer.writerow([name, m["count"], m["p50_ms"], m["p90_ms"], m["p99_ms"], m["mean_ms"]])
    return summary


def read_final_stats(path) -> dict:
    """{(type, name): row} from the file loadtest/final_stats.py writes."""
    return {(row["type"], row["name"]): row for row in json.loads(pathlib.Path(path).read_text())}


def summarise(stats_json, seconds: float) -> dict:
    """The run's figures from the statistics locust held when it quit
    (``--stats-json``; see loadtest/final_stats.py)."""
    rows = read_final_stats(stats_json)
    metrics = {name: {k: row[k] for k in ("count", "p50_ms", "p90_ms", "p99_ms", "mean_ms")}
               for (kind, name), row in rows.items() if kind == "metric" and name in METRICS and row["count"]}
    requests = [r for (kind, name), r in rows.items() if name == "request" and kind != "metric"]
    done = sum(r["count"] - r["failures"] for r in requests)
    failures = sum(r["failures"] for r in requests)
    e2e = rows.get(("metric", "e2e"))
    tokens = e2e["content_length"] if e2e else 0
    # Rates over locust's own request window (excludes start-up of the locust process).
    rate = e2e["rate"] if e2e else 0.0
    return {"metrics": metrics, "requests": done, "failures": failures, "seconds": round(seconds, 2),
            "requests_per_s": rate, "output_tokens": int(tokens),
            "output_tokens_per_s": rate * tokens / e2e["count"] if e2e else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.run_locust", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/loadtest")
    ap.add_argument("--model", default="default", help="'default', 'tiny' or a model folder")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--run-time", default="60s")
    ap.add_argument("--max-requests", type=int, default=24)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--workload", default="alpaca")
    ap.add_argument("--algorithm", default="greedy")
    ap.add_argument("--protocol", default="both", choices=["grpc", "http", "both", "openai"])
    ap.add_argument("--arrival", default="closed", choices=["closed", "poisson"])
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="engine setting for the served model (repeatable)")
    args = ap.parse_args(argv)

    from loadtest.bench.common import bench_model
    from loadtest.harness.triton import TritonServer
    from pagedbackend.serving.repository import make_model_repository
    from loadtest.harness.openai import OpenAIServer
    settings = dict(s.split("=", 1) for s in args.set)
    settings["model"] = bench_model(args.model)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        repo = make_model_repository(pathlib.Path(tmp) / "repo", settings)
        server = stack.enter_context(TritonServer(repo))
        openai_url = ""
        if args.protocol == "openai":
            openai_url = stack.enter_context(OpenAIServer(server.grpc_url, tokenizer=settings["model"])).url
        print(f"server ready: {server.http_url} / {server.grpc_url} {openai_url}; running locust ...", flush=True)
        summary = run_locust(server.http_url, server.grpc_url, args.out, users=args.users,
                             run_time=args.run_time, max_requests=args.max_requests,
                             workload=args.workload, protocol=args.protocol, arrival=args.arrival,
                             rate=args.rate, algorithm=args.algorithm,
                             max_output_tokens=args.max_output_tokens, openai_url=openai_url)
    for name, m in summary["metrics"].items():
        print(f"{name:5s} n={m['count']:5d}  p50 {m['p50_ms']:8.1f} ms  p90 {m['p90_ms']:8.1f} ms  "
              f"p99 {m['p99_ms']:8.1f} ms")
    print(f"{summary['requests']} requests, {summary['failures']} failures, "
          f"{summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tokens/s; "
          f"summary in {args.out}/summary.json")
    return 1 if summary["failures"] or not summary["requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
