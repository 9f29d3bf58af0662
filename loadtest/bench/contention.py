"""Serving speed beside busy neighbours: ours and vLLM's CPU server on the
same text workload, idle and with 1 and 2 busy processes on the machine.

Each system's server starts once; then, round after round, the same
requests (text prompts sized from a seeded Alpaca-like trace, all sent at
once, greedy, EOS ignored, a fixed output length) run with 0, 1 and 2 busy
processes (``python3 -c "while True: pass"``) beside it, in turn, so every
load is paired with an idle run of the same round. Reported per system and
load: output tokens/s, TTFT and TPOT (medians over rounds), the slowdown
against the same round's idle run, and ours against vLLM's under the same
load. Servers take turns, never overlapping. vLLM is found as in ``peers``
(``--vllm-python`` / ``BENCH_VLLM_PYTHON``); a missing one is skipped.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

from loadtest import workloads

from . import peer_servers
from .common import bench_model, write_result
from .peers import cpu_model, drive, find_peers, summarise

HOG = "while True: pass"


class BusyNeighbours:
    """``count`` processes that spin on a core each, for as long as the block runs."""

    def __init__(self, count: int):
        self.count, self.processes = count, []

    def __enter__(self) -> "BusyNeighbours":
        self.processes = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(self.count)]
        time.sleep(0.2 if self.count else 0.0)   # running before the first request
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()


def run_rounds(system: str, server: peer_servers.Server, stream: Callable, lengths: List[int],
               loads: List[int], rounds: int, time_limit_s: float) -> List[dict]:
    """Every (round, load) of one server: the requests all at once."""
    rows = []
    with server:
        for _ in stream(0, 4):   # warm-up, not timed
            pass
        for round_index in range(rounds):
            for load in loads:
                with BusyNeighbours(load):
                    records = drive(lambda i: stream(i, lengths[i]), [0.0] * len(lengths), time_limit_s)
                row = summarise(system, records, lengths)
                row.update(round=round_index, busy_processes=load)
                rows.append(row)
                print(f"{system}, round {round_index + 1}, {load} busy: "
                      f"{row['output_tokens_per_s']:.1f} tok/s, TTFT p50 {row['ttft_ms_p50']} ms, "
                      f"TPOT p50 {row['tpot_ms_p50']} ms, {row['finished']}/{row['requests']} finished",
                      flush=True)
    return rows


def table(rows: List[dict], loads: List[int]) -> List[dict]:
    """Medians per (system, load), with the slowdown against idle in the same round."""
    out = []
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        idle = {r["round"]: r["output_tokens_per_s"] for r in mine if r["busy_processes"] == 0}
        for load in loads:
            runs = [r for r in mine if r["busy_processes"] == load]
            med = lambda key: statistics.median(r[key] for r in runs if r[key] is not None) \
                if any(r[key] is not None for r in runs) else None   # noqa: E731
            vs_idle = [r["output_tokens_per_s"] / idle[r["round"]] for r in runs if idle.get(r["round"])]
            out.append({"system": system, "busy_processes": load, "rounds": len(runs),
                        "output_tokens_per_s": round(med("output_tokens_per_s"), 1),
                        "ttft_ms_p50": med("ttft_ms_p50"), "tpot_ms_p50": med("tpot_ms_p50"),
                        "vs_idle": round(statistics.median(vs_idle), 3) if vs_idle else None,
                        "finished": sum(r["finished"] for r in runs),
                        "requests": sum(r["requests"] for r in runs)})
    ours = {r["busy_processes"]: r for r in out if r["system"] == "ours"}
    for r in out:
        base = ours.get(r["busy_processes"])
        if r["system"] != "ours" and base and r["output_tokens_per_s"]:
            r["ours_vs_this"] = round(base["output_tokens_per_s"] / r["output_tokens_per_s"], 2)
    return out


def parse_args(argv=None):
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench contention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny' or a folder")
    ap.add_argument("--requests", type=int, default=32, help="requests per run, all at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of every request")
    ap.add_argument("--loads", default="0,1,2", help="busy processes beside the server, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds per run at most")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="batch cap for ours and vLLM")
    ap.add_argument("--threads", type=int, default=2, help="threads for every system")
    ap.add_argument("--vllm-python", default=env("BENCH_VLLM_PYTHON"), help="Python of vLLM's venv")
    ap.add_argument("--vllm-env", default=env("BENCH_VLLM_ENV"), help="shell file of exports for vLLM")
    ap.add_argument("--systems", default="ours,vllm", help="which servers to run, comma-separated")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 requests of 16 tokens, loads 0 and 1, one round")
    args = ap.parse_args(argv)
    args.loads = [int(x) for x in args.loads.split(",") if x != ""]
    if 0 not in args.loads:
        args.loads.insert(0, 0)   # every load is measured against an idle run
    if args.quick:
        args.requests, args.max_tokens, args.loads, args.rounds = 4, 16, [0, 1], 1
    args.systems = [s for s in args.systems.split(",") if s]
    return args


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    from transformers import AutoTokenizer
    from pagedbackend.models.default_model import resolve_model_path
    from loadtest.harness.triton import free_port
    model = bench_model(args.model)
    model_dir = str(resolve_model_path(model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    trace = workloads.alpaca_like(args.requests, args.seed)
    prompts = workloads.make_text_prompts(trace, tokenizer, args.seed)
    lengths = [args.max_tokens] * len(prompts)
    timeout = args.time_limit + 60
    peers: Dict = find_peers(argparse.Namespace(vllm_python=args.vllm_python, llama_server=None, gguf=None))
    skipped = [m for m in peers["skipped"] if m.startswith("vLLM")]
    rows = []
    if "ours" in args.systems:
        with tempfile.TemporaryDirectory(prefix="contention-repo-") as repo_dir:
            port = free_port()
            server = peer_servers.ours(model, port, args.threads,
                                       {"max_num_seqs": args.max_num_seqs, "device": "cpu"}, repo_dir)
            rows += run_rounds("ours", server, lambda i, n: peer_servers.stream_ours(
                f"http://127.0.0.1:{port}", prompts[i], n, timeout), lengths, args.loads, args.rounds,
                args.time_limit)
    if "vllm" in args.systems and "vllm" in peers["found"]:
        port = free_port()
        server = peer_servers.vllm(peers["found"]["vllm"], model_dir, port, args.threads,
                                   args.max_num_seqs, args.vllm_env)
        rows += run_rounds("vLLM CPU", server, lambda i, n: peer_servers.stream_vllm(
            f"http://127.0.0.1:{port}", model_dir, prompts[i], n, timeout), lengths, args.loads,
            args.rounds, args.time_limit)
    for message in skipped:
        print(f"skipped: {message}", flush=True)
    summary = table(rows, args.loads)
    for r in summary:
        print(json.dumps(r), flush=True)
    result = {"model": args.model, "threads": args.threads, "cpu_model": cpu_model(),
              "workload": f"{args.requests} text prompts (alpaca_like lengths), all at once, "
                          f"{args.max_tokens} tokens each, greedy, ignore_eos; HTTP streaming",
              "neighbour": f"{sys.executable} -c {HOG!r}", "peers_skipped": skipped,
              "summary": summary, "runs": rows, "seconds": round(time.perf_counter() - started, 1)}
    path = write_result(args.out, "contention", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
