"""Time to first token of high-priority requests under a full KV pool, with
``scheduling_policy`` ``fcfs`` against ``priority``, through tritonserver.

Each policy gets a server of its own (the shipped configuration with a KV pool
of ``--kv-blocks`` blocks and ``--max-num-seqs`` sequences a step: a full
server holds both). Low-priority requests (``priority`` 10, greedy,
``ignore_eos``) that need several times the pool are sent at once, so most of
them wait for blocks; once the pool is full (the first preemption, or 2 s),
``--high`` short high-priority requests (``priority`` 0, 8 tokens) follow, one every ``--gap`` s. Reported
per policy: the high requests' TTFT (mean, median and each), the
low requests' time, whether every request finished, and whether every greedy
output equals the same request run alone on an idle server (preemption
changes no token).
"""
import argparse
import json
import statistics
import tempfile
import threading
import time

from .common import write_result
from .fairness import counter

HIGH_PROMPTS = ["The capital of France is", "Two plus two equals", "The colour of the sky is",
                "A group of crows is called", "Water boils at", "The largest planet is",
                "The first month of the year is", "Bees make"]


def run(server, low_prompts, low_params, high_params, high: int, gap_s: float, salt: str) -> dict:
    from client import collect, generate, http_stream
    url, metrics = server.http_url, server.metrics_url
    low_params = {**low_params, "cache_salt": salt}
    high_params = {**high_params, "cache_salt": salt}
    preemptions = counter(metrics, "pagedbackend:num_preemptions_total")
    results = [None] * len(low_prompts)

    def one(i):
        results[i] = collect(http_stream(low_prompts[i], low_params, url=url, exclude_input=True, timeout=1800))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(low_prompts))]
    for thread in threads:
        thread.start()
    while counter(metrics, "pagedbackend:num_preemptions_total") == preemptions and any(
            t.is_alive() for t in threads) and time.perf_counter() - t0 < 2.0:
        time.sleep(0.05)
    highs = [None] * high

    def urgent(i):
        sent = time.perf_counter()
        result = generate(HIGH_PROMPTS[i % len(HIGH_PROMPTS)], high_params, protocol="http", url=url, timeout=1800)
        highs[i] = {"sent_after_s": round(sent - t0, 2), "ttft_s": round(result.token_times[0][0], 3),
                    "text": result.texts[0], "finish_reason": result.finish_reasons[0]}
    start = time.perf_counter()
    for i in range(high):   # on a clock, whatever the earlier ones are doing
        time.sleep(max(0.0, start + i * gap_s - time.perf_counter()))
        threads.append(threading.Thread(target=urgent, args=(i,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return {"highs": highs, "low_s": round(time.perf_counter() - t0, 2),
            "low_texts": [r.texts for r in results], "low_finish": [r.finish_reasons for r in results],
            "preemptions": counter(metrics, "pagedbackend:num_preemptions_total") - preemptions}


def reference(server, low_prompts, low_params, high_params, high: int) -> dict:
    """Every request alone, one after the other, on the idle server."""
    from client import generate
    lows = [generate(p, {**low_params, "cache_salt": "alone"}, protocol="http", url=server.http_url,
                     timeout=1800).texts for p in low_prompts]
    highs = [generate(HIGH_PROMPTS[i % len(HIGH_PROMPTS)], {**high_params, "cache_salt": "alone"}, protocol="http",
                      url=server.http_url, timeout=600).texts[0] for i in range(high)]
    return {"low_texts": lows, "high_texts": highs}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench priority", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--kv-blocks", type=int, default=96, help="KV pool of each server (16 tokens a block)")
    ap.add_argument("--low", type=int, default=16, help="low-priority requests")
    ap.add_argument("--low-tokens", type=int, default=128, help="tokens each low-priority request generates")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="sequences a step on each server")
    ap.add_argument("--high", type=int, default=6, help="high-priority requests")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between high-priority requests")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 low and 3 high requests")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.low, args.high, args.low_tokens, args.kv_blocks, args.gap = "tiny", 8, 3, 48, 24, 0.3
        args.max_num_seqs = 4
    from loadtest.bench.common import bench_model
    from loadtest.harness.triton import TritonServer
    from pagedbackend.serving.repository import make_model_repository
    model = bench_model(args.model)
    low_prompts = [f"Story {i}: once upon a time in a land far away," for i in range(args.low)]
    low_params = {"max_tokens": args.low_tokens, "temperature": 0.0, "ignore_eos": True, "priority": 10}
    high_params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "priority": 0}
    rows, expected = [], None
    for policy in ("fcfs", "priority"):
        with tempfile.TemporaryDirectory(prefix="bench-priority-") as tmp:
            repo = make_model_repository(tmp, {"model": model, "num_kv_blocks": args.kv_blocks,
                                               "max_num_seqs": args.max_num_seqs, "scheduling_policy": policy})
            with TritonServer(repo, ready_timeout_s=900, wait_for_compiled_step=True) as server:
                if expected is None:
                    expected = reference(server, low_prompts, low_params, high_params, args.high)
                got = run(server, low_prompts, low_params, high_params, args.high, args.gap, policy)
        ttfts = [h["ttft_s"] for h in got["highs"]]
        row = {"policy": policy, "high_ttft_s_mean": round(statistics.mean(ttfts), 3),
               "high_ttft_s_median": statistics.median(ttfts), "high_ttft_s": ttfts,
               "low_s": got["low_s"], "preemptions": got["preemptions"],
               "all_finished": all(r == "length" for f in got["low_finish"] for r in f)
               and all(h["finish_reason"] == "length" for h in got["highs"]),
               "greedy_outputs_unchanged": got["low_texts"] == expected["low_texts"]
               and [h["text"] for h in got["highs"]] == expected["high_texts"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    ratio = rows[0]["high_ttft_s_mean"] / max(rows[1]["high_ttft_s_mean"], 1e-9)
    path = write_result(args.out, "priority", {
        "model": args.model, "kv_blocks": args.kv_blocks, "max_num_seqs": args.max_num_seqs,
        "low": {"requests": args.low, **low_params},
        "high": {"requests": args.high, "gap_s": args.gap, **high_params}, "rows": rows,
        "fcfs_over_priority_ttft": round(ratio, 2)})
    print(f"fcfs / priority high-priority TTFT (mean): {ratio:.2f}x\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
