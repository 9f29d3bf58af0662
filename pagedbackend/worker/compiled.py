"""The model step under ``torch.compile``: inductor generates C++/OpenMP loops
on CPU (Triton on CUDA) that fuse the small ops around the matmuls (RMSNorm,
RoPE, SiLU x up, residual adds) and drop most of eager's per-op overhead.

The token count is dynamic, so one graph serves every batch size; dynamo
specialises a count of 1, so a single-token step (one decode) gets a second
graph. Both, and the LM head's, are compiled at load (``warm_up``) so no
request pays for a compile. Attention is the opaque custom op of
``models.attention``, so each forward is one graph.

Dynamo checks guards before every call: about 5,000 for the default model
(every attribute and parameter of every layer the forward reads), some 2 ms
a step. The modules and parameters of a loaded model never change, so the
guards on them are dropped (``skip_guard_on_all_nn_modules_unsafe``); those on
the inputs, on globals and on torch's state stay. Dynamo keeps its graphs per
code object, and every instance of a model class shares its ``forward``'s, so
each compiled step calls a copy of the method with a code object of its own:
its graphs are never offered to another model, whose layers differ in what
the dropped guards checked.

The inductor cache lives beside the prepared model (``$PAGEDBACKEND_CACHE/
inductor-<digest>`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set): a restart reuses
the generated code and skips the C++ compiler. The digest covers torch's
version and our custom ops' schemas and source, since a cached graph calls
them by name with the arguments of the build that made it: a graph of a
6-argument ``paged_attention`` loaded by a build whose op takes 5 fails.
"""
import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import types
from typing import Callable, Iterable, Optional, Tuple

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


def ops_digest(schemas: Iterable[str], sources: Iterable[Tuple[str, bytes]], torch_version: str) -> str:
    """A short digest of custom-op schemas, the source behind them (name,
    bytes) and torch's version: what a cached graph's calls depend on."""
    digest = hashlib.sha256(torch_version.encode())
    for schema in sorted(schemas):
        digest.update(b"\0schema\0" + schema.encode())
    for name, text in sorted(sources):
        digest.update(b"\0source\0" + name.encode() + b"\0" + text)
    return digest.hexdigest()[:16]


def custom_ops_digest() -> str:
    """``ops_digest`` of this build: the schemas of the ops that
    ``models.attention`` and ``kernels.packed_linear`` define, their modules'
    text and the kernels' source (Python and C/C++, where the native ops'
    schemas are written)."""
    import pagedbackend.kernels
    from pagedbackend.kernels import packed_linear
    from pagedbackend.models import attention
    schemas = [str(schema) for module in (attention, packed_linear) for name in sorted(module._ops._op_defs)
               for schema in torch._C._jit_get_schemas_for_operator(name)]
    kernels = pathlib.Path(pagedbackend.kernels.__file__).parent
    files = [pathlib.Path(attention.__file__),
             *sorted(kernels.glob("*.py")), *sorted(kernels.glob("csrc/*.c*"))]
    return ops_digest(schemas, [(path.name, path.read_bytes()) for path in files], torch.__version__)


def compile_cache_folder(digest: str) -> pathlib.Path:
    """The inductor cache's folder for ops of ``digest``."""
    return cache_root() / f"inductor-{digest}"


def use_compile_cache() -> str:
    """Point inductor's on-disk cache beside the prepared model, in a folder
    named by ``custom_ops_digest``, unless the user chose a folder; returns
    the folder."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        folder = str(compile_cache_folder(custom_ops_digest()))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def compile_failure(exc: BaseException) -> str:
    """One line naming why a compile (or a CUDA graph capture) failed: the
    innermost cause's type and its message's first non-empty line (inductor
    wraps the real error in a BackendCompilerFailed whose first line says only
    which backend raised)."""
    for _ in range(8):
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {(lines[0] if lines else '')[:300]}"


def cpu_options(cpp_wrapper: bool) -> dict:
    """Inductor's settings for a CPU step: the graph's wrapper in C++ or in
    Python (``EngineConfig.cpp_wrapper``)."""
    return {"cpp_wrapper": cpp_wrapper}


def own_code(method: Callable) -> Callable:
    """A bound method, rebound to a copy of its function whose code object is
    its own (dynamo's cache of compiled graphs is kept per code object)."""
    func = method.__func__
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__,
                              func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
    return types.MethodType(copy, method.__self__)


class CompiledStep:
    """``forward(input_ids, positions)`` and ``logits(hidden)`` of a model,
    compiled; ``cpp_wrapper``: ``EngineConfig.cpp_wrapper`` (CPU steps);
    ``guard_model=True`` keeps dynamo's guards on the model's modules
    (``loadtest.native_ops_ab --compare guards`` measures them)."""

    def __init__(self, model: torch.nn.Module, device: torch.device = torch.device("cpu"), *,
                 cpp_wrapper: bool, guard_model: bool = False):
        use_compile_cache()
        # The token dimension varies every step: compile for a dynamic size up front
        # instead of after a first recompile; fullgraph=True makes a graph break an error.
        self.options = options = cpu_options(cpp_wrapper) if device.type == "cpu" else {}
        if not guard_model:
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        self.forward: Callable = torch.compile(own_code(model.forward), dynamic=True, fullgraph=True,
                                               options=options or None)
        self.logits: Callable = torch.compile(own_code(model.compute_logits), dynamic=True,
                                              fullgraph=True, options=options or None)
