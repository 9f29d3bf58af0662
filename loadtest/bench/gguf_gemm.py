"""GGUF products per Llama-3.2-1B weight shape (``models.gguf_linear``), per
block type: the default products (x in float32, blocks widened exactly in
registers), the int8-activation products read from the blocks and the same
read from panels of 16 rows (``quantization=w8a8`` on a GGUF model), at decode
and prefill row counts.

    python -m loadtest.bench gguf_gemm --threads 2 [--types Q8_0,Q4_0,Q4_K,Q6_K] [--ms 1,8,32,128,512]

Shapes ``[M, K] x [K, N]``: qkv 2048 -> 3072, o 2048 -> 2048, gate_up 2048 ->
16384, down 8192 -> 2048; the weights are random values rounded into each
type (``loadtest.tiny_gguf.quantize``). Variants run interleaved, round after
round (their order turning), on the same x and blocks, so they share the machine's drift; each
figure is the median over rounds of the mean time of one call, as GFLOP/s,
with the ratio of panels to blocks, and GB/s of weight bytes (what one row's
call reads from memory).

``--against REV``: the panel products of ``gguf_gemm.c`` as it was at git
revision REV too ("panels @REV", the same panels; refused where its products
differ from this tree's), with the ratio of its time to this tree's kernel
called the same way ("panels @tree": straight into the library, without the
operator's checks, which cost some tens of microseconds a call).
``--cpu-time``: the process's CPU time instead of the wall clock (with
``--threads 1``, a measure that a busy neighbour on the other cores moves
little). ``--from-memory MB``: copies of each layer, MB of weights in all,
called in turn, so that every call reads its weights from memory rather than
from the cache (a decode step's case; one layer alone stays in L3).
"""
import argparse
import ctypes
import statistics
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from pagedbackend.models import gguf_linear

from .bf16_gemm import SHAPES
from .common import add_common_args, set_threads, write_result
from .cpu_kernels import source_at
from .quant_kernels import time_calls

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def layer(kind: str, k: int, n: int, seed: int) -> gguf_linear.GGUFLinear:
    from loadtest.tiny_gguf import quantize
    rows = np.random.default_rng(seed).normal(size=(n, k)).astype(np.float32)
    return gguf_linear.GGUFLinear([torch.from_numpy(quantize(rows, kind))], [kind], k)


def cpu_time_calls(fn: Callable, x: torch.Tensor, budget_s: float) -> float:
    """As ``time_calls``, in the process's CPU time."""
    start = time.process_time()
    fn(x)
    calls = max(1, int(budget_s / max(time.process_time() - start, 1e-6)))
    start = time.process_time()
    for _ in range(calls):
        fn(x)
    return (time.process_time() - start) / calls


def panels_at(rev: str) -> Callable:
    """``gguf_gemm_q8_panels`` of ``gguf_gemm.c`` as of git revision ``rev``."""
    function = source_at(rev, "gguf_gemm").gguf_gemm_q8_panels
    here = gguf_linear.load_library().gguf_gemm_q8_panels
    function.argtypes, function.restype = here.argtypes, here.restype
    return function


