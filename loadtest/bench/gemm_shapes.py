"""The packed GEMM (``kernels/csrc/packed_gemm.c``) per weight shape of
SmolLM2-135M at decode-sized row counts, against the machine's float32 FMA
peak: ``python -m loadtest.bench cpu_kernels --parts shapes``.

Peak, stated: threads x GHz x FMA units x lanes x 2 (an FMA is two
operations), with GHz the nominal clock of ``/proc/cpuinfo`` ("cpu MHz"),
two FMA units per core (``--fma-units``: Intel Xeon Scalable and AMD Zen 4
issue two vector FMAs a cycle), and 16 float lanes with AVX-512 (8 with
AVX2). Beside it, measured (``csrc/fma_probe.c``): the throughput of 24
independent FMA chains on the same threads (what code can reach), and the
clock at which FMAs run, from the time of a chain of dependent FMAs (4
cycles each).

Each shape is timed two ways, interleaved round by round: **streamed**, 30
distinct weights (a step's 30 layers; LM head: one), read from memory as in
a step, and **cache-resident**, one weight 30 times (the kernel's arithmetic
alone). Beside them the memory bandwidth of the moment (a sum over 540 MB):
a streamed shape cannot beat bandwidth x M / 2 FLOP/s (M rows, 4-byte weights).
"""
import ctypes
import pathlib
import statistics
import time
from typing import Dict, List

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
COPIES = 30


def _probe() -> ctypes.CDLL:
    from pagedbackend.kernels import native
    cc = native.compiler()
    if cc is None:
        raise SystemExit("the FMA probe needs a C compiler (gcc or cc) on PATH")
    library = ctypes.CDLL(str(native.build("fma_probe", cc, pathlib.Path(__file__).with_name("csrc") / "fma_probe.c")))
    library.fma_probe_throughput.restype = ctypes.c_double
    library.fma_probe_throughput.argtypes = [ctypes.c_long, ctypes.c_int]
    library.fma_probe_chain.restype = ctypes.c_float
    library.fma_probe_chain.argtypes = [ctypes.c_long]
    return library


def nominal_ghz() -> float:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1000
    except (OSError, ValueError):
        pass
    return float("nan")


def peak(threads: int, fma_units: int, rounds: int) -> Dict[str, float]:
    """The stated peak and the measured FMA throughput and clock."""
    probe = _probe()
    lanes = probe.fma_probe_lanes()
    throughput, chain = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        flops = probe.fma_probe_throughput(5_000_000, threads)
        throughput.append(flops / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        probe.fma_probe_chain(20_000_000)
        chain.append(20_000_000 * 4 / (time.perf_counter() - start) / 1e9)
    ghz = nominal_ghz()
    return {"threads": threads, "lanes": lanes, "fma_units": fma_units, "nominal_ghz": ghz,
            "stated_peak_gflops": threads * ghz * fma_units * lanes * 2,
            "measured_fma_gflops": max(throughput), "fma_clock_ghz": max(chain),
            "peak_at_fma_clock_gflops": threads * max(chain) * fma_units * lanes * 2}


def bandwidth_gbs(tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    tensor.sum()
    return tensor.numel() * 4 / (time.perf_counter() - start) / 1e9


def bench_shapes(ms: List[int], rounds: int, threads: int, copies: int = COPIES,
                 bandwidth_floats: int = 135_000_000) -> List[dict]:
    """Per M and shape: GFLOP/s streamed (``copies`` distinct weights) and
    cache-resident, and the bandwidth of the moment (a sum over
    ``bandwidth_floats``; 540 MB by default, past every cache here)."""
    from pagedbackend.kernels import packed_linear
    from pagedbackend.kernels.packed_linear import PackedLinear
    library = packed_linear.load_library()
    torch.manual_seed(0)
    weights = {name: [PackedLinear(torch.randn(n, k) * k ** -0.5) for _ in range(1 if name == "lm_head" else copies)]
               for name, (n, k) in SHAPES.items()}
    big = torch.ones(bandwidth_floats)
    rows = []
    for m in ms:
        for name, (n, k) in SHAPES.items():
            x, y = torch.randn(m, k), torch.empty(m, n)

            def walk(layers):
                for layer in layers:
                    library.packed_gemm(x.data_ptr(), layer.packed.data_ptr(), y.data_ptr(), m, k, n, threads)
            streamed, resident = weights[name], [weights[name][0]] * len(weights[name])
            times: Dict[str, list] = {"streamed": [], "resident": [], "bandwidth": []}
            walk(streamed)
            walk(resident)
            for _ in range(rounds):
                for kind, layers in (("streamed", streamed), ("resident", resident)):
                    start = time.perf_counter()
                    walk(layers)
                    times[kind].append(time.perf_counter() - start)
                times["bandwidth"].append(bandwidth_gbs(big))
            flops = 2 * m * n * k * len(streamed)
            bandwidth = statistics.median(times["bandwidth"])
            rows.append({"m": m, "shape": name, "n": n, "k": k,
                         "streamed_gflops": flops / statistics.median(times["streamed"]) / 1e9,
                         "resident_gflops": flops / statistics.median(times["resident"]) / 1e9,
                         "bandwidth_gbs": bandwidth, "bandwidth_bound_gflops": bandwidth * m / 2})
    return rows


def print_rows(result: dict) -> None:
    p = result["peak"]
    print(f"peak: {p['threads']} threads x {p['nominal_ghz']:.2f} GHz x {p['fma_units']} FMA units x "
          f"{p['lanes']} lanes x 2 = {p['stated_peak_gflops']:.0f} GFLOP/s stated; measured: independent FMAs "
          f"{p['measured_fma_gflops']:.0f} GFLOP/s, FMA clock {p['fma_clock_ghz']:.2f} GHz "
          f"({p['peak_at_fma_clock_gflops']:.0f} GFLOP/s at it)")
    print(f"{'M':>4s} {'shape':>8s} {'streamed':>9s} {'% peak':>7s} {'resident':>9s} {'% peak':>7s} "
          f"{'GB/s':>6s} {'bound':>7s}")
    for r in result["shapes"]:
        print(f"{r['m']:>4d} {r['shape']:>8s} {r['streamed_gflops']:9.1f} "
              f"{100 * r['streamed_gflops'] / p['stated_peak_gflops']:6.1f}% {r['resident_gflops']:9.1f} "
              f"{100 * r['resident_gflops'] / p['stated_peak_gflops']:6.1f}% {r['bandwidth_gbs']:6.1f} "
              f"{r['bandwidth_bound_gflops']:7.0f}")
