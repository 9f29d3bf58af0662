"""GGUF products per Llama-3.2-1B weight shape (``models.gguf_linear``), per
block type: the default products (x in float32, blocks widened exactly in
registers), the int8-activation products read from the blocks and the same
read from panels of 16 rows (``quantization=w8a8`` on a GGUF model), at decode
and prefill row counts.

    python -m loadtest.bench gguf_gemm --threads 2 [--types Q8_0,Q4_0,Q4_K,Q6_K] [--ms 1,8,32,128,512]

Shapes ``[M, K] x [K, N]``: qkv 2048 -> 3072, o 2048 -> 2048, gate_up 2048 ->
16384, down 8192 -> 2048; the weights are random values rounded into each
type (``loadtest.tiny_gguf.quantize``). Variants run interleaved, round after
round, on the same x and blocks, so they share the machine's drift; each
figure is the median over rounds of the mean time of one call, as GFLOP/s,
with the ratio of panels to blocks, and GB/s of weight bytes (what one row's
call reads from memory).
"""
import argparse
import statistics
from typing import Callable, Dict, List

import numpy as np
import torch

from pagedbackend.models import gguf_linear

from .bf16_gemm import SHAPES
from .common import add_common_args, set_threads, write_result
from .quant_kernels import time_calls

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def layer(kind: str, k: int, n: int, seed: int) -> gguf_linear.GGUFLinear:
    from loadtest.tiny_gguf import quantize
    rows = np.random.default_rng(seed).normal(size=(n, k)).astype(np.float32)
    return gguf_linear.GGUFLinear([torch.from_numpy(quantize(rows, kind))], [kind], k)


def variants(lin: gguf_linear.GGUFLinear) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> x -> x W^T, for every product this machine has."""
    ops = torch.ops.pagedbackend
    w, maps, types, n = lin.weights, lin.row_maps, lin.types, lin.out_features
    found = {"default": lambda x: ops.gguf_linear(x, w, maps, types, n)}
    if gguf_linear.int8_activations_unavailable() is None:
        none = [torch.empty(0, dtype=torch.uint8)]
        found["int8 blocks"] = lambda x: ops.gguf_linear_q8(x, w, maps, none, types, n)
        panels = [gguf_linear.pack_panels(w[0], maps[0], types[0], lin.in_features)]
        if panels[0].numel():
            found["int8 panels"] = lambda x: ops.gguf_linear_q8(x, w, maps, panels, types, n)
    return found


def bench_shape(kind: str, k: int, n: int, ms: List[int], rounds: int, budget_s: float) -> List[dict]:
    lin = layer(kind, k, n, seed=k * 7 + n)
    weight_bytes = lin.weights[0].numel()
    reference = lin.dequantized().double()
    fns = variants(lin)
    g = torch.Generator().manual_seed(n)
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=g)
        exact = x.double() @ reference.T
        for name, fn in fns.items():   # every product is the layer's (int8 x: within its rounding)
            error = (fn(x).double() - exact).abs().max().item()
            if error > 0.05 * exact.abs().max().item():
                raise SystemExit(f"{kind} {name} at {m} x {k} -> {n} is off by {error:.3g}")
        times: Dict[str, List[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(time_calls(fn, x, budget_s))
        row = {"type": kind, "m": m, "k": k, "n": n}
        for name in fns:
            t = statistics.median(times[name])
            row[name] = {"us": t * 1e6, "gflops": 2 * m * k * n / t / 1e9, "weight_gbs": weight_bytes / t / 1e9}
        if "int8 panels" in row:
            row["panels_x_blocks"] = row["int8 blocks"]["us"] / row["int8 panels"]["us"]
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench gguf_gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K", help=f"subset of {','.join(TYPES)}")
    ap.add_argument("--ms", default="1,8,32,128,512", help="row counts M")
    ap.add_argument("--shapes", default="gate_up", help=f"subset of {','.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.1, help="seconds of calls per variant per round")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    ms = [int(m) for m in args.ms.split(",")]
    if args.quick:
        ms, args.rounds, args.budget = [1, 32], 1, 0.01
    kinds = args.types.split(",")
    for kind in kinds:
        if kind not in TYPES:
            raise SystemExit(f"unknown type {kind!r}: one of {', '.join(TYPES)}")
    why = gguf_linear.int8_activations_unavailable()
    print(f"{torch.get_num_threads()} threads; int8 activations: {why or 'yes'}")
    print("| type | shape | M | default GFLOP/s | int8 blocks | int8 panels | panels / blocks | best GB/s |")
    results = []
    for kind in kinds:
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            for row in bench_shape(kind, k, n, ms, args.rounds, args.budget):
                row["shape"] = name
                results.append(row)
                cell = {v: f"{row[v]['gflops']:.0f}" if v in row else "-"
                        for v in ("default", "int8 blocks", "int8 panels")}
                ratio = f"{row['panels_x_blocks']:.2f}x" if "panels_x_blocks" in row else "-"
                best = max(row[v]["weight_gbs"] for v in row if isinstance(row[v], dict))
                print(f"| {kind} | {name} {k}->{n} | {row['m']} | {cell['default']} | {cell['int8 blocks']} | "
                      f"{cell['int8 panels']} | {ratio} | {best:.1f} |", flush=True)
    result = {"threads": torch.get_num_threads(), "int8_activations": why or "yes", "rows": results}
    print(f"wrote {write_result(args.out, 'gguf_gemm', result)}")
    return result


if __name__ == "__main__":
    main()
