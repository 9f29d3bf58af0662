"""C kernels for the CPU path, compiled on this machine at first use.

Each kernel is one C file in ``csrc/``, compiled with ``-O3 -march=native
-fopenmp`` (AVX-512 or AVX2, whichever the CPU has; torch's own
``ATEN_CPU_CAPABILITY=avx2`` or ``default`` narrows it, see ``isa_flags``),
linked separately (see ``EXTRA_FLAGS``) into the cache beside the prepared model
(``$PAGEDBACKEND_CACHE/kernels``) and loaded with ``ctypes``. A
build is keyed by the source, the compiler and the CPU's flags, so a changed
file, compiler or machine gets its own build; the file is written atomically,
so processes starting together do not clash. The kernels use OpenMP through
the libgomp that torch has already loaded, so they share torch's threads.

A C++ file in ``csrc/`` defines ATen operators instead (``load_op_library``):
it is compiled against the installed torch's headers and libraries (the build
key holds torch's version) and loaded with ``torch.ops.load_library``, so
that compiled graphs call its kernels through the dispatcher without Python.

This module is the one loader of those libraries: ``load`` and
``load_op_library`` give every library its functions' ctypes signatures
(``SIGNATURES``) when it opens, and ``unavailable`` is the one check of
whether a C kernel can serve a model here. A new kernel is a file in
``csrc/`` and, where Python calls its functions, an entry in ``SIGNATURES``.
"""
import ctypes
import hashlib
import importlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from typing import Dict, Optional

from pagedbackend.config import cache_root

CSRC = pathlib.Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-fopenmp", "-fPIC"]
# The instruction set of a build, by ATEN_CPU_CAPABILITY (the variable with
# which torch and inductor are held to a narrower set than the CPU has): avx2
# is x86-64-v3 (AVX2 and FMA, no AVX-512, as on the CPUs without it), default
# is x86-64-v2 (SSE4.2). Tuning stays native.
CAPABILITY_ISA = {"avx2": "x86-64-v3", "default": "x86-64-v2"}
# Compile flags of single kernels (said in their sources), after FLAGS. They
# apply to compiling only: linked with -ffast-math, gcc would add
# crtfastmath.o, which flushes subnormals to zero in the whole process.
# gguf_gemm's weights are the reference dequantisation's own roundings (d * q,
# then + m or - dm), so none of its products may fuse into an FMA.
EXTRA_FLAGS = {"paged_decode": ["-ffast-math"], "gguf_gemm": ["-ffp-contract=off"]}
# Other files of csrc/ that a kernel's source includes: part of its build key,
# so a change to one rebuilds the kernels that include it.
INCLUDES = {"fused_moe": ["packed_gemm.c"]}
# Kernels that pick their instruction set when they load (gcc's target_clones:
# AVX-512, AVX2 or baseline, by the CPU): on x86-64 they are built for the
# baseline so that each clone keeps its own set; where ATEN_CPU_CAPABILITY
# narrows the set they are built for it alone (NO_RUNTIME_DISPATCH).
RUNTIME_DISPATCH = {"gguf_gemm"}
LINK = ["-shared", "-fopenmp"]
LIBS = ["-lm"]

_P, _INT, _LONG, _LLONG, _FLOAT = (ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_longlong,
                                   ctypes.c_float)
