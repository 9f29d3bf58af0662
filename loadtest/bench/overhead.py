"""Scheduler overhead: Python time per engine step outside the model forward
(scheduling, block tables, sampling, detokenisation, outputs), with N
sequences decoding at once. A tiny model keeps the forward short so the
overhead is visible; the figure does not depend on the model's size.
"""
import argparse
import statistics

from pagedbackend import LLMEngine, SamplingParams
from pagedbackend.config import EngineConfig

from .common import bench_model, write_result


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench overhead", description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=bench_model(args.model), num_kv_blocks=8192,
                                    max_num_seqs=args.seqs, max_num_batched_tokens=16384,
                                    max_model_len=4096))
    for i in range(args.seqs):
        prompt = [100 + (i * 7 + j) % 40000 for j in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=args.steps + 8,
                                                           ignore_eos=True))
    engine.step()   # the prefill of every prompt
    assert len(engine.scheduler.running) == args.seqs
    overhead, forward, schedule, sample = [], [], [], []
    for _ in range(args.steps):
        engine.step()
        forward.append(engine.last_forward_seconds)
        overhead.append(engine.last_step_seconds - engine.last_forward_seconds)
        schedule.append(engine.last_schedule_seconds)
        sample.append(engine.last_sample_seconds)
    result = {"running_seqs": args.seqs, "steps": args.steps,
              "schedule_ms_median": 1000 * statistics.median(schedule),
              "sample_and_update_ms_median": 1000 * statistics.median(sample),
              "overhead_ms_median": 1000 * statistics.median(overhead),
              "overhead_ms_mean": 1000 * statistics.fmean(overhead),
              "forward_ms_median": 1000 * statistics.median(forward),
              "overhead_us_per_seq": 1e6 * statistics.median(overhead) / args.seqs}
    print(f"{args.seqs} running sequences: {result['overhead_ms_median']:.1f} ms per step outside the "
          f"forward ({result['overhead_us_per_seq']:.0f} us per sequence); forward "
          f"{result['forward_ms_median']:.1f} ms; of the overhead, scheduling "
          f"{result['schedule_ms_median']:.1f} ms, sampling + sequence updates "
          f"{result['sample_and_update_ms_median']:.1f} ms")
    print(f"wrote {write_result(args.out, 'overhead', {'model': args.model, **result})}")
    return result


if __name__ == "__main__":
    main()
