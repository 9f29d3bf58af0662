"""Weight-only quantised matmuls vs fp32 on SmolLM2-135M's and Llama-3.2-1B's linear shapes.

For each shape (``[M, K] x [K, N]``: SmolLM2's qkv, o, gate_up, down, lm_head;
the 1 B model's ``1b_o`` 2048->2048, ``1b_up`` 2048->8192, ``1b_down``
8192->2048) and token count M, times ``F.linear`` in fp32 against the kernels
the ``quantization`` setting uses (``pagedbackend.quant``): "int8 packed" (the
packed C kernel ``quantization=int8`` takes where it builds), torch's int8
kernel as ``Int8Linear`` runs it ("int8": bf16 inputs up to
``INT8_KERNEL_MAX_ROWS`` rows, ``(x q^T) s`` with q widened above; "int8
kernel" and "int8 widened" at every M), "int4" (Q4_1 blocks of 32 through
``gguf_gemm.c``, x as given) and "int4 a8" (the same with
``int4_activations=int8``: x rounded to int8 per 32, VNNI panels), "int4
torch" (torch's ``_weight_int4pack_mm_for_cpu`` with groups of 32 and bf16
inputs: what ``quantization=int4`` ran before), torch's kernels with fp32
inputs ("fp32-in": a scalar path; M <= 32 only), and bf16 weights
(activations cast to bf16 and the result back to fp32). With ``--compile``
also fp32, int8 (dequantise-then-matmul, which inductor may pattern-match) and
bf16 under ``torch.compile``.

Variants run interleaved, round after round, so they share the machine's
drift; each figure is the median over rounds of the mean time of one call.
Ratios are fp32 time / variant time (above 1: faster than fp32); GB/s is the
weight's bytes (as the variant stores them) per call / time.
"""
import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from pagedbackend.quant import int4
from pagedbackend.quant.int4 import Int4Linear
from pagedbackend.quant.int8 import Int8Linear, PackedInt8Linear

from .common import add_common_args, set_threads, write_result

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, vocab 49152.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}
# Llama-3.2-1B: hidden 2048, intermediate 8192 (--shapes 1b_o,1b_up,1b_down).
SHAPES_1B = {"1b_o": (2048, 2048), "1b_up": (2048, 8192), "1b_down": (8192, 2048)}


def torch_int4(weight: torch.Tensor, group: int, act_dtype: torch.dtype = torch.bfloat16) -> Callable:
    """torch's int4 kernel as ``quantization=int4`` ran it before gguf_gemm.c:
    min/max per group, ``w = (q - 8) s + z`` with s and z in ``act_dtype``."""
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(rows, cols).contiguous(), 1)
    scale_zero = torch.stack([scale, low + 8.0 * scale], dim=-1).transpose(0, 1).contiguous().to(act_dtype)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(act_dtype), packed, group,
                                                                 scale_zero).float()


def weight_bytes(name: str, n: int, k: int) -> int:
    """Bytes of a ``[n, k]`` weight as variant ``name`` stores them (read once per call)."""
    if name.startswith("int4 torch"):
        return n * k // 2 + n * k // int(name.split("g")[-1].split()[0]) * 4   # nibbles, bf16 s and z
    if name.startswith("int4"):
        return n * k // int4.INT4_GROUP_SIZE * int4.Q4_1_BYTES
    if name.startswith("int8"):
        return n * k + 4 * n
    return n * k * (2 if name.startswith("bf16") else 4)


