"""The soak: a real tritonserver over the shipped model repository (the
default config and model unless told otherwise) under locust for a bounded
time, with gRPC and HTTP users, 10 % of requests cancelled part-way and 5 %
deliberately bad (loadtest/soak_users.py).

    python -m loadtest.soak [--minutes 10] [--users 8] [--model default|tiny|FOLDER]
                            [--set FIELD=VALUE ...] [--out results/soak]

Prints the requests of each kind, the unexpected failures, p50/p99 time to
first token, the Python stub's resident memory at the start and end (and its
growth), and the KV blocks still in use once the server is idle. Exits
non-zero on any unexpected failure, a leaked block, a failed idle check, a
server that no longer serves, or a crash in its log. Writes summary.json,
locust's CSV files and the server log to --out.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from loadtest.run_locust import read_final_stats, summarise

USERS_FILE = pathlib.Path(__file__).with_name("soak_users.py")
CRASH_MARKS = ("Signal (11)", "Signal (6)", "Signal (7)", "Segmentation fault", "terminate called",
               "engine failed", "idle but not clean")


def stub_pid(server_pid: int) -> int:
    """The Python backend stub among the server's process group."""
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[2]) == server_pid and b"triton_python_backend_stub" in cmdline:
            return int(entry.name)
    raise RuntimeError(f"no Python backend stub in process group {server_pid}")


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def metric(server, name: str) -> float:
    prefix = f'pagedbackend:{name}{{model="paged_llm",version="1"}} '
    for line in server.metrics().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise RuntimeError(f"pagedbackend:{name} is not on /metrics")


