"""Every Triton-lang kernel compiled ahead of time for NVIDIA GPUs, on a machine
without one: registers, spills, shared memory and occupancy per launch.

    python -m pagedbackend.kernels.gpu_report --arch 80,90,100 [--json] [--set quick]

Each launch of :mod:`pagedbackend.kernels.gpu_launches` is specialised the way
Triton's launcher specialises a real call (integers equal to 1 become
constants, tensors and integers divisible by 16 get alignment hints), compiled
by ``triton.compile`` for ``GPUTarget("cuda", arch, 32)`` with the ``ptxas``
Triton itself picks for that arch; that ptxas's ``-v`` log gives registers and
spills (a kernel from Triton's cache has its PTX through ptxas again). A launch
fails on a compile error, a spill, shared memory over the target's limit or no
program fitting on an SM; a kernel of the package with no launch described
fails too. Exit status 1 when anything failed.
"""
import argparse
import contextlib
import importlib
import inspect
import io
import json
import math
import multiprocessing
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

from pagedbackend.kernels import gpu_launches
from pagedbackend.kernels.gpu_launches import Launch


@dataclass(frozen=True)
class Arch:
    """What bounds occupancy on one compute capability (CUDA programming guide, per SM)."""
    capability: int
    gpu: str
    shared_per_program: int    # largest dynamic shared memory one program may ask for
    shared_per_sm: int
    registers_per_sm: int = 65536
    max_warps: int = 64
    max_programs: int = 32


ARCHS = {80: Arch(80, "A100", 166912, 167936), 90: Arch(90, "H100", 232448, 233472),
         100: Arch(100, "B200", 232448, 233472)}
RESERVED_SHARED = 1024   # per program on sm_80 and later, taken by the CUDA runtime
REGISTER_UNIT = 256      # registers are allocated per warp in units of 256

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "i32": "int32",
                 "i64": "int64", "i8": "int8", "u8": "uint8", "fp8e4nv": "float8_e4m3fn",
                 "fp8e5": "float8_e5m2"}
FIELDS = ("kernel", "arch", "dtype", "shape", "config", "ok", "error", "cubin_bytes", "registers",
          "spills", "shared_bytes", "programs_per_sm", "occupancy", "limited_by")


def as_jit(kernel):
    """``kernel`` as a ``JITFunction``: under ``TRITON_INTERPRET=1`` ``triton.jit``
    made an interpreted function, which holds the Python function it wraps."""
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, JITFunction):
        return kernel
    if not hasattr(kernel, "fn") or not hasattr(kernel, "rewrite"):
        raise TypeError(f"{kernel!r} is not a triton.jit kernel")
    return JITFunction(kernel.fn, **kernel.kwargs)


def _argument(value):
    """A launch argument as the launcher sees it: ``"*bf16"`` -> a tensor of that dtype."""
    if isinstance(value, str) and value.startswith("*"):
        import torch
        from triton.runtime.jit import MockTensor
        if value[1:] not in _TORCH_DTYPES:
            raise ValueError(f"unknown tensor dtype {value!r}; expected one of {sorted(_TORCH_DTYPES)}")
        return MockTensor(getattr(torch, _TORCH_DTYPES[value[1:]]))   # data_ptr 0: aligned as allocations are
    return value


def compile_launch(kernel, args: Dict[str, object], options: Dict[str, int], capability: int):
    """``triton.compile`` of one launch for ``sm_<capability>``: the compiled
    kernel and the log of the ``ptxas -v`` that built it (empty when Triton's
    cache had it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    jit = as_jit(kernel)
    missing = [name for name in jit.arg_names if name not in args]
    unknown = [name for name in args if name not in jit.arg_names]
    if missing or unknown:
        raise ValueError(f"launch of {jit.__name__} does not match its parameters: "
                         f"missing {missing}, unknown {unknown}")
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, opts = binder(*(_argument(args[name]) for name in jit.arg_names), **options)
    parsed, signature, constexprs, attrs = jit._pack_args(backend, dict(options), bound, specialization, opts)
    # Triton prints its ptxas log (and, when ptxas fails, the whole PTX) to stdout: keep it here.
    printed = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True
    with contextlib.redirect_stdout(printed):
        compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                  options=parsed.__dict__)
    return compiled, printed.getvalue()


def run_ptxas(ptx: str, capability: int, fp_fusion: bool = True) -> str:
    """The log of ``ptxas -v`` on ``ptx``, run as Triton runs it for the arch."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        command = [get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                   *([] if fp_fusion else ["--fmad=false"]),
                   f"--gpu-name={sm_arch_from_capability(capability)}", source,
                   "-o", os.path.join(folder, "kernel.cubin")]
        return subprocess.run(command, capture_output=True, text=True, check=True).stderr