# Library -> function -> (argument types, result type): what Python calls in
# each build of csrc/ (a function a build lacks, as older trees' do, is left out).
SIGNATURES = {
    "packed_gemm": {"packed_gemm": ([_P] * 3 + [_INT] * 4, None),
                    "packed_gemm_bf16": ([_P] * 3 + [_INT] * 4, None),
                    "packed_gemm_i8": ([_P] * 4 + [_INT] * 4, _INT),
                    "packed_gemm_block_cols": ([], _INT),
                    "packed_gemm_set_bf16_rows": ([_INT], _INT),
                    "packed_gemm_has_bf16": ([], _INT)},
    "fused_moe": {"fused_moe": ([_P, _INT, _INT, _INT, _P, _P, _INT, _INT] + [_P] * 4
                                + [_INT, _FLOAT, _FLOAT, _P, _INT, _P, _INT], _INT),
                  "fused_moe_block_cols": ([], _INT)},
    "w8a8_gemm": {"w8a8_gemm_available": ([], _INT), "w8a8_gemm_max_rows": ([], _INT)},
    "paged_decode": {"paged_decode": ([_P] * 5 + [_INT, _P] + [_INT] * 5 + [_FLOAT, _INT, _P, _INT], _INT),
                     "paged_write": ([_P] * 5 + [_INT, _INT] + [_LLONG] * 3, _INT),
                     "paged_decode_kv": ([_P] * 5 + [_INT, _P] + [_INT] * 5 + [_FLOAT, _INT, _P, _INT, _INT], _INT),
                     "paged_write_kv": ([_P] * 5 + [_INT] * 3 + [_LLONG] * 3 + [_INT], _INT)},
    "lora_sgmv": {"lora_sgmv_f32": ([_P, _LONG, _LONG, _P, _LONG, _LONG] + [_P] * 5 + [_INT], _INT)},
    "token_mask": {"apply_token_mask": ([_P, _LONG, _P, _INT, _P, _INT, _INT], None)},
    "omp_park": {"omp_park_team": ([_INT], _INT)},
    "packed_ops.cpp": {"packed_ops_set_kernels": ([_P] * 3 + [_LLONG], None),
                       "packed_ops_set_w8a8": ([_P, _P, _LLONG], None),
                       "packed_ops_set_prefill": ([_INT], None),
                       "gguf_ops_set_kernels": ([_P] * 4 + [_LLONG, _INT, _P, _P, _P, ctypes.c_char_p], None)},
}

_lock = threading.Lock()
_loaded: Dict[str, ctypes.CDLL] = {}
_failed: Dict[str, str] = {}


def compiler() -> Optional[str]:
    """The C compiler to build with: ``$CC``, else gcc, else cc (None when none is on PATH)."""
    return _on_path(os.environ.get("CC"), "gcc", "cc")


def _on_path(*names: Optional[str]) -> Optional[str]:
    for name in names:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def isa_flags() -> list:
    """``-march`` for the kernels: native, unless ``ATEN_CPU_CAPABILITY`` asks
    an x86 CPU for less (``CAPABILITY_ISA``); other values leave it native."""
    import platform
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if capability in CAPABILITY_ISA and platform.machine().lower() in ("x86_64", "amd64"):
        return [f"-march={CAPABILITY_ISA[capability]}", "-mtune=native"]
    return ["-march=native"]


def _isa_of(name: str) -> list:
    import platform
    flags = isa_flags()
    if name not in RUNTIME_DISPATCH:
        return flags
    if flags == ["-march=native"] and platform.machine().lower() in ("x86_64", "amd64"):
        return ["-march=x86-64", "-mtune=native"]
    return flags + ["-DNO_RUNTIME_DISPATCH"]


