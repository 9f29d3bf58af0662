"""Block size, and swap vs recompute preemption (the paper's Figures 18 and 19).

1. Sweep: for each block size, a seeded trace runs offline (every request
   queued at once) through the engine with the tiny model under one KV budget
   in bytes: output tokens/s, KV utilisation (stored / allocated positions,
   both averaged over steps), the mean batch and the preemptions.
2. Micro (Fig. 19a): the time to swap one sequence's blocks out and back in
   vs the time to recompute its K/V (a prefill of the same tokens).
3. End to end (Fig. 19b): a ShareGPT-like trace under a budget small enough to
   force preemption, with ``preemption_mode`` swap and recompute, at small,
   medium and large blocks.

On this machine the "device" is the CPU, so a swap is a host-to-host copy,
and the runner moves all of a step's blocks in one indexed copy: the PCIe
cost per transfer that makes swapping small blocks slow on a GPU does not
appear. Prefix caching is off, so a recomputed sequence gets no free hits.
"""
import argparse
import time

import torch
from tqdm import tqdm

from loadtest import workloads

from . import plots
from .common import add_common_args, bench_model, set_threads, write_result
from .replay import jobs_from_trace, replay

MIB = 1024 * 1024
# Per workload: engine max_model_len, trace length, KV budget in MiB.
SWEEP = {"sharegpt": (2048, 24, 16), "alpaca": (512, 64, 4)}


def make_engine(model: str, block_size: int, max_len: int, budget_bytes: int, mode="recompute",
                swap_blocks: int = 0, seed: int = 0, num_kv_blocks=None):
    from pagedbackend import LLMEngine
    from pagedbackend.config import EngineConfig
    return LLMEngine(EngineConfig(model=model, block_size=block_size, kv_cache_bytes=budget_bytes,
                                  num_kv_blocks=num_kv_blocks,
                                  max_model_len=max_len, max_num_seqs=256, max_num_batched_tokens=2048,
                                  enable_prefix_caching=False, preemption_mode=mode,
                                  swap_space_blocks=swap_blocks, seed=seed))


def timed_block_moves(engine) -> dict:
    """Wrap the runner's swap_out / swap_in to add up the time they take."""
    spent = {"swap_seconds": 0.0, "swapped_blocks": 0}
    runner = engine.runner
    for name in ("swap_out", "swap_in"):
        inner = getattr(runner, name)

        def wrapped(pairs, inner=inner):
            start = time.perf_counter()
            inner(pairs)
            spent["swap_seconds"] += time.perf_counter() - start
            spent["swapped_blocks"] += len(pairs)
        setattr(runner, name, wrapped)
    return spent


def offline_run(engine, trace, seed: int) -> dict:
    prompts = workloads.make_prompt_token_ids(trace, engine.vocab_size, seed)
    spent = timed_block_moves(engine)
    result = replay(engine, jobs_from_trace(trace, prompts), realtime=False)
    return {**result.summary(), "num_kv_blocks": engine.block_manager.num_total_blocks,
            "kv_positions": engine.block_manager.num_total_blocks * engine.block_manager.block_size,
            "swap_seconds": round(spent["swap_seconds"], 4), "swapped_blocks": spent["swapped_blocks"]}


def capped(trace, max_output):
    """The trace with output lengths capped (the heavy ShareGPT tail would leave one
    long request running alone for most of an offline run)."""
    if not max_output:
        return trace
    return [workloads.Request(r.prompt_len, min(r.output_len, max_output)) for r in trace]


def sweep(model: str, names, block_sizes, seed: int, scale: float = 1.0, max_output=None,
          progress=True) -> dict:
    out = {}
    for w in names:
        max_len, n, mib = SWEEP[w]
        trace = capped(workloads.make_trace(w, max(2, int(n * scale)), seed, max_model_len=max_len),
                       max_output)
        rows = []
        for bs in tqdm(block_sizes, desc=f"sweep {w}", disable=not progress):
            engine = make_engine(model, bs, max_len, mib * MIB, seed=seed)
            rows.append({"block_size": bs, **offline_run(engine, trace, seed)})
            tqdm.write(f"{w:9s} block {bs:4d}: {rows[-1]['output_tokens_per_s']:7.1f} tokens/s, "
                       f"utilisation {100 * rows[-1]['utilisation']:5.1f} %, batch "
                       f"{rows[-1]['mean_running']:5.1f}, preemptions {rows[-1]['preemptions']}")
        out[w] = {"max_model_len": max_len, "requests": len(trace), "kv_budget_mib": mib,
                  "prompt_tokens": sum(r.prompt_len for r in trace),
                  "output_tokens": sum(r.output_len for r in trace), "rows": rows}
    return out


