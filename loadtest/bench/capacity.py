"""Serving capacity under a fixed KV budget: paged allocation vs contiguous
reservation (Orca Max, Pow2, Oracle), the paper's Figures 12 and 13.

The same engine runs in each ``kv_reservation`` mode with the same model, the
same number of KV blocks and the same seeded workload. Requests arrive as a
Poisson process and are replayed in real time (one thread: add what has
arrived, step, repeat); each generates exactly its trace output length (greedy,
EOS ignored). Per request rate and mode it reports the mean normalised latency
(end-to-end latency / output tokens) and the mean number of running sequences.
Before its sweep, each mode also runs the trace with every request queued at
once: the batch the budget allows and the throughput it gives (saturated).

*Sustainable rate*: the highest rate whose mean normalised latency stays
within ``--bound-factor`` times the unloaded one (the same requests run one at
a time on an idle engine), interpolated linearly between the last rate under
the bound and the first over it. A mode's sweep stops at the first rate over
the bound once it has run the fixed rate (the batch-size comparison).

The model is the tiny random Llama (compute on this CPU is slow; scheduling
and memory behaviour do not depend on the weights). The KV budget is chosen
small enough that memory, not compute, limits the batch: at the batch sizes
the budget allows, a bigger batch still gives more tokens per second (the
result records the decode step time by batch size to show it).
"""
import argparse
import time

from tqdm import tqdm

from loadtest import workloads

from . import plots
from .common import add_common_args, bench_model, set_threads, write_result
from .replay import Job, jobs_from_trace, replay

MODES = ("paged", "oracle", "pow2", "max")
LABELS = {"paged": "Paged", "oracle": "Orca (Oracle)", "pow2": "Orca (Pow2)", "max": "Orca (Max)"}
# Per workload: engine max_model_len, KV blocks (of --block-size) and request rates.
PRESETS = {
    "alpaca": {"max_model_len": 256, "num_kv_blocks": 64, "rates": "4,5,6,7,8,10,12,14", "fixed_rate": 6},
    "sharegpt": {"max_model_len": 2048, "num_kv_blocks": 512, "rates": "0.5,0.75,1,1.25,1.5,2,2.5",
                 "fixed_rate": 1.25},
}


def make_engine(model: str, mode: str, args):
    from pagedbackend import LLMEngine
    from pagedbackend.config import EngineConfig
    return LLMEngine(EngineConfig(model=model, block_size=args.block_size,
                                  num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
                                  kv_reservation=mode, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_prefix_caching=False, seed=args.seed))


def unloaded_latency(engine, jobs) -> float:
    """Mean normalised latency of ``jobs`` run one at a time on an idle engine."""
    values = []
    for job in jobs:
        one = Job("idle-" + job.request_id, job.prompt, job.max_tokens)
        values.append(replay(engine, [one], realtime=False).requests[0].normalised_latency)
    return sum(values) / len(values)


