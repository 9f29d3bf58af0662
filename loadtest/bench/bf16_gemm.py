"""bfloat16 products per Llama-3.2-1B weight shape (``models.bf16_linear``):
the kernel on the paired layout (``pair``: where the CPU has AVX512-BF16),
the kernel on the loaded layout (AMX tiles where the CPU has them, else dot
products with a horizontal sum per output) and torch's GEMM (oneDNN) on the
loaded layout, at decode and prefill row counts.

    python -m loadtest.bench bf16_gemm --threads 2 [--ms 1,8,32,128,512] [--rounds 5]

Shapes ``[M, K] x [K, N]``: qkv 2048 -> 3072, o 2048 -> 2048, gate_up 2048 ->
16384, down 8192 -> 2048. Variants run interleaved, round after round, on
the same x and W, so they share the machine's drift; each figure is the
median over rounds of the mean time of one call, as GFLOP/s, with the ratio
to torch's GEMM (above 1: faster). Below ~8 rows a step reads its weights
(2-64 MB) from memory, so GB/s of weight bytes is given too.
"""
import argparse
import statistics
from typing import Callable, Dict, List

import torch

from pagedbackend.models import bf16_linear

from .common import add_common_args, set_threads, write_result
from .quant_kernels import time_calls

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}


def variants(weight: torch.Tensor) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> x -> x W^T in bfloat16, for every path this machine has."""
    found = {"torch": lambda x: torch.mm(x, weight.t())}
    large = 1 << 30
    found["kernel"] = lambda x: torch.ops.pagedbackend.bf16_linear(x, weight, large)
    if bf16_linear.load_library().bf16_gemm_paired_available():
        paired, n = bf16_linear.pair(weight), weight.shape[0]
        found["paired"] = lambda x: torch.ops.pagedbackend.bf16_linear_paired(x, paired, n)
    return found


def bench_shape(k: int, n: int, ms: List[int], rounds: int, budget_s: float) -> List[dict]:
    g = torch.Generator().manual_seed(k * 7 + n)
    weight = torch.randn(n, k, generator=g).bfloat16()
    fns = variants(weight)
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=g).bfloat16()
        reference = fns["torch"](x).float()
        for name, fn in fns.items():   # every path computes the same product
            error = (fn(x).float() - reference).abs().max().item()
            if error > 0.02 * reference.abs().max().item():
                raise SystemExit(f"{name} at {m} x {k} -> {n} is off by {error:.3g}")
        times: Dict[str, List[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(time_calls(fn, x, budget_s))
        row = {"m": m, "k": k, "n": n}
        base = statistics.median(times["torch"])
        for name in fns:
            t = statistics.median(times[name])
            row[name] = {"us": t * 1e6, "gflops": 2 * m * k * n / t / 1e9, "weight_gbs": 2 * k * n / t / 1e9,
                         "x_torch": base / t}
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench bf16_gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8,32,128,512", help="row counts M")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.1, help="seconds of calls per variant per round")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    if bf16_linear.unavailable(torch.device("cpu"), torch.bfloat16):
        raise SystemExit(f"no bfloat16 kernel here: {bf16_linear.unavailable(torch.device('cpu'), torch.bfloat16)}")
    ms = [int(m) for m in args.ms.split(",")]
    if args.quick:
        ms, args.rounds, args.budget = [1, 32], 1, 0.01
    results = []
    print(f"bf16 kernel: {bf16_linear.isa()}; paired layout served: {bf16_linear.pairs()}; "
          f"{torch.get_num_threads()} threads")
    print("| shape | M | " + " | ".join(f"{v} GFLOP/s (x torch)" for v in variants(torch.zeros(16, 16).bfloat16()))
          + " | best GB/s |")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        for row in bench_shape(k, n, ms, args.rounds, args.budget):
            row["shape"] = name
            results.append(row)
            paths = [key for key in row if isinstance(row[key], dict)]
            cells = " | ".join(f"{row[p]['gflops']:.0f} ({row[p]['x_torch']:.2f}x)" for p in paths)
            best = max(row[p]["weight_gbs"] for p in paths)
            print(f"| {name} {k}->{n} | {row['m']} | {cells} | {best:.1f} |", flush=True)
    result = {"isa": bf16_linear.isa(), "paired": bf16_linear.pairs(), "threads": torch.get_num_threads(),
              "rows": results}
    print(f"wrote {write_result(args.out, 'bf16_gemm', result)}")
    return result


if __name__ == "__main__":
    main()
