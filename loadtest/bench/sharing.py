"""KV memory saved by sharing blocks within a request (the paper's Figure 15):
parallel sampling (n samples share the prompt) and beam search (beams share
their common prefix), measured from the block manager while the engine runs.

Without sharing, every sequence would hold its own copy of each of its blocks:
``sum over live sequences of ceil(tokens / block_size)``. With sharing, the
pool holds ``used blocks``. Saving = 1 - mean(used) / mean(without sharing),
averaged over engine steps.
"""
import argparse
import time

from tqdm import tqdm

from loadtest import workloads
from pagedbackend import LLMEngine, SamplingParams
from pagedbackend.config import EngineConfig

from .common import bench_model, write_result


def measure(engine: LLMEngine, trace, prompts, make_params) -> dict:
    for i, (req, prompt) in enumerate(zip(trace, prompts)):
        engine.add_request(f"r{i}", prompt, make_params(req))
    bm = engine.block_manager
    used = private = 0
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = [s for g in engine.groups.values() for s in g.seqs if bm.has_seq(s.seq_id)
                and not bm.is_swapped(s.seq_id)]
        used += bm.num_used_blocks
        private += sum(len(bm.get_block_table(s.seq_id)) for s in live)
        steps += 1
    assert engine.get_stats().num_preemptions == 0, "the pool must be large enough to avoid preemption"
    return {"mean_used_blocks": used / steps, "mean_blocks_without_sharing": private / steps,
            "saving": 1 - used / private if private else 0.0, "steps": steps}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench sharing", description=__doc__)
    ap.add_argument("--model", default="tiny", help="'tiny' (random, fast), 'default' or a folder")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--widths", default="2,4,6")
    ap.add_argument("--workloads", default="alpaca,sharegpt")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=None, help="cap output lengths (for speed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    model = bench_model(args.model)
    widths = [int(w) for w in args.widths.split(",")]
    rows = []
    jobs = [(w, kind, width) for w in args.workloads.split(",") for kind in ("parallel", "beam")
            for width in widths]
    engine = None
    for workload, kind, width in tqdm(jobs, desc="sharing"):
        trace = workloads.make_trace(workload, args.requests, args.seed)
        if args.max_output:
            trace = [workloads.Request(r.prompt_len, min(r.output_len, args.max_output)) for r in trace]
        engine = LLMEngine(EngineConfig(model=model, block_size=args.block_size, num_kv_blocks=20000,
                                        enable_prefix_caching=False, max_num_seqs=1024,
                                        max_num_batched_tokens=8192, max_model_len=4096))
        prompts = workloads.make_prompt_token_ids(trace, engine.vocab_size, args.seed)
        if kind == "parallel":
            make = lambda r: SamplingParams(n=width, temperature=1.0, seed=args.seed,
                                            max_tokens=r.output_len, ignore_eos=True)
        else:
            make = lambda r: SamplingParams(n=width, use_beam_search=True, temperature=0.0,
                                            max_tokens=r.output_len, ignore_eos=True)
        start = time.perf_counter()
        result = measure(engine, trace, prompts, make)
        result.update(workload=workload, kind=kind, width=width,
                      seconds=round(time.perf_counter() - start, 2))
        rows.append(result)
        tqdm.write(f"{workload:9s} {kind:8s} width {width}: saving {100 * result['saving']:.1f} %")
    path = write_result(args.out, "sharing", {"model": args.model, "block_size": args.block_size,
                                              "requests": args.requests, "rows": rows})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
