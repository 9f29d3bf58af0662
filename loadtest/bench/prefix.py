"""Prefix-cache speed-up on a shared-prefix workload (the paper's Figure 16):
every request starts with the same few-shot prefix (1-shot ~80 tokens, 5-shot
~340 tokens) followed by its own short suffix. The same requests run with
automatic prefix caching on and off; the prefix is warmed by one request first,
as a long-running server would have it cached.
"""
import argparse
import time

from loadtest import workloads
from pagedbackend import LLM, SamplingParams

from .common import bench_model, write_result


def run(model: str, prompts, trace, caching: bool, block_size: int) -> dict:
    llm = LLM(model=model, block_size=block_size, enable_prefix_caching=caching,
              kv_cache_bytes=512 * 1024 * 1024, max_num_seqs=64)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in trace]
    llm.generate(prompts[:1], params[:1])          # warm-up: caches the prefix when caching is on
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    stats = llm.engine.get_stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"caching": caching, "seconds": round(seconds, 3),
            "requests_per_s": len(prompts) / seconds, "output_tokens_per_s": out_tokens / seconds,
            "prefix_hit_rate": stats.prefix_cache_hit_rate,
            "prompt_tokens": sum(len(p) for p in prompts)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench prefix", description=__doc__)
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny' or a folder")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--shots", default="1,5")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    model = bench_model(args.model)
    rows = []
    for shots in [int(s) for s in args.shots.split(",")]:
        trace = workloads.shared_prefix(args.requests, args.seed, shots=shots)
        vocab = LLM(model=model, num_kv_blocks=16).engine.vocab_size if model == "tiny" else 49152
        prompts = workloads.make_prompt_token_ids(trace, vocab, args.seed)
        off = run(model, prompts, trace, False, args.block_size)
        on = run(model, prompts, trace, True, args.block_size)
        row = {"shots": shots, "prefix_len": trace[0].prefix_len, "off": off, "on": on,
               "speedup": on["requests_per_s"] / off["requests_per_s"]}
        rows.append(row)
        print(f"{shots}-shot prefix ({row['prefix_len']} tokens): {off['requests_per_s']:.2f} -> "
              f"{on['requests_per_s']:.2f} req/s, speed-up {row['speedup']:.2f}x, "
              f"hit rate {100 * on['prefix_hit_rate']:.0f} %")
    path = write_result(args.out, "prefix", {"model": args.model, "requests": args.requests, "rows": rows})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
