"""The compiled model step as an AOTInductor package, built once per model,
dtype, quantisation, thread count and machine and kept beside the prepared
model (``$PAGEDBACKEND_CACHE/steps``), so that a restart serves compiled
steps from its first request: loading a package takes a second or two, where
``torch.compile`` traces the model again on every start (half a minute here,
warm inductor cache or not).

A package holds the generated code of the forward pass (``input_ids``,
``positions`` -> hidden states, the token count dynamic) and none of the
weights: at load they are handed over as the runner's own tensors (user
managed, not copied). Attention is the opaque custom op of
``models.attention`` whose caches come from the step context, so the package
knows nothing of the KV pool; the LM head runs as the eager model's
``compute_logits``.

The key covers what the generated code depends on: torch's version, the
CPU's instruction sets, torch's thread count (inductor writes it into its
parallel loops), the model's architecture and constants (names, shapes,
dtypes), the settings that pick its layers, and the source of the packages
that define the forward pass. A package that is missing is built by
``build_in_subprocess``: ``python -m pagedbackend.worker.step_build`` at
the lowest CPU priority with one compile worker, so a server that serves
eager steps meanwhile keeps its cores; an engine that compiles before its
first step (``LLM``, offline) builds its own the same way and waits for it;
``make setup`` builds the shipped configuration's (``python -m
pagedbackend.serve --prepare-only --build-step``).
"""
import hashlib
import json
import logging
import os
import pathlib
import subprocess
import sys
from typing import Callable, Dict, Optional

import torch

from pagedbackend.config import EngineConfig, cache_root

logger = logging.getLogger("pagedbackend")

# EngineConfig fields that shape the forward pass; the builder gets them.
MODEL_FIELDS = ("model", "dtype", "quantization", "linear_backend", "native_ops", "int8_bf16",
                "max_model_len", "device", "seed")


def _source_digest() -> str:
    """The source of the packages that define the forward pass and its ops."""
    import pagedbackend.kernels
    import pagedbackend.models
    import pagedbackend.quant
    digest = hashlib.sha256()
    for package in (pagedbackend.models, pagedbackend.quant, pagedbackend.kernels):
        for path in sorted(pathlib.Path(package.__file__).parent.rglob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    for path in (pathlib.Path(__file__), pathlib.Path(__file__).with_name("step_build.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def step_key(runner) -> str:
    """The package name for ``runner``'s model step on this machine."""
    from pagedbackend.kernels.packed_linear import native_ops
    model = runner.model
    shapes = [(name, tuple(t.shape), str(t.dtype)) for name, t in constants(model).items()]
    parts = {"torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
             "cpu_flags": _cpu_flags(), "threads": torch.get_num_threads(),
             "model_class": type(model).__qualname__, "model_config": (runner.model_path / "config.json").read_text(),
             "settings": {name: str(getattr(runner.config, name)) for name in MODEL_FIELDS if name != "model"},
             "linear_backend": runner.linear_backend, "native_ops": bool(native_ops().use_native_ops),
             "max_model_len": runner.max_model_len, "constants": shapes, "source": _source_digest()}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return f"{runner.model_path.name}-{runner.config.dtype}-{runner.config.quantization}-{digest}"


def package_path(runner) -> pathlib.Path:
    return cache_root() / "steps" / f"{step_key(runner)}.pt2"


def constants(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


class PackagedStep:
    """``forward(input_ids, positions)`` from a package, ``logits(hidden)``
    the model's own; the pair a runner's step calls (as ``CompiledStep``)."""

    def __init__(self, path: pathlib.Path, model: torch.nn.Module):
        self.path = path
        self.package = torch._inductor.aoti_load_package(str(path))
        tensors = constants(model)
        prefix = "model."
        wanted = self.package.get_constant_fqns()
        missing = [name for name in wanted if name.removeprefix(prefix) not in tensors]
        if missing:
            raise RuntimeError(f"the step package {path.name} wants constants the model lacks: {missing[:3]}")
        # The package reads the model's own tensors (user managed: no copy, kept alive by the model).
        self.package.load_constants({name: tensors[name.removeprefix(prefix)] for name in wanted},
                                    check_full_update=True, user_managed=True)
        self.forward: Callable = self.package   # (input_ids, positions) -> hidden states
        self.logits: Callable = model.compute_logits


def load(runner) -> Optional[PackagedStep]:
    """The runner's step package when one is built for it (None if not, or
    if it does not load: it is then set aside and built again)."""
    path = package_path(runner)
    if not path.is_file():
        return None
    try:
        return PackagedStep(path, runner.model)
    except Exception as exc:   # a stale or damaged package: say so, build a new one
        logger.warning("pagedbackend: the step package %s does not load (%s: %s); it is set aside",
                       path.name, type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
        os.replace(path, path.with_suffix(".pt2.bad"))
        return None


def wanted(config: EngineConfig) -> bool:
    """Whether ``config`` serves its compiled step from a package (a CPU step
    under compile, step_package, one rank)."""
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return (config.compile and config.step_package and not config.enforce_eager
            and config.tensor_parallel_size == 1 and torch.device(device).type == "cpu")


def _interpreter() -> str:
    """This environment's python (inside Triton's stub, sys.executable is the stub)."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    for name in ("python3", "python"):
        candidate = os.path.join(sys.prefix, "bin", name)
        if os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(f"no python interpreter to build the step package with (sys.prefix {sys.prefix})")


def build_in_subprocess(config: EngineConfig, timeout_s: float = 3600.0, niceness: int = 19) -> None:
    """``step_build.build`` in a process of its own with one compile worker,
    at the lowest CPU priority unless ``niceness`` says otherwise (a caller
    that waits for it has no steps to keep the cores for); raises
    RuntimeError with its last output if it fails."""
    settings = {name: getattr(config, name) for name in MODEL_FIELDS}
    command = [_interpreter(), "-m", "pagedbackend.worker.step_build", "--settings", json.dumps(settings),
               "--threads", str(torch.get_num_threads())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s,
                            preexec_fn=lambda: os.nice(niceness))
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"the step package build exited with {result.returncode}: {' | '.join(tail)[:600]}")
