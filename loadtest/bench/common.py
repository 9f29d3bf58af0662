"""Shared pieces of the benchmarks: result files, the machine description, models."""
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any, Dict

import torch


def machine() -> Dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_result(out_dir: str, name: str, result: Dict[str, Any]) -> pathlib.Path:
    """Write ``name.json`` with the command line and the machine next to the figures."""
    path = pathlib.Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "command": "python -m loadtest.bench " + " ".join(sys.argv[1:]),
              "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "workloads": "synthetic, seeded (loadtest/workloads.py): no data set can be downloaded here",
              **result}
    target = path / f"{name}.json"
    target.write_text(json.dumps(result, indent=2))
    return target


def bench_model(model: str, cache_dir: str = None) -> str:
    """``tiny`` builds (once) a small random Llama with a long context for fast
    scheduling benchmarks; anything else is passed to the engine as is."""
    if model != "tiny":
        return model
    from loadtest.tiny_model import build_tiny_llama
    base = pathlib.Path(cache_dir or os.environ.get("PAGEDBACKEND_CACHE",
                                                    pathlib.Path.home() / ".cache" / "pagedbackend"))
    path = base / "bench-tiny-llama"
    built_once(path, lambda scratch: build_tiny_llama(scratch, max_position_embeddings=4096))
    return str(path)


def built_once(path: pathlib.Path, build, marker: str = "config.json") -> pathlib.Path:
    """``path``, made by ``build(scratch)`` in a scratch folder beside it and
    renamed into place unless it exists (holds ``marker``): processes building
    it at the same time (parallel tests, two benchmarks) never see a
    half-written folder."""
    import shutil
    import tempfile
    if (path / marker).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        build(scratch)
        try:
            os.replace(scratch, path)
        except OSError:   # another process put its build there first
            if not (path / marker).exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def add_common_args(ap, out: str = "results/bench", threads: int = 1) -> None:
    """Flags every benchmark shares: output folder, seed, torch threads, quick mode."""
    ap.add_argument("--out", default=out, help="folder for the JSON result and the PNG figure")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--threads", type=int, default=threads,
                    help="torch CPU threads (1 keeps timings steady on a shared 2-core machine)")
    ap.add_argument("--quick", action="store_true", help="a small run that finishes in about a minute")


def set_threads(n: int) -> None:
    if n and n > 0:
        torch.set_num_threads(n)


def tool_command(given, venv_name: str, command: str, packages) -> str:
    """A benchmark client's command: ``given`` (checked), else ``command`` in a
    virtual environment of its own under the cache, made on first use with
    ``packages`` installed in turn (each a list of pip arguments)."""
    import subprocess
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise SystemExit(f"no {command} command at {given!r}")
        return given
    from pagedbackend.config import cache_root
    venv = cache_root() / venv_name
    path = venv / "bin" / command
    # What was installed, written once every install succeeded: a changed list installs again.
    marker, wanted = venv / ".pagedbackend-packages", json.dumps(packages)
    if not (path.exists() and marker.exists() and marker.read_text() == wanted):
        print(f"installing {command} into {venv} (once)...", flush=True)
        if not (venv / "bin" / "pip").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for args in packages:
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args], check=True)
        marker.write_text(wanted)
    return str(path)


def settings_with_environment(settings: Dict[str, Any]) -> Dict[str, Any]:
    """``settings`` (EngineConfig fields) with ``PAGEDBACKEND_<FIELD>``
    variables on top, as the server reads them, so that e.g.
    ``PAGEDBACKEND_CPP_WRAPPER=0 python -m loadtest.profile_step`` changes
    ``cpp_wrapper`` for a benchmark too."""
    import dataclasses
    from pagedbackend.config import engine_config
    return dataclasses.asdict(engine_config(settings, os.environ))
