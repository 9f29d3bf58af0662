"""The packed layers' operators with Python kernels against those with C++
kernels, paired in one process: one decode step of ``--rows`` sequences
(contexts of 60, 100, 140, ... tokens) through the compiled model, the two
graphs alternating step by step so that a noisy host weighs on both alike.

    python -m loadtest.native_ops_ab --rows 5 --steps 60
"""
import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.native_ops_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pagedbackend.config import EngineConfig
    from pagedbackend.models import packed_linear
    from pagedbackend.worker.batch import SeqEntry
    from pagedbackend.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=args.model, device="cpu", num_kv_blocks=400))
    if not packed_linear.use_native_ops:
        raise SystemExit(f"the C++ operators are not in use: {packed_linear.native_ops_failure}")
    entries, next_block = [], 1
    for length in (60 + 40 * i for i in range(args.rows)):
        blocks = -(-(length + 1) // 16)
        entries.append(SeqEntry([100 + length], length, list(range(next_block, next_block + blocks))))
        next_block += blocks
    times = {False: [], True: []}
    for native in (False, True):   # compile and warm both graphs
        packed_linear.use_native_ops = native
        for _ in range(3):
            runner.execute_model(entries)
    for i in range(args.steps):
        for native in ((False, True) if i % 2 else (True, False)):
            packed_linear.use_native_ops = native
            start = time.perf_counter()
            runner.execute_model(entries)
            times[native].append(1000 * (time.perf_counter() - start))
    for native, name in ((False, "Python kernels"), (True, "C++ kernels")):
        print(f"{name}: median step {statistics.median(times[native]):.2f} ms, min {min(times[native]):.2f} ms")
    diff = statistics.median(b - a for a, b in zip(times[False], times[True]))
    print(f"paired difference (C++ - Python), median: {diff:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