def variants(weight: torch.Tensor, compile_too: bool) -> Dict[str, Callable]:
    """name -> callable(x) for one weight; every callable returns float32."""
    w_bf16 = weight.bfloat16()
    int8 = Int8Linear(weight)
    out: Dict[str, Callable] = {
        "fp32": lambda x: F.linear(x, weight),
        "bf16": lambda x: F.linear(x.bfloat16(), w_bf16).float(),
        "int8": int8,
        "int8 kernel": Int8Linear(weight, kernel_max_rows=1 << 30),
        "int8 fp32-in": Int8Linear(weight, act_dtype=torch.float32, kernel_max_rows=1 << 30),
        "int8 widened": Int8Linear(weight, kernel_max_rows=0),
        "int4 torch g32": torch_int4(weight, 32),
        "int4 torch g32 fp32-in": torch_int4(weight, 32, torch.float32),
    }
    try:
        out["int8 packed"] = PackedInt8Linear(weight)
    except (RuntimeError, ValueError) as exc:
        print(f"int8 packed: not timed ({exc})")
    if int4.unavailable() is None:
        out["int4"] = Int4Linear.from_float(weight)
    if int4.unavailable(int8_activations=True) is None:
        out["int4 a8"] = Int4Linear.from_float(weight, int8_activations=True)
    if compile_too:
        q, scales = int8.qweight, int8.scales
        out["fp32 compiled"] = torch.compile(lambda x: F.linear(x, weight), dynamic=False)
        out["int8 compiled"] = torch.compile(lambda x: F.linear(x, q.to(x.dtype)) * scales, dynamic=False)
        out["int8 bf16 compiled"] = torch.compile(int8, dynamic=False)
        out["bf16 compiled"] = torch.compile(lambda x: F.linear(x.bfloat16(), w_bf16).float(),
                                             dynamic=False)
    return out


def time_calls(fn: Callable, x: torch.Tensor, budget_s: float) -> float:
    """Mean seconds per call over about ``budget_s`` of calls."""
    start = time.perf_counter()
    fn(x)
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(budget_s / once))
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


def bench_shape(k: int, n: int, ms: List[int], rounds: int, budget_s: float,
                compile_too: bool, only: Optional[List[str]] = None) -> List[dict]:
    torch.manual_seed(0)
    weight = torch.randn(n, k) * k ** -0.5
    fns_all = {name: fn for name, fn in variants(weight, compile_too).items()
               if only is None or name == "fp32" or name in only}
    rows = []
    for m in ms:
        x = torch.randn(m, k)
        # torch's scalar fp32-input path takes seconds per call beyond 32 rows.
        fns = {name: fn for name, fn in fns_all.items() if m <= 32 or "fp32-in" not in name}
        with torch.inference_mode():
            reference = F.linear(x, weight)
            errors = {name: ((fn(x) - reference).abs().max() / reference.abs().max()).item()
                      for name, fn in fns.items()}   # also the warm-up (and compile) of each
            times: Dict[str, List[float]] = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    times[name].append(time_calls(fn, x, budget_s))
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name, seconds in medians.items():
            rows.append({"m": m, "k": k, "n": n, "variant": name, "us": seconds * 1e6,
                         "vs_fp32": medians["fp32"] / seconds,
                         "gflops": 2 * m * k * n / seconds / 1e9,
                         "weight_gbps": weight_bytes(name, n, k) / seconds / 1e9,
                         "max_rel_error": errors[name]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench quant_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8,16,32,128", help="token counts M")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"subset of {','.join(SHAPES)},{','.join(SHAPES_1B)}")
    ap.add_argument("--variants", default=None,
                    help="only these variants (comma-separated names as printed; fp32 always runs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds of calls per variant per round")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile variants")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.ms, args.rounds, args.budget = "o,lm_head", "1,32", 2, 0.01
    set_threads(args.threads)
    # The compiled lambdas share code objects across shapes: one graph per (shape, M).
    torch._dynamo.config.recompile_limit = 64
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    for name in args.shapes.split(","):
        k, n = {**SHAPES, **SHAPES_1B}[name]
        only = args.variants.split(",") if args.variants else None
        for row in bench_shape(k, n, ms, args.rounds, args.budget, args.compile, only):
            rows.append({"shape": name, **row})
    print(f"{'shape':8s} {'K->N':>11s} {'M':>3s} {'variant':22s} {'us':>9s} {'x fp32':>7s} "
          f"{'GFLOP/s':>8s} {'w GB/s':>7s} {'rel err':>8s}")
    for r in rows:
        print(f"{r['shape']:8s} {r['k']:>5d}->{r['n']:<5d} {r['m']:>3d} {r['variant']:22s} "
              f"{r['us']:9.1f} {r['vs_fp32']:7.2f} {r['gflops']:8.1f} {r['weight_gbps']:7.1f} "
              f"{r['max_rel_error']:8.1e}")
    result = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "rounds": args.rounds, "rows": rows}
    print(f"wrote {write_result(args.out, 'quant_kernels', result)}")
    return result


if __name__ == "__main__":
    main()