def micro(model: str, block_sizes, tokens: int, repeats: int = 5) -> list:
    """Swap out + in of ``tokens`` positions vs recomputing them, per block size."""
    from pagedbackend.config import EngineConfig
    from pagedbackend.worker.model_runner import ModelRunner, SeqEntry
    rows = []
    for bs in block_sizes:
        n_blocks = -(-tokens // bs)
        runner = ModelRunner(EngineConfig(model=model, block_size=bs, num_kv_blocks=n_blocks,
                                          swap_space_blocks=n_blocks))
        pairs = [(i, i) for i in range(n_blocks)]
        prompt = [100 + i % 1000 for i in range(tokens)]
        swap, recompute = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.swap_out(pairs)
            runner.swap_in(pairs)
            swap.append(time.perf_counter() - start)
            start = time.perf_counter()
            runner.execute_model([SeqEntry(prompt, 0, list(range(n_blocks)), True)])
            recompute.append(time.perf_counter() - start)
        rows.append({"block_size": bs, "tokens": tokens, "blocks": n_blocks,
                     "swap_out_in_ms": 1000 * sorted(swap)[len(swap) // 2],
                     "recompute_ms": 1000 * sorted(recompute)[len(recompute) // 2]})
    return rows


def preemption(model: str, block_sizes, n: int, mib: float, seed: int, max_output=None,
               progress=True) -> list:
    max_len = 2048
    trace = capped(workloads.sharegpt_like(n, seed, max_model_len=max_len), max_output)
    rows = []
    jobs = [(bs, mode) for bs in block_sizes for mode in ("recompute", "swap")]
    for bs, mode in tqdm(jobs, desc="swap vs recompute", disable=not progress):
        budget = int(mib * MIB)
        swap_blocks = 4 * budget // kv_bytes_per_block(model, bs) if mode == "swap" else 0
        engine = make_engine(model, bs, max_len, budget, mode, swap_blocks, seed)
        row = {"block_size": bs, "mode": mode, **offline_run(engine, trace, seed)}
        rows.append(row)
        tqdm.write(f"block {bs:4d} {mode:9s}: {row['output_tokens_per_s']:7.1f} tokens/s, "
                   f"{row['preemptions']} preemptions, swap {row['swap_seconds']:.2f} s "
                   f"of {row['seconds']:.1f} s")
    return rows


def kv_bytes_per_block(model: str, block_size: int, dtype_bytes: int = 4) -> int:
    """K and V of every layer for one block (fp32 by default, as the engine runs here)."""
    from pagedbackend.accounting import model_from_config
    from pagedbackend.models.default_model import resolve_model_path
    kv = model_from_config(str(resolve_model_path(model)), dtype_bytes=dtype_bytes)
    return kv.kv_bytes_per_block(block_size)


def plot(result: dict, out_dir: str):
    fig, (a, b, c) = plots.figure(ncols=3, width=4.6, height=4.0)
    sw = result["sweep"]
    plots.lines(a, {f"{w} tokens/s": ([r["block_size"] for r in v["rows"]],
                                      [r["output_tokens_per_s"] for r in v["rows"]]) for w, v in sw.items()},
                "block size", "output tokens/s")
    sizes = sorted({r["block_size"] for v in sw.values() for r in v["rows"]})
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(x) for x in sizes])
    a.set_title("throughput", fontsize=9)
    plots.lines(b, {f"{w}": ([r["block_size"] for r in v["rows"]],
                             [100 * r["utilisation"] for r in v["rows"]]) for w, v in sw.items()},
                "block size", "stored / allocated positions (%)")
    b.set_title("KV utilisation", fontsize=9)
    pre = result["preemption"]
    sizes = sorted({r["block_size"] for r in pre})
    plots.grouped_bars(c, [str(s) for s in sizes],
                       {mode: [next(r["output_tokens_per_s"] for r in pre
                                    if r["block_size"] == s and r["mode"] == mode) for s in sizes]
                        for mode in ("recompute", "swap")}, ylabel="output tokens/s")
    c.set_xlabel("block size")
    c.set_title("ShareGPT-like under preemption", fontsize=9)
    return plots.save(fig, out_dir, "blocksize", "Block size and preemption mode (tiny model, CPU)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench blocksize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--workloads", default="sharegpt,alpaca")
    ap.add_argument("--block-sizes", default="8,16,32,64,128")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the sweep's request counts")
    ap.add_argument("--max-output", type=int, default=512, help="cap output lengths (0: no cap)")
    ap.add_argument("--micro-tokens", type=int, default=1024)
    ap.add_argument("--preemption-block-sizes", default="8,32,128")
    ap.add_argument("--preemption-requests", type=int, default=16)
    ap.add_argument("--preemption-budget-mib", type=float, default=8.0)
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.scale, args.block_sizes, args.preemption_requests = 0.25, "16,128", 6
        args.preemption_block_sizes, args.micro_tokens, args.max_output = "16,128", 256, 48
        args.preemption_budget_mib = 4.0
    set_threads(args.threads)
    started = time.perf_counter()
    model = bench_model(args.model)
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    pre_sizes = [int(b) for b in args.preemption_block_sizes.split(",")]
    result = {"model": args.model, "threads": torch.get_num_threads(), "max_output": args.max_output}
    result["sweep"] = sweep(model, args.workloads.split(","), block_sizes, args.seed, args.scale,
                            args.max_output)
    result["micro"] = micro(model, sorted(set(block_sizes + pre_sizes)), args.micro_tokens)
    for r in result["micro"]:
        print(f"micro block {r['block_size']:4d}: swap out+in {r['swap_out_in_ms']:.2f} ms, "
              f"recompute {r['recompute_ms']:.1f} ms for {r['tokens']} tokens")
    result["preemption_budget_mib"] = args.preemption_budget_mib
    result["preemption_requests"] = args.preemption_requests
    result["preemption"] = preemption(model, pre_sizes, args.preemption_requests,
                                      args.preemption_budget_mib, args.seed, args.max_output)
    result["seconds"] = round(time.perf_counter() - started, 1)
    path = write_result(args.out, "blocksize", result)
    print(f"wrote {path} and {plot(result, args.out)}")
    return result


if __name__ == "__main__":
    main()
