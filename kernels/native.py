"""C kernels for the CPU path, compiled on this machine at first use.

Each kernel is one C file in ``csrc/``, compiled with ``-O3 -march=native
-fopenmp`` (AVX-512 or AVX2, whichever the CPU has), linked separately (see
``EXTRA_FLAGS``) into the cache beside the prepared model
(``$PAGEDBACKEND_CACHE/kernels``) and loaded with ``ctypes``. A
build is keyed by the source, the compiler and the CPU's flags, so a changed
file, compiler or machine gets its own build; the file is written atomically,
so processes starting together do not clash. The kernels use OpenMP through
the libgomp that torch has already loaded, so they share torch's threads.
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
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC"]
# Compile flags of single kernels (said in their sources), after FLAGS. They
# apply to compiling only: linked with -ffast-math, gcc would add
# crtfastmath.o, which flushes subnormals to zero in the whole process.
EXTRA_FLAGS = {"paged_decode": ["-ffast-math"]}
LINK = ["-shared", "-fopenmp"]
LIBS = ["-lm"]

_lock = threading.Lock()
_loaded: Dict[str, ctypes.CDLL] = {}
_failed: Dict[str, str] = {}


def compiler() -> Optional[str]:
    """The C compiler to build with: ``$CC``, else gcc, else cc (None when none is on PATH)."""
    for name in (os.environ.get("CC"), "gcc", "cc"):
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


def build(name: str, cc: str) -> pathlib.Path:
    """Compile ``csrc/<name>.c`` with ``cc`` unless this build is cached; its path."""
    source = CSRC / f"{name}.c"
    flags = FLAGS + EXTRA_FLAGS.get(name, [])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([source.read_bytes(), version.encode(),
                                     " ".join(flags + LINK + LIBS).encode(), _cpu_flags().encode()]))
    target = cache_root() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = pathlib.Path(scratch) / target.name
        obj = built.with_suffix(".o")
        for command in ([cc, *flags, "-c", str(source), "-o", str(obj)],
                        [cc, *LINK, str(obj), "-o", str(built), *LIBS]):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{cc} could not build {source.name}: "
                                   f"{(result.stderr or result.stdout).strip()[:500]}")
        os.replace(built, target)
    return target


def load(name: str) -> ctypes.CDLL:
    """The compiled ``csrc/<name>.c``, built on first use; raises RuntimeError
    saying why it cannot be (no compiler, a failed build), every time it is asked."""
    importlib.import_module("torch")   # loaded first, so the kernel binds to torch's libgomp
    with _lock:
        if name not in _loaded and name not in _failed:
            cc = compiler()
            try:
                if cc is None:
                    raise RuntimeError("the CPU kernels need a C compiler (gcc or cc) on PATH, "
                                       "and none is there")
                _loaded[name] = ctypes.CDLL(str(build(name, cc)))
            except (RuntimeError, OSError) as exc:
                _failed[name] = str(exc)
        if name in _failed:
            raise RuntimeError(_failed[name])
        return _loaded[name]