def step_time_by_batch(engine, batch_sizes=(1, 4, 8, 16), prompt_len=24, steps=6) -> dict:
    """Median decode step time (ms) with B sequences running: how compute grows with the batch."""
    from pagedbackend import SamplingParams
    out = {}
    for b in batch_sizes:
        for i in range(b):
            engine.add_request(f"calib{b}-{i}", [100 + (7 * i + j) % 1000 for j in range(prompt_len)],
                               SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0))
        engine.step()  # prefill
        times = []
        for _ in range(steps):
            engine.step()
            times.append(engine.last_step_seconds)
        while engine.has_unfinished_requests():
            engine.step()
        out[b] = round(1000 * sorted(times)[len(times) // 2], 2)
    return out


def run_point(engine, trace, prompts, rate: float, seed: int, tag: str, time_limit: float) -> dict:
    arrivals = workloads.poisson_arrivals(rate, len(trace), seed)
    jobs = jobs_from_trace(trace, prompts, arrivals, prefix=f"{tag}-")
    result = replay(engine, jobs, realtime=True, time_limit=time_limit)
    return {"rate": rate, **result.summary()}


def sustainable_rate(points, bound: float):
    """(highest measured rate under the bound, the interpolated crossing)."""
    best, crossing = None, None
    for prev, cur in zip([None] + points[:-1], points):
        if cur["normalised_latency_s"] <= bound and not cur["timed_out"]:
            best = cur["rate"]
            continue
        if prev is not None and best == prev["rate"]:
            y0, y1 = prev["normalised_latency_s"], cur["normalised_latency_s"]
            crossing = (prev["rate"] if y1 <= y0 or y1 <= bound
                        else prev["rate"] + (cur["rate"] - prev["rate"]) * (bound - y0) / (y1 - y0))
        break
    else:
        crossing = best   # never crossed within the rates tried: a lower bound
    return best, crossing


def saturated(engine, trace, prompts, tag: str) -> dict:
    """Every request queued at once: the batch the KV budget allows and the
    throughput it gives (capacity in req/s = tokens/s / mean output length)."""
    result = replay(engine, jobs_from_trace(trace, prompts, prefix=f"{tag}-"), realtime=False)
    summary = result.summary()
    mean_output = sum(r.output_len for r in trace) / len(trace)
    return {**summary, "capacity_req_s": round(summary["output_tokens_per_s"] / mean_output, 3)}


def sweep(model: str, args, trace, rates, bound: float, fixed_rate: float, progress=True) -> tuple:
    """Per mode: the saturated run, then the rates in order until one is past the
    bound (every mode runs at least up to ``fixed_rate``)."""
    points, saturation = {}, {}
    for mode in args.modes:
        engine = make_engine(model, mode, args)
        prompts = workloads.make_prompt_token_ids(trace, engine.vocab_size, args.seed)
        saturation[mode] = saturated(engine, trace, prompts, f"{mode}-sat")
        pts = []
        bar = tqdm(rates, desc=f"{mode:6s}", disable=not progress)
        bar.set_postfix(saturated=f"{saturation[mode]['output_tokens_per_s']:.0f} tok/s")
        for i, rate in enumerate(bar):
            limit = args.point_time_limit or max(60.0, 3 * len(trace) / rate)
            point = run_point(engine, trace, prompts, rate, args.seed, f"{mode}{i}", limit)
            pts.append(point)
            bar.set_postfix(lat=f"{point['normalised_latency_s']:.3f}", run=point["mean_running"])
            if (point["normalised_latency_s"] > bound or point["timed_out"]) and rate >= fixed_rate:
                break
        bar.close()
        points[mode] = pts
    return points, saturation


def summarise(points: dict, saturation: dict, bound: float, fixed_rate: float) -> dict:
    """Sustainable rate per mode, the batch at the fixed rate and saturated, and the
    paged / reservation ratios of both the sustainable rate and the saturated throughput."""
    modes = {}
    for mode, pts in points.items():
        best, crossing = sustainable_rate(pts, bound)
        modes[mode] = {
            "max_rate_under_bound": best, "sustainable_rate": crossing,
            # never over the bound: the true rate is higher than any tried
            "at_least": bool(pts) and all(p["normalised_latency_s"] <= bound for p in pts),
            # over the bound already at the lowest rate tried
            "below": pts[0]["rate"] if pts and best is None else None,
            "running_at_fixed_rate": next((p["mean_running"] for p in pts if p["rate"] == fixed_rate), None),
            "running_saturated": saturation[mode]["mean_running"],
            "saturated_tokens_per_s": saturation[mode]["output_tokens_per_s"],
            "capacity_req_s": saturation[mode]["capacity_req_s"]}
    ratios = {}
    if "paged" in modes:
        paged = modes["paged"]
        for other, theirs in modes.items():
            if other == "paged":
                continue
            entry = {"saturated_throughput": round(paged["saturated_tokens_per_s"]
                                                   / theirs["saturated_tokens_per_s"], 2)}
            if paged["sustainable_rate"] and theirs["sustainable_rate"]:
                entry["sustainable_rate"] = round(paged["sustainable_rate"] / theirs["sustainable_rate"], 2)
                entry["sustainable_rate_is_lower_bound"] = paged["at_least"]
            elif paged["sustainable_rate"] and theirs["below"]:
                # the reservation mode fails below its lowest rate: the ratio exceeds this
                entry["sustainable_rate_at_least"] = round(paged["sustainable_rate"] / theirs["below"], 2)
            ratios[f"paged/{other}"] = entry
    return {"modes": modes, "ratios": ratios}


def plot(result: dict, out_dir: str):
    fig, (ax, bx) = plots.figure(ncols=2, width=6.0, height=4.2)
    series = {LABELS[m]: ([p["rate"] for p in pts], [p["normalised_latency_s"] for p in pts])
              for m, pts in result["points"].items()}
    plots.lines(ax, series, "request rate (req/s)", "normalised latency (s/token)",
                hline=result["bound_s"], hline_label=f"bound ({result['bound_factor']}x unloaded)")
    ax.set_ylim(0, result["bound_s"] * 3)
    ax.set_title(f"{result['workload_label']}, {result['requests']} requests per rate", fontsize=9)
    fixed = result["fixed_rate"]
    modes = result["summary"]["modes"]
    plots.grouped_bars(bx, [LABELS[m] for m in modes],
                       {f"at {fixed:g} req/s": [v["running_at_fixed_rate"] or 0 for v in modes.values()],
                        "all queued (saturated)": [v["running_saturated"] for v in modes.values()]},
                       ylabel="mean running sequences")
    bx.set_title(f"batch size, KV budget {result['num_kv_blocks']} blocks x "
                 f"{result['block_size']} positions", fontsize=9)
    return plots.save(fig, out_dir, f"capacity_{result['workload']}",
                      "Capacity under a fixed KV budget (tiny model, CPU)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="alpaca", choices=sorted(PRESETS))
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=100, help="requests per rate point")
    ap.add_argument("--rates", help="request rates (req/s), comma-separated; default per workload")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-model-len", type=int, help="Orca (Max) reserves this; default per workload")
    ap.add_argument("--num-kv-blocks", type=int, help="KV budget in blocks; default per workload")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--bound-factor", type=float, default=4.0,
                    help="sustainable: mean normalised latency <= this x the unloaded one")
    ap.add_argument("--fixed-rate", type=float, help="rate for the batch-size comparison "
                    "(default per workload); every mode runs up to it")
    ap.add_argument("--unloaded-requests", type=int, default=8)
    ap.add_argument("--point-time-limit", type=float, default=None,
                    help="seconds per rate point (default max(60, 3 x requests / rate)); "
                         "unfinished requests then count with their elapsed time")
    add_common_args(ap)
    args = ap.parse_args(argv)
    preset = PRESETS[args.workload]
    args.max_model_len = args.max_model_len or preset["max_model_len"]
    args.num_kv_blocks = args.num_kv_blocks or preset["num_kv_blocks"]
    rates = sorted(float(r) for r in (args.rates or preset["rates"]).split(","))
    if args.quick:
        args.requests, args.unloaded_requests = 20, 3
        rates = rates[::4]
        args.fixed_rate = args.fixed_rate or rates[0]
    args.modes = args.modes.split(",")
    fixed_rate = args.fixed_rate or preset["fixed_rate"]
    if fixed_rate not in rates:
        rates = sorted(rates + [fixed_rate])
    set_threads(args.threads)
    started = time.perf_counter()
    model = bench_model(args.model)
    trace = workloads.make_trace(args.workload, args.requests, args.seed, max_model_len=args.max_model_len)

    idle = make_engine(model, "paged", args)
    prompts = workloads.make_prompt_token_ids(trace, idle.vocab_size, args.seed)
    unloaded = unloaded_latency(idle, jobs_from_trace(trace[:args.unloaded_requests],
                                                      prompts[:args.unloaded_requests]))
    bound = args.bound_factor * unloaded
    step_ms = step_time_by_batch(idle, batch_sizes=(1, 4, 8, 16) if not args.quick else (1, 4))
    print(f"unloaded normalised latency {unloaded * 1000:.1f} ms/token; bound {bound * 1000:.1f} ms/token; "
          f"decode step ms by batch {step_ms}")
    del idle

    points, saturation = sweep(model, args, trace, rates, bound, fixed_rate)
    summary = summarise(points, saturation, bound, fixed_rate)
    result = {"workload": args.workload, "workload_label": {"alpaca": "Alpaca-like",
                                                            "sharegpt": "ShareGPT-like"}[args.workload],
              "model": args.model, "requests": args.requests, "rates": rates,
              "max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks,
              "block_size": args.block_size, "kv_positions": args.num_kv_blocks * args.block_size,
              "unloaded_normalised_latency_s": unloaded, "bound_factor": args.bound_factor,
              "bound_s": bound, "decode_step_ms_by_batch": step_ms, "fixed_rate": fixed_rate,
              "summary": summary, "saturation": saturation, "points": points,
              "seconds": round(time.perf_counter() - started, 1)}
    for mode, m in summary["modes"].items():
        rate = (f">= {m['sustainable_rate']:.2f}" if m["at_least"] else
                f"< {m['below']:g}" if m["below"] else f"{m['sustainable_rate']:.2f}")
        fixed = m["running_at_fixed_rate"]
        print(f"{LABELS[mode]:14s} sustainable {rate} req/s; running at {fixed_rate:g} req/s: "
              f"{'-' if fixed is None else f'{fixed:.1f}'}; saturated: {m['running_saturated']:.1f} running, "
              f"{m['saturated_tokens_per_s']:.0f} tokens/s ({m['capacity_req_s']:.2f} req/s)")
    for name, r in summary["ratios"].items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    path = write_result(args.out, f"capacity_{args.workload}", result)
    print(f"wrote {path} and {plot(result, args.out)}")
    return result


if __name__ == "__main__":
    main()