def variants(lin: gguf_linear.GGUFLinear, old: Optional[Callable] = None,
             rev: str = "") -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> x -> x W^T, for every product this machine has (``old``: the
    panel products of revision ``rev``)."""
    ops = torch.ops.pagedbackend
    w, maps, types, n = lin.weights, lin.row_maps, lin.types, lin.out_features
    found = {"default": lambda x: ops.gguf_linear(x, w, maps, types, n)}
    if gguf_linear.int8_activations_unavailable() is None:
        none = [torch.empty(0, dtype=torch.uint8)]
        found["int8 blocks"] = lambda x: ops.gguf_linear_q8(x, w, maps, none, types, n)
        panels = [gguf_linear.pack_panels(w[0], maps[0], types[0], lin.in_features)]
        if panels[0].numel():
            found["int8 panels"] = lambda x: ops.gguf_linear_q8(x, w, maps, panels, types, n)
            if old is not None:   # both called alike, without the operator's checks
                here = gguf_linear.load_library().gguf_gemm_q8_panels
                found[f"panels @{rev}"] = lambda x: gguf_linear._call_parts(old, x, w, maps, types, [n], n, panels)
                found["panels @tree"] = lambda x: gguf_linear._call_parts(here, x, w, maps, types, [n], n, panels)
    return found


def in_turn(calls: List[Callable]) -> Callable:
    """One call of ``calls`` after the other, round and round."""
    state = {"next": 0}

    def call(x):
        state["next"] = (state["next"] + 1) % len(calls)
        return calls[state["next"]](x)
    return call


def bench_shape(kind: str, k: int, n: int, ms: List[int], rounds: int, budget_s: float,
                old: Optional[Callable] = None, rev: str = "", timer: Callable = time_calls,
                from_memory_mb: float = 0) -> List[dict]:
    lin = layer(kind, k, n, seed=k * 7 + n)
    weight_bytes = lin.weights[0].numel()
    reference = lin.dequantized().double()
    fns = variants(lin, old, rev)
    copies = int(from_memory_mb * 1e6 // weight_bytes)
    if copies > 1:   # the same blocks at other addresses: every call's products are the first's
        others = [variants(gguf_linear.GGUFLinear([lin.weights[0].clone()], [kind], k), old, rev)
                  for _ in range(copies - 1)]
        fns = {name: in_turn([fn] + [o[name] for o in others]) for name, fn in fns.items()}
    g = torch.Generator().manual_seed(n)
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=g)
        exact = x.double() @ reference.T
        for name, fn in fns.items():   # every product is the layer's (int8 x: within its rounding)
            error = (fn(x).double() - exact).abs().max().item()
            if error > 0.05 * exact.abs().max().item():
                raise SystemExit(f"{kind} {name} at {m} x {k} -> {n} is off by {error:.3g}")
        if f"panels @{rev}" in fns and not torch.equal(fns[f"panels @{rev}"](x), fns["panels @tree"](x)):
            raise SystemExit(f"--against {rev}: its {kind} panel products differ from this tree's")
        times: Dict[str, List[float]] = {name: [] for name in fns}
        names = list(fns)
        for r in range(rounds):   # the order turns each round: a call that follows one reading the same
            for name in names[r % len(names):] + names[:r % len(names)]:   # blocks finds some in the cache
                times[name].append(timer(fns[name], x, budget_s))
        row = {"type": kind, "m": m, "k": k, "n": n}
        for name in fns:
            t = statistics.median(times[name])
            row[name] = {"us": t * 1e6, "gflops": 2 * m * k * n / t / 1e9, "weight_gbs": weight_bytes / t / 1e9}
        if "int8 panels" in row:
            row["panels_x_blocks"] = row["int8 blocks"]["us"] / row["int8 panels"]["us"]
        if f"panels @{rev}" in row:
            row["x_rev"] = row[f"panels @{rev}"]["us"] / row["panels @tree"]["us"]
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
    ap.add_argument("--against", metavar="REV", help="also the panel products of gguf_gemm.c at git revision REV")
    ap.add_argument("--cpu-time", action="store_true", help="time in the process's CPU time (use with --threads 1)")
    ap.add_argument("--from-memory", type=float, default=0, metavar="MB",
                    help="copies of each layer, MB of weights in all, called in turn (weights read from memory)")
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
    old = panels_at(args.against) if args.against and why is None else None
    timer = cpu_time_calls if args.cpu_time else time_calls
    print(f"{torch.get_num_threads()} threads; int8 activations: {why or 'yes'}"
          f"{'; CPU time' if args.cpu_time else ''}"
          f"{f'; weights from memory ({args.from_memory:.0f} MB of copies)' if args.from_memory else ''}")
    print("| type | shape | M | default GFLOP/s | int8 blocks | int8 panels | panels / blocks | best GB/s |"
          + (f" @{args.against} / this tree |" if old else ""))
    results = []
    for kind in kinds:
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            for row in bench_shape(kind, k, n, ms, args.rounds, args.budget, old, args.against or "", timer,
                                   args.from_memory):
                row["shape"] = name
                results.append(row)
                cell = {v: f"{row[v]['gflops']:.0f}" if v in row else "-"
                        for v in ("default", "int8 blocks", "int8 panels")}
                ratio = f"{row['panels_x_blocks']:.2f}x" if "panels_x_blocks" in row else "-"
                best = max(row[v]["weight_gbs"] for v in row if isinstance(row[v], dict))
                against = f" {row['x_rev']:.2f}x |" if "x_rev" in row else (" - |" if old else "")
                print(f"| {kind} | {name} {k}->{n} | {row['m']} | {cell['default']} | {cell['int8 blocks']} | "
                      f"{cell['int8 panels']} | {ratio} | {best:.1f} |{against}", flush=True)
    result = {"threads": torch.get_num_threads(), "int8_activations": why or "yes", "cpu_time": args.cpu_time,
              "from_memory_mb": args.from_memory,
              "against": args.against, "rows": results}
    print(f"wrote {write_result(args.out, 'gguf_gemm', result)}")
    return result


if __name__ == "__main__":
    main()