def build(name: str, cc: str, source: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Compile ``csrc/<name>.c`` with ``cc`` unless this build is cached; its
    path. ``source``: another version of that file (an older revision, for a
    benchmark), built with the same flags."""
    source = CSRC / f"{name}.c" if source is None else pathlib.Path(source)
    flags = FLAGS + _isa_of(name) + EXTRA_FLAGS.get(name, [])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    included = [(source.parent / f).read_bytes() for f in INCLUDES.get(name, [])]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *included, version.encode(),
                                     " ".join(flags + LINK + LIBS).encode(), _cpu_flags().encode()]))
    target = cache_root() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    return _build_into(target, cc, source, lambda built: [
        [cc, *flags, "-c", str(source), "-o", str(built.with_suffix(".o"))],
        [cc, *LINK, str(built.with_suffix(".o")), "-o", str(built), *LIBS]])


def _build_into(target: pathlib.Path, tool: str, source: pathlib.Path, commands,
                errors_only: bool = False) -> pathlib.Path:
    """``target``, built unless it exists by running ``commands(built)`` in a
    scratch folder beside it and moving the result in place (atomically, so
    processes starting together do not clash). A failed command raises
    RuntimeError with the compiler's output (its error lines, with ``errors_only``)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = pathlib.Path(scratch) / target.name
        for command in commands(built):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                output = (result.stderr or result.stdout).strip()
                errors = [line for line in output.splitlines() if "error" in line] if errors_only else []
                raise RuntimeError(f"{tool} could not build {source.name}: "
                                   f"{(chr(10).join(errors) or output)[:500]}")
        os.replace(built, target)
    return target


def declare(name: str, library: ctypes.CDLL) -> ctypes.CDLL:
    """Give ``library`` (a build of ``csrc/<name>``) its functions' ctypes
    signatures from ``SIGNATURES``; returns it."""
    for function, (argtypes, restype) in SIGNATURES.get(name, {}).items():
        if hasattr(library, function):
            getattr(library, function).argtypes = argtypes
            getattr(library, function).restype = restype
    return library


def load(name: str) -> ctypes.CDLL:
    """The compiled ``csrc/<name>.c``, built on first use, its functions
    declared; raises RuntimeError saying why it cannot be (no compiler, a
    failed build), every time it is asked."""
    importlib.import_module("torch")   # loaded first, so the kernel binds to torch's libgomp
    return _load_once(name, compiler, "the CPU kernels need a C compiler (gcc or cc) on PATH, "
                                      "and none is there",
                      lambda cc: declare(name, ctypes.CDLL(str(build(name, cc)))))


def unavailable(device, dtype, name: str = "packed_gemm") -> Optional[str]:
    """Why the C kernel ``csrc/<name>.c`` cannot serve a model on ``device``
    in ``dtype`` here (None when it can): the CPU kernels are float32 and
    need a compiler and a build."""
    import torch
    if torch.device(device).type != "cpu":
        return f"the C kernel {name}.c runs on CPU; the model runs on {torch.device(device).type}"
    if dtype != torch.float32:
        return f"the C kernel {name}.c is float32; the model's dtype is {dtype}"
    try:
        load(name)
    except RuntimeError as exc:
        return str(exc)
    return None


def _load_once(key: str, find_tool, missing: str, open_library) -> ctypes.CDLL:
    """``open_library(tool)`` once per process for ``key``, remembering a failure
    (raised again as RuntimeError at every later call)."""
    with _lock:
        if key not in _loaded and key not in _failed:
            tool = find_tool()
            try:
                if tool is None:
                    raise RuntimeError(missing)
                _loaded[key] = open_library(tool)
            except (RuntimeError, OSError) as exc:
                _failed[key] = str(exc)
        if key in _failed:
            raise RuntimeError(_failed[key])
        return _loaded[key]


# ---------------------------------------------------------------- ATen operators

def cxx_compiler() -> Optional[str]:
    """The C++ compiler for operator libraries: ``$CXX``, else g++, else c++."""
    return _on_path(os.environ.get("CXX"), "g++", "c++")


def _torch_build_flags():
    import torch
    from torch.utils import cpp_extension
    includes = [f"-I{path}" for path in cpp_extension.include_paths()[:1]]
    libdir = cpp_extension.library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = ["-O2", "-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes]
    link_flags = ["-shared", f"-L{libdir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libdir}"]
    return torch.__version__, compile_flags, link_flags


def build_op_library(name: str, cxx: str) -> pathlib.Path:
    """Compile ``csrc/<name>.cpp`` (ATen operators) against this torch unless
    the build is cached; its path."""
    source = CSRC / f"{name}.cpp"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    torch_version, compile_flags, link_flags = _torch_build_flags()
    key = hashlib.sha256(b"\0".join([source.read_bytes(), version.encode(), torch_version.encode(),
                                     " ".join(compile_flags + link_flags).encode()]))
    target = cache_root() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    return _build_into(target, cxx, source, lambda built: [
        [cxx, *compile_flags, str(source), *link_flags, "-o", str(built)]], errors_only=True)


def load_op_library(name: str) -> ctypes.CDLL:
    """The operators of ``csrc/<name>.cpp``, built on first use and registered
    with torch; raises RuntimeError saying why they cannot be, every time."""
    import torch

    def open_library(cxx: str) -> ctypes.CDLL:
        path = build_op_library(name, cxx)
        torch.ops.load_library(str(path))
        return declare(f"{name}.cpp", ctypes.CDLL(str(path)))
    return _load_once(f"{name}.cpp", cxx_compiler, "the CPU operators need a C++ compiler (g++ or c++) "
                                                   "on PATH, and none is there", open_library)