def ptxas_usage(log: str) -> Dict[str, int]:
    """Registers and spill bytes per thread from a ``ptxas -v`` log."""
    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        if found is None:
            raise RuntimeError(f"ptxas -v printed no {pattern!r}:\n{log}")
        return int(found.group(1))
    return {"registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads")}


def occupancy(arch: Arch, registers: int, shared: int, num_warps: int) -> Dict[str, object]:
    """Programs per SM and the share of its warp slots they fill, from the
    limits of registers (per warp, in units of 256), shared memory (plus the
    runtime's reserve per program), warps and programs."""
    per_warp = math.ceil(max(registers, 1) * 32 / REGISTER_UNIT) * REGISTER_UNIT
    bounds = {"warps": arch.max_warps // num_warps,
              "registers": arch.registers_per_sm // per_warp // num_warps,
              "shared": arch.shared_per_sm // (shared + RESERVED_SHARED),
              "programs": arch.max_programs}
    programs = min(bounds.values())
    return {"programs_per_sm": programs, "occupancy": round(programs * num_warps / arch.max_warps, 3),
            "limited_by": min(bounds, key=bounds.get)}


def report_launch(launch: Launch, capability: int) -> Dict[str, object]:
    """One row of the report (``FIELDS``): a failure is a row with ``ok`` false
    and its ``error``, never an exception."""
    arch = ARCHS[capability]
    row: Dict[str, object] = dict.fromkeys(FIELDS)
    row.update(kernel=launch.label, arch=capability, dtype=launch.dtype, shape=launch.shape,
               config=dict(launch.options), ok=False)
    try:
        jit = as_jit(launch.kernel())
        row["config"] = {**{name: launch.args[name] for name in jit.arg_names
                            if name in launch.args and jit.params[jit.arg_names.index(name)].is_constexpr},
                         **launch.options}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled, log = compile_launch(jit, launch.args, launch.options, capability)
        meta = compiled.metadata
        row["config"].update(num_warps=meta.num_warps, num_stages=meta.num_stages)
        if "Used " not in log:   # a cached kernel: ptxas again, on its PTX
            log = run_ptxas(compiled.asm["ptx"], capability, meta.enable_fp_fusion)
        usage = ptxas_usage(log)
    except Exception as error:   # any failure to build is the finding, reported in its row
        row["error"] = f"{type(error).__name__}: {error}".strip()
        return row
    row.update(cubin_bytes=len(compiled.asm["cubin"]), registers=usage["registers"],
               spills=usage["spill_stores"], shared_bytes=meta.shared)
    row.update(occupancy(arch, usage["registers"], meta.shared, meta.num_warps))
    problems = []
    if usage["spill_stores"] or usage["spill_loads"]:
        problems.append(f"spills {usage['spill_stores']} bytes stored, {usage['spill_loads']} loaded "
                        "per thread")
    if meta.shared > arch.shared_per_program:
        problems.append(f"shared memory {meta.shared} bytes over {arch.gpu}'s {arch.shared_per_program}")
    if row["programs_per_sm"] == 0:
        problems.append(f"no program fits on an {arch.gpu} SM (limited by {row['limited_by']})")
    row["ok"], row["error"] = not problems, "; ".join(problems) or None
    return row


