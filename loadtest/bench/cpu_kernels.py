"""The CPU path's C kernels against what they replace, on SmolLM2-135M's shapes.

Four parts, each with its variants interleaved round after round (so they
share the machine's drift; figures are medians over rounds):

- ``shapes``: the packed GEMM per weight shape at decode-sized row counts
  against the float32 FMA peak, streamed and cache-resident, beside the
  memory bandwidth of the moment (``gemm_shapes.py`` says how the peak is
  stated and measured).
- ``matmuls``: one decode step's linear layers alone: 30 layers of distinct
  weights (qkv, o, gate_up, down; read from memory, as in a step) and the LM
  head, at M rows: ``F.linear`` against ``linear_backend=packed``
  (``kernels/csrc/packed_gemm.c``; above ``KERNEL_MAX_ROWS`` the weight
  unpacked for torch's GEMM). ``--against REV`` adds the C kernel as it is
  in this tree and as it was at git revision REV, both built with the same
  flags and called the same way (ctypes) on the same packed weights: an A/B
  of a kernel change in one process, round by round. ``--head-rows N``
  gives the LM head only the last N rows, as a prefill of N prompts does;
  ``--unpacked`` adds torch's GEMM on each weight unpacked for the call (what
  a layer does above ``KERNEL_MAX_ROWS``), to place that threshold.
- ``attention``: decode attention of a step's 30 layers for N sequences with
  context lengths drawn (seeded) up to twice the given mean: the gather path
  (``index_select`` + batched matmuls) against the C kernel
  (``kernels/csrc/paged_decode.c``); ``--against REV`` adds that kernel as
  it was at REV.
- ``steps``: whole decode steps of the real engine (default model) with N
  sequences running, 100 tokens past their prompts: ``linear_backend=torch``
  with the gather path (before), ``packed`` with the gather path, and
  ``packed`` with the C attention kernel (the default), one step of each per
  round. Greedy, EOS ignored.
"""
import argparse
import ctypes
import pathlib
import statistics
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .common import add_common_args, set_threads, write_result

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
LAYER_SHAPES = {"qkv": (960, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
                "down": (HIDDEN, INTERMEDIATE)}


def interleaved(fns: Dict[str, Callable[[], object]], rounds: int) -> Dict[str, float]:
    """Median seconds of one call of each, the calls taken in turn each round."""
    for fn in fns.values():
        fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def source_at(rev: str, name: str) -> ctypes.CDLL:
    """``pagedbackend/kernels/csrc/<name>.c`` as of git revision ``rev`` (at
    ``kernels/csrc/`` in revisions before the folder moved into the package),
    built with the flags of this tree's kernel and loaded."""
    from pagedbackend.kernels import native
    root = pathlib.Path(__file__).resolve().parents[2]
    for folder in ("pagedbackend/kernels/csrc", "kernels/csrc"):
        shown = subprocess.run(["git", "show", f"{rev}:{folder}/{name}.c"], cwd=root,
                               capture_output=True, text=True)
        if shown.returncode == 0:
            break
    if shown.returncode != 0:
        raise SystemExit(f"--against {rev}: {shown.stderr.strip()}")
    cc = native.compiler()
    if cc is None:
        raise SystemExit("--against needs a C compiler (gcc or cc) on PATH")
    with tempfile.TemporaryDirectory() as scratch:
        source = pathlib.Path(scratch) / f"{name}.c"
        source.write_text(shown.stdout)
        return ctypes.CDLL(str(native.build(name, cc, source)))


def kernel_at(rev: str) -> ctypes.CDLL:
    """``packed_gemm.c`` as of git revision ``rev``, declared as
    this tree's is."""
    from pagedbackend.kernels import native, packed_linear
    return packed_linear.hand_over_settings(native.declare("packed_gemm", source_at(rev, "packed_gemm")))


def bench_matmuls(ms: List[int], rounds: int, with_int8: bool = False,
                  against: Optional[str] = None, head_rows: Optional[int] = None,
                  unpacked: bool = False) -> List[dict]:
    from pagedbackend.kernels import packed_linear
    from pagedbackend.kernels.packed_linear import PackedLinear
    from pagedbackend.quant.int8 import Int8Linear, PackedInt8Linear
    torch.manual_seed(0)
    layers = [{name: torch.randn(*shape) * shape[1] ** -0.5 for name, shape in LAYER_SHAPES.items()}
              for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN) * HIDDEN ** -0.5
    packed_layers = [{name: PackedLinear(w) for name, w in layer.items()} for layer in layers]
    packed_head = PackedLinear(head)
    int8 = {"packed int8": PackedInt8Linear, "torch int8": Int8Linear} if with_int8 else {}
    int8_layers = {v: [{name: make(w) for name, w in layer.items()} for layer in layers]
                   for v, make in int8.items()}
    int8_heads = {v: make(head) for v, make in int8.items()}
    kernels = {}   # --against: the C kernel of this tree and of REV, called through ctypes
    if against:
        kernels = {"kernel": packed_linear.load_library(), f"kernel@{against}": kernel_at(against)}
        cols = {name: lib.packed_gemm_block_cols() for name, lib in kernels.items()}
        if len(set(cols.values())) != 1:
            raise SystemExit(f"--against {against}: the kernels pack weights in blocks of "
                             f"{cols} columns; they cannot share the packed weights")
        if with_int8:   # the same packed int8 weights for both
            int8_layers.setdefault("packed int8", [{name: PackedInt8Linear(w) for name, w in layer.items()}
                                                   for layer in layers])
            int8_heads.setdefault("packed int8", PackedInt8Linear(head))
    elif unpacked:   # the kernel itself at every size, beside the unpacked weights
        kernels = {"kernel": packed_linear.load_library()}

    def through(library, int8_weights: bool):
        """A linear that calls ``library``'s kernel on a packed layer's weight."""
        threads = torch.get_num_threads()

        def call(layer, x):
            y = torch.empty(x.shape[0], layer.out_features)
            if int8_weights:
                library.packed_gemm_i8(x.data_ptr(), layer.qpacked.data_ptr(), layer.scales.data_ptr(),
                                       y.data_ptr(), x.shape[0], x.shape[1], layer.out_features, threads)
            else:
                library.packed_gemm(x.data_ptr(), layer.packed.data_ptr(), y.data_ptr(), x.shape[0],
                                    x.shape[1], layer.out_features, threads)
            return y

        weights, head_layer = ((int8_layers["packed int8"], int8_heads["packed int8"]) if int8_weights
                               else (packed_layers, packed_head))
        return (lambda x, i, n: call(weights[i][n], x)), (lambda x: call(head_layer, x))

    def walk(linear, lm_head, x):
        for i in range(LAYERS):
            linear(x, i, "qkv")
            linear(x, i, "o")
            up = linear(x, i, "gate_up")
            linear(up[:, :INTERMEDIATE].contiguous(), i, "down")
        return lm_head(x[-head_rows:] if head_rows else x)

    rows = []
    for m in ms:
        x = torch.randn(m, HIDDEN)
        fns = {"F.linear": lambda: walk(lambda x, i, n: F.linear(x, layers[i][n]),
                                        lambda x: F.linear(x, head), x),
               "packed": lambda: walk(lambda x, i, n: packed_layers[i][n](x), packed_head, x)}
        if unpacked:
            fns["unpacked"] = lambda: walk(lambda x, i, n: F.linear(x, packed_layers[i][n].dequantized()),
                                           lambda x: F.linear(x, packed_head.dequantized()), x)
        for variant in int8:
            fns[variant] = (lambda v: lambda: walk(lambda x, i, n: int8_layers[v][i][n](x),
                                                   int8_heads[v], x))(variant)
        for name, library in kernels.items():
            for int8_weights in (False, True) if with_int8 else (False,):
                variant = name.replace("kernel", "kernel int8") if int8_weights else name
                fns[variant] = (lambda calls: lambda: walk(*calls, x))(through(library, int8_weights))
        with torch.inference_mode():
            error = ((fns["packed"]() - fns["F.linear"]()).abs().max()
                     / fns["F.linear"]().abs().max()).item()
            for name, fn in fns.items():   # each version of the kernel computes the same
                if name.startswith("kernel") and not torch.allclose(
                        fn(), fns["packed int8" if "int8" in name else "packed"](), rtol=1e-4, atol=1e-4):
                    raise SystemExit(f"{name} computes another product than this tree's layers")
            medians = interleaved(fns, rounds)
        flops = 2 * (m * LAYERS * sum(a * b for a, b in LAYER_SHAPES.values())
                     + min(m, head_rows or m) * VOCAB * HIDDEN)
        rows.append({"m": m, **{f"{name}_ms": s * 1e3 for name, s in medians.items()},
                     "speedup": medians["F.linear"] / medians["packed"],
                     "packed_gflops": flops / medians["packed"] / 1e9,
                     "F.linear_gflops": flops / medians["F.linear"] / 1e9,
                     "max_rel_error_lm_head": error,
                     **{f"{v}_speedup": medians["F.linear"] / medians[v] for v in int8}})
        if unpacked:   # the kernel / torch's GEMM on each weight unpacked for the call
            rows[-1]["unpacked_ms"] = medians["unpacked"] * 1e3
            rows[-1]["kernel_vs_unpacked"] = medians["kernel"] / medians["unpacked"]
        if against:   # this tree's kernel / REV's: below 1, faster now
            rows[-1]["against_ratio"] = medians["kernel"] / medians[f"kernel@{against}"]
            if with_int8:
                rows[-1]["against_ratio_int8"] = medians["kernel int8"] / medians[f"kernel int8@{against}"]
    return rows


def bench_attention(seq_counts: List[int], mean_lens: List[int], rounds: int,
                    seed: int, against: Optional[str] = None) -> List[dict]:
    """Each variant over all 30 layers' caches in turn (as a step reads
    them: from memory, not from a cache the previous call left warm)."""
    from pagedbackend.kernels import sdpa_attention as sa
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    before = None
    if against:   # the C kernel at REV, called as this tree's is
        from pagedbackend.kernels import native
        before = native.declare("paged_decode", source_at(against, "paged_decode")).paged_decode
    rows = []
    for n in seq_counts:
        for mean_len in mean_lens:
            gen = torch.Generator().manual_seed(seed + n + mean_len)
            lens = torch.randint(1, 2 * mean_len, (n,), generator=gen, dtype=torch.int32)
            max_blocks = int(-(-int(lens.max()) // block_size))
            num_blocks = n * max_blocks + 1
            tables = (torch.randperm(num_blocks - 1, generator=gen)[: n * max_blocks] + 1)
            tables = tables.view(n, max_blocks).to(torch.int32)
            caches = [(torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen),
                       torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen))
                      for _ in range(LAYERS)]
            q = torch.randn(n, heads, dim, generator=gen)
            plan = sa.plan_sdpa_attention(torch.arange(n + 1, dtype=torch.int32), lens,
                                          block_tables=tables,
                                          slot_mapping=torch.zeros(n, dtype=torch.long),
                                          block_size=block_size, num_heads=heads,
                                          num_kv_heads=kv_heads)

            def run(native: bool):
                sa.USE_NATIVE_DECODE = native
                try:
                    return [sa._decodes(q, k, v, plan, dim ** -0.5) for k, v in caches]
                finally:
                    sa.USE_NATIVE_DECODE = True

            def run_before():
                outs = []
                for k_cache, v_cache in caches:
                    out = torch.empty_like(q)
                    before(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                           tables.data_ptr(), max_blocks, lens.data_ptr(), n, heads, kv_heads, dim,
                           block_size, dim ** -0.5, 0, None, torch.get_num_threads())
                    outs.append(out)
                return outs

            def error(a, b):
                return max((x - y).abs().max().item() for x, y in zip(a, b))

            fns = {"gather": lambda: run(False), "C kernel": lambda: run(True)}
            if before is not None:
                fns[f"C kernel@{against}"] = run_before
            medians = interleaved(fns, rounds)
            kv_bytes = 2 * int(lens.sum()) * kv_heads * dim * 4 * LAYERS
            rows.append({"seqs": n, "mean_len": mean_len, "keys": int(lens.sum()), "layers": LAYERS,
                         "gather_us": medians["gather"] * 1e6, "kernel_us": medians["C kernel"] * 1e6,
                         "speedup": medians["gather"] / medians["C kernel"],
                         "kernel_kv_gb_s": kv_bytes / medians["C kernel"] / 1e9,
                         "max_abs_error": error(run(True), run(False))})
            if before is not None:   # this tree's kernel / REV's: below 1, faster now
                rows[-1].update({"before_us": medians[f"C kernel@{against}"] * 1e6,
                                 "against_ratio": medians["C kernel"] / medians[f"C kernel@{against}"],
                                 "before_max_abs_error": error(run(True), run_before())})
    return rows


def bench_steps(seq_counts: List[int], rounds: int, compile_step: bool, seed: int) -> List[dict]:
    from loadtest import workloads
    from pagedbackend import LLMEngine, SamplingParams
    from pagedbackend.config import EngineConfig
    from pagedbackend.kernels import sdpa_attention as sa
    engines = {backend: LLMEngine(EngineConfig(model="default", max_num_seqs=64, compile=compile_step,
                                               enable_prefix_caching=False, linear_backend=backend))
               for backend in ("torch", "packed")}
    variants = {"before (F.linear, gather)": ("torch", False), "packed, gather": ("packed", False),
                "packed, C attention": ("packed", True)}
    rows = []
    for n in seq_counts:
        prompts = workloads.make_prompt_token_ids(workloads.alpaca_like(n, seed), 49152, seed)
        params = SamplingParams(temperature=0.0, max_tokens=100 + 2 * rounds + 8, ignore_eos=True)
        for engine in engines.values():
            for i, ids in enumerate(prompts):
                engine.add_request(f"{n}-{i}", ids, params)
            for _ in range(100):
                engine.step()

        def step(backend: str, native: bool):
            sa.USE_NATIVE_DECODE = native
            try:
                engines[backend].step()
            finally:
                sa.USE_NATIVE_DECODE = True

        medians = interleaved({name: (lambda b=b, nat=nat: step(b, nat))
                               for name, (b, nat) in variants.items()}, rounds)
        for engine in engines.values():
            while engine.has_unfinished_requests():
                engine.step()
        before = medians["before (F.linear, gather)"]
        rows.append({"seqs": n, **{f"{name}_ms": s * 1e3 for name, s in medians.items()},
                     **{f"{name}_speedup": before / s for name, s in medians.items()}})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench cpu_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="shapes,matmuls,attention,steps")
    ap.add_argument("--shape-ms", default="8,16,32,64", help="rows of the per-shape GEMMs (shapes)")
    ap.add_argument("--fma-units", type=int, default=2, help="vector FMA units per core, for the stated peak")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256", help="rows of the matmul walk")
    ap.add_argument("--seqs", default="1,8,30", help="sequence counts (attention and steps)")
    ap.add_argument("--mean-lens", default="64,256", help="mean context lengths (attention)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-compile", action="store_true", help="steps: run the model step eager")
    ap.add_argument("--int8", action="store_true",
                    help="matmuls: also int8 weights, packed (packed_gemm_i8) and torch's (quantization=int8)")
    ap.add_argument("--head-rows", type=int, metavar="N",
                    help="matmuls: the LM head on the last N rows only, as in a prefill of N "
                         "sequences (default: every row, as in a decode step)")
    ap.add_argument("--unpacked", action="store_true",
                    help="matmuls: also torch's GEMM on each packed weight unpacked for the call "
                         "(what a layer does above KERNEL_MAX_ROWS rows)")
    ap.add_argument("--against", metavar="REV",
                    help="matmuls and attention: also this tree's C kernel against the one at git "
                         "revision REV")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.ms, args.seqs, args.mean_lens, args.rounds, args.shape_ms = "1,8", "1,4", "64", 3, "8,32"
        args.parts = "shapes,matmuls,attention"
    set_threads(args.threads)
    parts = args.parts.split(",")
    result = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "rounds": args.rounds}
    seqs = [int(s) for s in args.seqs.split(",")]
    if "shapes" in parts:
        from . import gemm_shapes
        result["peak"] = gemm_shapes.peak(torch.get_num_threads(), args.fma_units, args.rounds)
        light = {"copies": 3, "bandwidth_floats": 16_000_000} if args.quick else {}
        result["shapes"] = gemm_shapes.bench_shapes([int(m) for m in args.shape_ms.split(",")], args.rounds,
                                                    torch.get_num_threads(), **light)
        gemm_shapes.print_rows(result)
    if "matmuls" in parts:
        result["matmuls"] = bench_matmuls([int(m) for m in args.ms.split(",")], args.rounds, args.int8,
                                          args.against, args.head_rows, args.unpacked)
        result["against"], result["head_rows"] = args.against, args.head_rows
        extra = ("packed int8", "torch int8") if args.int8 else ()
        versions = []
        if args.against:
            versions = [("kernel", f"kernel@{args.against}", "against_ratio")]
            if args.int8:
                versions.append(("kernel int8", f"kernel int8@{args.against}", "against_ratio_int8"))
        print(f"{'M':>4s} {'F.linear ms':>12s} {'packed ms':>10s} {'x':>6s} {'GFLOP/s':>8s}"
              + "".join(f" {v + ' ms':>15s} {'x':>6s}" for v in extra)
              + "".join(f" {now + ' ms':>15s} {then + ' ms':>18s} {'ratio':>6s}" for now, then, _ in versions))
        for r in result["matmuls"]:
            print(f"{r['m']:>4d} {r['F.linear_ms']:12.1f} {r['packed_ms']:10.1f} {r['speedup']:6.2f} "
                  f"{r['packed_gflops']:8.1f}"
                  + "".join(f" {r[v + '_ms']:15.1f} {r[v + '_speedup']:6.2f}" for v in extra)
                  + "".join(f" {r[now + '_ms']:15.1f} {r[then + '_ms']:18.1f} {r[ratio]:6.2f}"
                            for now, then, ratio in versions))
        if args.unpacked:
            print("unpacked for the call: " + ", ".join(
                f"{r['m']} rows {r['unpacked_ms']:.1f} ms (kernel {r['kernel_vs_unpacked']:.2f}x its time)"
                for r in result["matmuls"]))
    if "attention" in parts:
        result["attention"] = bench_attention(seqs, [int(s) for s in args.mean_lens.split(",")],
                                              args.rounds, args.seed, args.against)
        print(f"30 layers: {'seqs':>4s} {'mean len':>8s} {'gather us':>10s} {'kernel us':>10s} {'x':>6s} "
              f"{'KV GB/s':>8s}" + (f" {'kernel@' + args.against + ' us':>18s} {'ratio':>6s}" if args.against else ""))
        for r in result["attention"]:
            print(f"           {r['seqs']:>4d} {r['mean_len']:>8d} {r['gather_us']:10.0f} {r['kernel_us']:10.0f} "
                  f"{r['speedup']:6.2f} {r['kernel_kv_gb_s']:8.1f}"
                  + (f" {r['before_us']:18.0f} {r['against_ratio']:6.2f}" if args.against else ""))
    if "steps" in parts:
        result["steps"] = bench_steps(seqs, args.rounds, not args.no_compile, args.seed)
        for r in result["steps"]:
            print(f"{r['seqs']:>4d} seqs: " + ", ".join(
                f"{k[:-3]} {v:.1f} ms" for k, v in r.items() if k.endswith("_ms")))
    print(f"wrote {write_result(args.out, 'cpu_kernels', result)}")
    return result


if __name__ == "__main__":
    main()
