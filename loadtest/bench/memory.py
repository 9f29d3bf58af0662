"""KV memory utilisation: paged allocation vs contiguous reservation (Orca Max,
Pow2, Oracle), the paper's Figure 2 (20.4-38.2 % of reserved memory holds token
state in reservation systems).

Two measures, reported side by side:

1. *Trace accounting* (``pagedbackend.accounting``), over a whole synthetic
   trace. "At finish" is the accounting module's utilisation of final lengths
   (Oracle is 100 % by construction). "Over lifetimes" follows every request
   through each step it lives (prefill, then one step per output token after
   the first): positions holding K/V are ``prompt + t``, positions held are
   ``reserved_positions(scheme, ...)`` (the whole reservation for Orca, the
   blocks filled so far for paged); both are summed over all (request, step)
   pairs. That is the steady-state memory mix when every step takes equal time.
2. *Live ledger*: a sample of the same trace runs through the engine (tiny
   model) in each ``kv_reservation`` mode, and after every step the block
   manager's stored positions and allocated slots are read; utilisation is
   their ratio, both averaged over steps. Reservation modes run with 1-position
   blocks so that a reservation is exact, as a contiguous allocator's is.
   The pool is large enough that the whole sample runs at once (no queueing).

``--model gemma3-like`` measures something else: KV bytes per live token of
a sliding-window model with and without giving back out-of-window blocks
(``window_memory.py``).
"""
import argparse
import time

from tqdm import tqdm

from loadtest import workloads
from pagedbackend.accounting import reserved_positions, utilisation_report

from . import plots
from .common import add_common_args, bench_model, set_threads, write_result
from .replay import jobs_from_trace, replay

ORCA = ("max", "pow2", "oracle")
LABELS = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}
WORKLOADS = {"sharegpt": "ShareGPT-like", "alpaca": "Alpaca-like"}


def scheme_label(scheme: str, block_size=None) -> str:
    return LABELS.get(scheme) or f"Paged ({block_size})"


def lifetime_utilisation(trace, scheme: str, max_len: int, block_size=None) -> dict:
    """Positions stored vs held, summed over every step each request lives."""
    stored = held = 0
    for r in trace:
        steps = r.output_len                       # prefill + output_len - 1 decodes
        stored += steps * r.prompt_len + steps * (steps - 1) // 2
        if scheme == "paged":
            held += sum(reserved_positions("paged", r.prompt_len + t, max_len, block_size)
                        for t in range(steps))
        else:
            held += steps * reserved_positions(scheme, r.total_len, max_len)
    return {"stored": stored, "held": held, "utilisation": stored / held}


def trace_accounting(trace, max_len: int, block_sizes) -> list:
    """One row per scheme: utilisation at finish (accounting module) and over lifetimes."""
    lengths = [r.total_len for r in trace]
    prompts = [r.prompt_len for r in trace]
    rows = []
    for rep in utilisation_report(lengths, max_len, block_sizes, prompts):
        life = lifetime_utilisation(trace, rep.scheme, max_len, rep.block_size)
        rows.append({"scheme": rep.scheme, "block_size": rep.block_size,
                     "label": scheme_label(rep.scheme, rep.block_size),
                     "allocated": rep.allocated, "effective": rep.effective,
                     "utilisation_at_finish": rep.utilisation,
                     "reserved_unused_at_admission": rep.reserved_unused,
                     "lifetime_stored": life["stored"], "lifetime_held": life["held"],
                     "utilisation_over_lifetime": life["utilisation"]})
    return rows


def live_engine(model: str, mode: str, block_size: int, trace, max_len: int, seed: int):
    """An engine whose pool holds the whole sample under ``mode`` at once."""
    from pagedbackend import LLMEngine
    from pagedbackend.config import EngineConfig
    bs = block_size if mode == "paged" else 1
    need = sum(reserved_positions(mode, r.total_len, max_len, bs if mode == "paged" else None)
               for r in trace)
    num_blocks = int(need / bs * 1.05) + 8
    return LLMEngine(EngineConfig(model=model, block_size=bs, num_kv_blocks=num_blocks,
                                  max_model_len=max_len, kv_reservation=mode, max_num_seqs=1024,
                                  max_num_batched_tokens=8192, enable_prefix_caching=False,
                                  watermark=0.0, seed=seed))


def live_ledger(model: str, trace, max_len: int, block_size: int, seed: int, modes=ORCA + ("paged",),
                progress: bool = True) -> list:
    """Run the sample in each mode and average the engine's ledger over steps."""
    rows = []
    for mode in tqdm(modes, desc="live ledger", disable=not progress, leave=False):
        engine = live_engine(model, mode, block_size, trace, max_len, seed)
        prompts = workloads.make_prompt_token_ids(trace, engine.vocab_size, seed)
        result = replay(engine, jobs_from_trace(trace, prompts), realtime=False)
        assert result.preemptions == 0 and all(r.finished for r in result.requests)
        analytic = lifetime_utilisation(trace, mode, max_len, block_size if mode == "paged" else None)
        rows.append({"mode": mode, "label": scheme_label(mode, block_size),
                     "engine_block_size": engine.block_manager.block_size,
                     "steps": result.steps, "mean_stored": sum(result.stored) / result.steps,
                     "mean_allocated": sum(result.allocated) / result.steps,
                     "utilisation": result.utilisation,
                     "mean_step_utilisation": result.mean_step_utilisation,
                     "accounting_over_lifetime": analytic["utilisation"],
                     "seconds": round(result.seconds, 2)})
    return rows


