"""Where one engine step goes: a prefill step of N prompts and a decode step
with N sequences running, timed (scheduling / forward / sampling and updates,
from the engine's own step timers) and profiled with ``torch.profiler``
(operators by self CPU time).

    python -m loadtest.profile_step --seqs 30 --threads 2 [--no-compile] [--json FILE]

Prompts are token ids of a seeded Alpaca-like trace; greedy, EOS ignored.
A first batch warms everything up (shapes, oneDNN, compiled graphs) and is
left to finish before the measured one starts. Only the engine's public
pieces are used, so the script also runs against older trees.
"""
import argparse
import dataclasses
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from loadtest import workloads


def make_engine(model: str, seqs: int, compile_step: bool, quantization: str = "none"):
    from pagedbackend import LLMEngine
    from pagedbackend.config import EngineConfig
    settings = dict(model=model, max_num_seqs=max(seqs, 64), enable_prefix_caching=False)
    if quantization != "none":
        settings["quantization"] = quantization
    if "compile" in {f.name for f in dataclasses.fields(EngineConfig)}:
        settings["compile"] = compile_step
    from loadtest.bench.common import settings_with_environment
    return LLMEngine(EngineConfig(**settings_with_environment(settings)))


def add_batch(engine, seqs: int, seed: int, max_tokens: int, tag: str) -> None:
    from pagedbackend import SamplingParams
    trace = workloads.alpaca_like(seqs, seed)
    prompts = workloads.make_prompt_token_ids(trace, engine.vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}{i}", ids, params)


def timed_step(engine) -> dict:
    start = time.perf_counter()
    engine.step()
    return {"step_ms": 1000 * (time.perf_counter() - start),
            "schedule_ms": 1000 * engine.last_schedule_seconds,
            "forward_ms": 1000 * engine.last_forward_seconds,
            "sample_ms": 1000 * engine.last_sample_seconds}


def profiled(engine, steps: int, top: int) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"self_cpu_ms_per_step": total / 1000 / steps,
            "ops": [{"op": e.key, "calls_per_step": e.count / steps,
                     "self_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 2),
                     "share": round(e.self_cpu_time_total / total, 3)} for e in rows]}


def median_of(samples) -> dict:
    return {k: round(statistics.median(s[k] for s in samples), 2) for k in samples[0]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.profile_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--seqs", type=int, default=30)
    ap.add_argument("--steps", type=int, default=5, help="decode steps timed, then profiled")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--quantization", default="none", help="the engine's quantization setting")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = make_engine(args.model, args.seqs, not args.no_compile, args.quantization)
    add_batch(engine, args.seqs, seed=1, max_tokens=8, tag="warm")
    while engine.has_unfinished_requests():
        engine.step()

    room = 3 * args.steps + 8
    add_batch(engine, args.seqs, seed=0, max_tokens=room, tag="p")   # measured prefill, unprofiled
    prefill = timed_step(engine)
    while engine.has_unfinished_requests():
        engine.step()
    add_batch(engine, args.seqs, seed=2, max_tokens=room, tag="q")   # profiled prefill
    prefill_profile = profiled(engine, 1, args.top)
    running = len(engine.scheduler.running)
    engine.step()   # first decode step after the prefill
    decode = median_of([timed_step(engine) for _ in range(args.steps)])
    decode_profile = profiled(engine, args.steps, args.top)
    result = {"seqs": args.seqs, "running_in_decode": running, "threads": args.threads,
              "compile": not args.no_compile, "torch": torch.__version__,
              "prefill_tokens": sum(len(p) for p in workloads.make_prompt_token_ids(
                  workloads.alpaca_like(args.seqs, 0), engine.vocab_size, 0)),
              "prefill": {k: round(v, 2) for k, v in prefill.items()}, "prefill_profile": prefill_profile,
              "decode": decode, "decode_profile": decode_profile}
    for name, timing, prof in (("prefill", result["prefill"], prefill_profile),
                               ("decode", decode, decode_profile)):
        print(f"{name}: step {timing['step_ms']:.1f} ms = schedule {timing['schedule_ms']:.2f} + forward "
              f"{timing['forward_ms']:.1f} + sample/update {timing['sample_ms']:.2f} (+ rest); profiled self "
              f"CPU {prof['self_cpu_ms_per_step']:.1f} ms/step")
        for op in prof["ops"]:
            print(f"  {op['op'][:48]:48s} {op['self_ms_per_step']:8.2f} ms {100 * op['share']:5.1f} % "
                  f"{op['calls_per_step']:7.1f} calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
