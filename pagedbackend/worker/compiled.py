"""The model step under ``torch.compile``: inductor generates C++/OpenMP loops
on CPU (Triton on CUDA) that fuse the small ops around the matmuls (RMSNorm,
RoPE, SiLU x up, residual adds) and drop most of eager's per-op overhead.

The token count is dynamic, so one graph serves every batch size; dynamo
specialises a count of 1, so a single-token step (one decode) gets a second
graph. Both, and the LM head's, are compiled at load (``warm_up``) so no
request pays for a compile. Attention is the opaque custom op of
``models.attention``, so each forward is one graph.

The inductor cache lives beside the prepared model (``$PAGEDBACKEND_CACHE/
inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set): a restart reuses the
generated code and skips the C++ compiler.
"""
import importlib.util
import logging
import os
import shutil
from typing import Callable, Optional

import torch

from pagedbackend.models.default_model import cache_root

logger = logging.getLogger("pagedbackend")


def compile_unavailable(device: torch.device) -> Optional[str]:
    """Why the model step cannot be compiled here (None when it can)."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs triton, which is not installed"
        return None
    if device.type != "cpu":
        return f"no torch.compile backend is set up for device {device.type!r}"
    compiler = os.environ.get("CXX") or "c++"
    if not any(shutil.which(c) for c in (compiler, "g++", "clang++")):
        return "torch.compile on CPU needs a C++ compiler (g++ or clang++), and none is on PATH"
    return None


def use_compile_cache() -> str:
    """Point inductor's on-disk cache beside the prepared model, unless the
    user chose a folder; returns the folder."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        folder = str(cache_root() / "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def compile_failure(exc: BaseException) -> str:
    """One line naming why a compile failed: the innermost cause's type and
    its message's first non-empty line (inductor wraps the real error in a
    BackendCompilerFailed whose first line says only which backend raised)."""
    for _ in range(8):
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {(lines[0] if lines else '')[:300]}"


def cpu_options() -> dict:
    """Inductor's settings for a CPU step: the graph's wrapper in C++
    (``cpp_wrapper``), which calls the fused loops and the custom ops without
    a Python line per kernel; ``PAGEDBACKEND_CPP_WRAPPER=0`` keeps inductor's
    Python wrapper (a first compile about 90 s shorter, each step slower;
    BENCHMARKS.md section 15)."""
    return {"cpp_wrapper": os.environ.get("PAGEDBACKEND_CPP_WRAPPER", "1") != "0"}


class CompiledStep:
    """``forward(input_ids, positions)`` and ``logits(hidden)`` of a model, compiled."""

    # Every model instance's forward shares one code object, so each engine
    # built in a process adds graphs to the same dynamo cache, whose limit (8)
    # would otherwise send the ninth engine to eager.
    RECOMPILE_LIMIT = 64

    def __init__(self, model: torch.nn.Module, device: torch.device = torch.device("cpu")):
        use_compile_cache()
        import torch._dynamo.config as dynamo_config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, self.RECOMPILE_LIMIT)
        # The token dimension varies every step: compile for a dynamic size up front
        # instead of after a first recompile; fullgraph=True makes a graph break an error.
        self.options = options = cpu_options() if device.type == "cpu" else None
        self.forward: Callable = torch.compile(model.forward, dynamic=True, fullgraph=True,
                                               options=options)
        self.logits: Callable = torch.compile(model.compute_logits, dynamic=True, fullgraph=True,
                                              options=options)