def plot(result: dict, out_dir: str):
    live = result["live"]
    fig, axes = plots.figure(ncols=2 if live else 1, width=6.8, height=4.4)
    left = axes[0]
    acc = result["trace_accounting"]
    names = list(acc)
    cats = [row["label"] for row in acc[names[0]]]
    plots.grouped_bars(left, cats, {WORKLOADS[w]: [row["utilisation_over_lifetime"] for row in acc[w]]
                                    for w in names}, ylabel="positions holding K/V", percent=True)
    left.set_title(f"trace accounting, {result['trace_requests']} requests, over lifetimes", fontsize=9)
    if not live:
        return plots.save(fig, out_dir, "memory", "KV memory utilisation: paged vs contiguous reservation")
    right = axes[1]
    cats = [row["label"] for row in next(iter(live.values()))]
    series = {}
    for w in live:
        series[f"{WORKLOADS[w]} engine"] = [row["utilisation"] for row in live[w]]
        series[f"{WORKLOADS[w]} accounting"] = [row["accounting_over_lifetime"] for row in live[w]]
    plots.grouped_bars(right, cats, series, ylabel="positions holding K/V", percent=True)
    right.set_title("engine ledger vs accounting, same sample (tiny model)", fontsize=9)
    return plots.save(fig, out_dir, "memory", "KV memory utilisation: paged vs contiguous reservation")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="sharegpt,alpaca")
    ap.add_argument("--requests", type=int, default=1000, help="trace length for the accounting")
    ap.add_argument("--max-len", type=int, default=2048, help="max_model_len (Orca Max reserves this)")
    ap.add_argument("--block-sizes", default="8,16,32,64,128")
    ap.add_argument("--model", default="tiny", help="model for the live ledger")
    ap.add_argument("--live-requests", default="sharegpt=12,alpaca=32",
                    help="sample size per workload for the live ledger (0 skips it)")
    ap.add_argument("--live-max-output", type=int, default=512,
                    help="cap output lengths of the live sample (a long tail makes the run slow); "
                         "the accounting it is compared with uses the same capped sample")
    ap.add_argument("--live-block-size", type=int, default=16)
    ap.add_argument("--contexts", default="2048,8192,32768",
                    help="gemma3-like: context lengths (prompt + new tokens) measured")
    ap.add_argument("--window-seqs", type=int, default=2, help="gemma3-like: sequences per context")
    ap.add_argument("--new-tokens", type=int, default=8, help="gemma3-like: tokens generated per sequence")
    ap.add_argument("--hf-max-context", type=int, default=8192,
                    help="gemma3-like: compare with Hugging Face's greedy tokens up to this context")
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.model == "gemma3-like":
        return window_main(args)
    if args.quick:
        args.requests, args.live_requests, args.live_max_output = 200, "sharegpt=4,alpaca=8", 128
    set_threads(args.threads)
    started = time.perf_counter()
    names = args.workloads.split(",")
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    live_sizes = dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in args.live_requests.split(","))
    model = bench_model(args.model)
    result = {"model": args.model, "max_len": args.max_len, "trace_requests": args.requests,
              "block_sizes": block_sizes, "live_block_size": args.live_block_size,
              "live_max_output": args.live_max_output,
              "trace_accounting": {}, "live": {}, "live_requests": {}}
    for w in tqdm(names, desc="workloads"):
        trace = workloads.make_trace(w, args.requests, args.seed, max_model_len=args.max_len)
        rows = trace_accounting(trace, args.max_len, block_sizes)
        result["trace_accounting"][w] = rows
        for row in rows:
            tqdm.write(f"{WORKLOADS[w]:14s} {row['label']:14s} at finish "
                       f"{100 * row['utilisation_at_finish']:5.1f} %  over lifetimes "
                       f"{100 * row['utilisation_over_lifetime']:5.1f} %")
        n = live_sizes.get(w, 0)
        if n:
            sample = [workloads.Request(r.prompt_len, min(r.output_len, args.live_max_output))
                      for r in trace[:n]]
            result["live_requests"][w] = {"requests": n, "prompt_tokens": sum(r.prompt_len for r in sample),
                                          "output_tokens": sum(r.output_len for r in sample)}
            live = live_ledger(model, sample, args.max_len, args.live_block_size, args.seed)
            result["live"][w] = live
            for row in live:
                tqdm.write(f"{WORKLOADS[w]:14s} live {row['label']:14s} engine "
                           f"{100 * row['utilisation']:5.1f} %  accounting "
                           f"{100 * row['accounting_over_lifetime']:5.1f} %  ({row['steps']} steps)")
    result["seconds"] = round(time.perf_counter() - started, 1)
    path = write_result(args.out, "memory", result)
    print(f"wrote {path} and {plot(result, args.out)}")
    return result


def window_main(args):
    """``--model gemma3-like``: KV bytes per live token with and without freeing."""
    from . import window_memory
    set_threads(args.threads)
    contexts = [2048] if args.quick else [int(c) for c in args.contexts.split(",")]
    started = time.perf_counter()
    result = window_memory.run(contexts, args.window_seqs, args.new_tokens, args.hf_max_context, args.seed)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(f"wrote {write_result(args.out, 'memory_gemma3_like', result)}")
    return result


if __name__ == "__main__":
    main()