def undescribed_kernels(launches: Iterable[Launch]) -> List[str]:
    """``module.name`` of every ``triton.jit`` kernel in the package that no
    launch describes; a ``triton.jit`` helper that a described kernel of its
    module calls is compiled inside that kernel, so it counts as described."""
    import pagedbackend.kernels as package
    described = {launch.label for launch in launches}
    found, sources = [], {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("gpu_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            is_kernel = type(value).__name__ in ("JITFunction", "InterpretedFunction")
            if is_kernel and getattr(getattr(value, "fn", None), "__module__", None) == module.__name__:
                found.append(f"{info.name}.{name}")
                sources[f"{info.name}.{name}"] = inspect.getsource(value.fn)

    def called(label: str) -> bool:
        module, name = label.split(".")
        return any(kernel.split(".")[0] == module and f"{name}(" in sources[kernel]
                   for kernel in described & set(found))

    return sorted(label for label in set(found) - described if not called(label))


def _compile_here() -> None:
    """Worker start: Triton compiles for a GPU only where it was imported with
    its interpreter off (under ``TRITON_INTERPRET=1`` even ``tl.sum`` becomes an
    interpreted function that code generation cannot inline), and the kernel
    modules switch the interpreter on where none has chosen."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("triton was imported with TRITON_INTERPRET on: compile in a fresh process")
    os.environ["TRITON_INTERPRET"] = "0"


def _report_task(task) -> Dict[str, object]:
    return report_launch(*task)


def report(launches: Sequence[Launch], archs: Sequence[int], jobs: int = 1,
           check_coverage: bool = False) -> List[Dict[str, object]]:
    """Rows for every launch on every arch, in order, compiled in ``jobs`` fresh
    processes (so a caller that runs kernels through the interpreter can ask)."""
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"unknown arch {unknown}; known: {', '.join(map(str, ARCHS))}")
    # A launch the engine never makes on an older arch (fp8 e4m3 before sm_89: refused by name) is not compiled there.
    tasks = [(launch, arch) for arch in archs for launch in launches if arch >= launch.min_arch]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max(1, min(jobs, len(tasks))), mp_context=context,
                             initializer=_compile_here) as pool:
        rows = list(pool.map(_report_task, tasks, chunksize=max(1, len(tasks) // (8 * max(1, jobs)))))
    if check_coverage:
        for label in undescribed_kernels(launches):
            rows.append({**dict.fromkeys(FIELDS), "kernel": label, "dtype": "", "shape": "", "config": {},
                         "ok": False, "error": "no launch described in pagedbackend.kernels.gpu_launches"})
    return rows


def toolchain(archs: Sequence[int]) -> str:
    """Triton's version and the ptxas each arch compiles with."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    tools = ", ".join(f"{sm_arch_from_capability(a)}: {os.path.basename(get_ptxas(a).path)} "
                      f"{get_ptxas(a).version}" for a in archs)
    return f"triton {triton.__version__}; {tools}"


def format_row(row: Dict[str, object]) -> str:
    config = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in row["config"].items())
    head = f"{row['kernel']:<40} sm_{row['arch']} {row['dtype']:<4} {row['shape'] or '-':<9} {config}"
    if row.get("registers") is None:
        return f"{head}\n    FAILED {row['error']}"
    line = (f"{head}  cubin_bytes={row['cubin_bytes']} registers={row['registers']} spills={row['spills']} "
            f"shared_bytes={row['shared_bytes']} occupancy={row['occupancy']} "
            f"({row['programs_per_sm']}/SM, {row['limited_by']})")
    return line if row["ok"] else f"{line}\n    FAILED {row['error']}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.kernels.gpu_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="80,90,100", help="compute capabilities, comma separated")
    parser.add_argument("--set", choices=sorted(gpu_launches.SETS), default="all",
                        help="every launch the engine makes (all) or one per kernel (quick)")
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    try:
        archs = [int(a) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        parser.error(f"--arch takes comma-separated integers such as 80,90,100, not {args.arch!r}")
    if not archs or any(a not in ARCHS for a in archs):
        parser.error(f"--arch {args.arch!r}: known compute capabilities are {', '.join(map(str, ARCHS))}")
    launches = [launch for launch in gpu_launches.SETS[args.set]() if args.kernel in launch.label]
    if not launches:
        parser.error(f"no kernel's name contains {args.kernel!r}")
    if not args.json:
        print(toolchain(archs), flush=True)
    rows = report(launches, archs, args.jobs, check_coverage=args.set == "all" and not args.kernel)
    for row in rows:
        print(json.dumps(row) if args.json else format_row(row))
    failed = sum(not row["ok"] for row in rows)
    print(f"{len(rows) - failed} of {len(rows)} launches compiled within limits"
          + (f"; {failed} FAILED" if failed else ""), file=sys.stderr if args.json else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
