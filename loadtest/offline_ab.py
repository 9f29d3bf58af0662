"""The offline workload of ``loadtest.bench peers`` (``alpaca_like(32, seed
0)`` as token ids, greedy, ``ignore_eos``, all queued at once after a warm-up
batch of the same sizes) through two engines held in one process, run after
run in alternating order, so that a noisy host weighs on both alike; both
must give the same tokens.

- ``--compare step_package`` (default): the compiled step by ``torch.compile``
  in process (``step_package=False``) against the step served from its
  AOTInductor package (built first when the cache has none).

    python -m loadtest.offline_ab --runs 6 [--threads 2]
"""
import argparse
import json
import os
import statistics
import time

VARIANTS = {"step_package": (("torch.compile in process", {"step_package": False}),
                             ("AOTInductor package", {"step_package": True}))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.offline_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=6, help="timed runs of each engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", choices=sorted(VARIANTS), default="step_package")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    from loadtest import workloads
    from loadtest.bench.common import bench_model, set_threads
    set_threads(args.threads)
    from pagedbackend import LLM, SamplingParams
    from pagedbackend.models.default_model import resolve_model_path

    model = bench_model(args.model)
    model_dir = str(resolve_model_path(model))
    trace = workloads.alpaca_like(args.requests, args.seed)
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    prompts = workloads.make_prompt_token_ids(trace, vocab, args.seed)
    warm = workloads.make_prompt_token_ids(trace, vocab, args.seed + 1)
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in trace]
    outputs = sum(r.output_len for r in trace)

    engines = []
    for label, settings in VARIANTS[args.compare]:
        started = time.perf_counter()
        llm = LLM(model=model, max_num_seqs=64, compile=True, **settings)
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        print(f"{label}: ready and warm in {time.perf_counter() - started:.1f} s "
              f"({type(llm.engine.runner.compiled).__name__})", flush=True)
        engines.append((label, llm))
    seconds = [[] for _ in engines]
    tokens = [None for _ in engines]
    for run in range(args.runs):
        for i in (range(len(engines)) if run % 2 == 0 else reversed(range(len(engines)))):
            started = time.perf_counter()
            outs = engines[i][1].generate(prompts, params)
            seconds[i].append(time.perf_counter() - started)
            got = [o.outputs[0].token_ids for o in outs]
            if tokens[i] is not None and got != tokens[i]:
                raise SystemExit(f"{engines[i][0]}: run {run} gave other tokens than its first run")
            tokens[i] = got
    for (label, llm), times in zip(engines, seconds):
        print(f"{label}: {', '.join(f'{s:.3f}' for s in times)} s; median "
              f"{outputs / statistics.median(times):.1f} tok/s", flush=True)
        llm.shutdown()
    ratios = sorted(b / a for a, b in zip(*seconds))
    print(f"{engines[1][0]} / {engines[0][0]}: time ratio median {statistics.median(ratios):.3f} "
          f"(pairs {ratios[0]:.3f}-{ratios[-1]:.3f}); same tokens: {tokens[0] == tokens[1]}")
    return 0 if tokens[0] == tokens[1] else 1


if __name__ == "__main__":
    raise SystemExit(main())