def wait_idle(server, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(metric(server, n) == 0 for n in ("num_requests_running", "num_requests_waiting",
                                                "kv_blocks_used")):
            return True
        time.sleep(0.5)
    return False


def serving_limits(repo: pathlib.Path) -> dict:
    """The served model's max_num_seqs, max_model_len and max_prompt_chars."""
    from pagedbackend.config import engine_config
    from pagedbackend.engine.llm_engine import PROMPT_CHARS_PER_TOKEN
    from pagedbackend.models.default_model import resolve_model_path
    from pagedbackend.serving.repository import read_parameters
    config = engine_config(read_parameters((repo / "paged_llm" / "config.pbtxt").read_text()), {})
    model_config = json.loads((resolve_model_path(config.model) / "config.json").read_text())
    model_len = min(config.max_model_len or 10 ** 9, model_config["max_position_embeddings"])
    return {"max_num_seqs": config.max_num_seqs, "max_model_len": model_len,
            "max_prompt_chars": config.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * model_len}


def run_soak(out: pathlib.Path, minutes: float, users: int, settings: dict, seed: int = 0,
             max_output_tokens: int = 32) -> dict:
    """Start a server over a copy of the shipped repository with ``settings`` and soak it."""
    from loadtest.harness.triton import TritonServer
    from pagedbackend.serving.repository import make_model_repository
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_model_repository(pathlib.Path(tmp) / "repo", settings)
        with TritonServer(repo, ready_timeout_s=600, log_path=out / "server.log") as server:
            return soak(server, serving_limits(repo), out, minutes, users, seed, max_output_tokens)


def soak(server, limits: dict, out: pathlib.Path, minutes: float, users: int, seed: int = 0,
         max_output_tokens: int = 32) -> dict:
    """Soak a running server (``limits``: see ``serving_limits``) and summarise."""
    from client import generate
    out.mkdir(parents=True, exist_ok=True)
    stub = stub_pid(server.process.pid)
    for i in range(3):  # warm-up, so the baseline holds what every request needs
        generate(f"Warm up {i}", {"max_tokens": 4, "temperature": 0.0}, url=server.grpc_url)
    rss_start = rss_max = rss_mb(stub)
    log_start = server.log_path.stat().st_size
    cmd = [sys.executable, "-m", "locust", "-f", str(USERS_FILE), "GrpcSoakUser", "HttpSoakUser",
           "--headless", "-u", str(users), "-r", str(users), "--run-time", f"{int(minutes * 60)}s",
           "--stop-timeout", "120", "--csv", str(out / "locust"), "--stats-json", str(out / "locust_final.json"),
           "--host", server.http_url,
           "--grpc-url", server.grpc_url, "--seed", str(seed), "--max-output-tokens", str(max_output_tokens),
           "--max-num-seqs", str(limits["max_num_seqs"]), "--max-model-len", str(limits["max_model_len"]),
           "--max-prompt-chars", str(limits["max_prompt_chars"]), "--only-summary", "--loglevel", "WARNING"]
    started = time.perf_counter()
    series = [(0, round(rss_start, 1))]   # (seconds, stub RSS in MB), one a minute
    with open(out / "locust.log", "w") as log:
        locust = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  cwd=pathlib.Path(__file__).resolve().parents[1])
        while locust.poll() is None:
            rss = rss_mb(stub)
            rss_max = max(rss_max, rss)
            if time.perf_counter() - started >= 60 * len(series):
                series.append((round(time.perf_counter() - started), round(rss, 1)))
            time.sleep(2)
    seconds = time.perf_counter() - started
    (out / "stub_rss.csv").write_text("seconds,rss_mb\n" + "".join(f"{t},{m}\n" for t, m in series))
    idle = wait_idle(server)
    leaked = metric(server, "kv_blocks_used")
    idle_check_failures = metric(server, "idle_leak_checks_failed_total")
    rss_end = rss_mb(stub)
    try:
        after = generate("Still serving?", {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                         url=server.grpc_url, timeout=120)
        serving = after.num_output_tokens == [4]
    except Exception:
        serving = False
    with open(server.log_path, "rb") as f:
        f.seek(log_start)
        log_text = f.read().decode(errors="replace")
    return summarise_soak(out, seconds, locust.returncode, rss_start, rss_max, rss_end, idle, leaked,
                          idle_check_failures, serving, [m for m in CRASH_MARKS if m in log_text], minutes, users,
                          series)


def summarise_soak(out, seconds, locust_code, rss_start, rss_max, rss_end, idle, leaked,
                   idle_check_failures, serving, crash_marks, minutes, users, series=()) -> dict:
    import csv
    base = summarise(out / "locust_final.json", seconds)
    kinds = {}
    for (kind, name), row in read_final_stats(out / "locust_final.json").items():
        if kind in ("grpc", "http"):
            kind = "bad" if name.startswith("bad:") else name
            kinds[kind] = kinds.get(kind, 0) + row["count"]
    failures = []
    failures_csv = out / "locust_failures.csv"
    if failures_csv.exists():
        with open(failures_csv, newline="") as f:
            failures = [f"{r['Method']} {r['Name']} x{r['Occurrences']}: {r['Error'][:200]}" for r in csv.DictReader(f)]
    ttft = base["metrics"].get("ttft", {})
    summary = {
        "minutes": minutes, "users": users, "seconds": round(seconds, 1),
        "requests": sum(kinds.values()), "by_kind": kinds, "unexpected_failures": base["failures"],
        "failure_examples": failures[:20], "ttft_p50_ms": ttft.get("p50_ms"), "ttft_p99_ms": ttft.get("p99_ms"),
        "stub_rss_mb": {"start": round(rss_start, 1), "max": round(rss_max, 1), "end": round(rss_end, 1),
                        "growth": round(rss_end - rss_start, 1),
                        "halfway": series[len(series) // 2][1] if series else None},
        "idle_after_run": idle, "leaked_blocks": leaked, "idle_check_failures": idle_check_failures,
        "serving_after_run": serving, "crash_marks_in_server_log": crash_marks, "locust_exit_code": locust_code,
    }
    summary["ok"] = (summary["unexpected_failures"] == 0 and summary["requests"] > 0 and idle and leaked == 0
                     and idle_check_failures == 0 and serving and not crash_marks)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--users", type=int, default=8, help="half gRPC, half HTTP")
    ap.add_argument("--model", default="default", help="'default' (the shipped config), 'tiny' or a folder")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="engine setting for the served model (repeatable)")
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/soak")
    args = ap.parse_args(argv)

    from loadtest.bench.common import bench_model
    settings = dict(s.split("=", 1) for s in args.set)
    if args.model != "default":
        settings["model"] = bench_model(args.model)
    print(f"soak: {args.minutes:g} min, {args.users} users, model {args.model}; output in {args.out}", flush=True)
    s = run_soak(pathlib.Path(args.out), args.minutes, args.users, settings, args.seed, args.max_output_tokens)
    rss = s["stub_rss_mb"]
    print(f"requests {s['requests']} {s['by_kind']}; unexpected failures {s['unexpected_failures']}")
    for line in s["failure_examples"]:
        print(f"  {line}")
    print(f"TTFT p50 {s['ttft_p50_ms']} ms, p99 {s['ttft_p99_ms']} ms")
    print(f"stub RSS {rss['start']} MB at start, {rss['halfway']} MB halfway, {rss['max']} MB max, "
          f"{rss['end']} MB at end (growth {rss['growth']:+.1f} MB; per minute in stub_rss.csv)")
    print(f"leaked blocks {s['leaked_blocks']:g}, idle check failures {s['idle_check_failures']:g}, "
          f"idle after run {s['idle_after_run']}, serving after run {s['serving_after_run']}, "
          f"crash marks in server log {s['crash_marks_in_server_log'] or 'none'}")
    print("PASS" if s["ok"] else "FAIL")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
