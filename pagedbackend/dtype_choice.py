"""``EngineConfig.dtype="auto"`` (the default, vLLM's name): the dtype a model
runs in, from its checkpoint and the machine.

- a bfloat16 checkpoint runs in bfloat16 where the device multiplies bfloat16
  natively: a CUDA GPU, or a CPU with AVX512-BF16 or AMX-BF16 (and the
  kernels not held to a narrower set by ``ATEN_CPU_CAPABILITY``); float32
  on other CPUs, where bfloat16 products are emulated, and on a CPU for a
  mixture of experts, whose packed expert kernel takes float32 activations;
- a float16 checkpoint runs in float16 on a GPU, in float32 on a CPU;
- a float32 checkpoint (the default model) and one that names no dtype run
  in float32.

Where bfloat16 changes greedy output against a float32 run, the setting and
its quality are in BENCHMARKS.md ("quant_quality"); comparisons with Hugging
Face use HF in the same dtype.
"""
import json
import os
import pathlib

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")


def checkpoint_dtype(model_path: pathlib.Path) -> str:
    """The dtype a Hugging Face folder's ``config.json`` names (``dtype`` or
    ``torch_dtype``; a multimodal model's text part), '' when none."""
    try:
        config = json.loads((pathlib.Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    for part in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = part.get(key)
            if isinstance(value, str):
                return value.replace("torch.", "")
    return ""


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX512-BF16 or AMX-BF16)
    that the kernels may use (``ATEN_CPU_CAPABILITY`` avx2 or default: no)."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() in ("avx2", "default"):
        return False
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def has_experts(model_path: pathlib.Path) -> bool:
    """Whether ``config.json`` describes a mixture of experts."""
    try:
        config = json.loads((pathlib.Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    parts = (config, config.get("text_config") or {})
    return any((part.get(key) or 0) > 1 for part in parts
               for key in ("num_local_experts", "num_experts", "n_routed_experts"))


def _on_cuda(device: str) -> bool:
    if device == "cuda":
        return True
    if device == "cpu":
        return False
    import torch
    return torch.cuda.is_available()


def resolve_dtype(dtype: str, model_path: pathlib.Path, device: str = "auto") -> str:
    """``dtype`` itself, or for ``auto`` the dtype the module docstring says
    (``device``: ``EngineConfig.device``)."""
    if dtype != "auto":
        return dtype
    stored = checkpoint_dtype(model_path)
    if stored == "bfloat16":
        if _on_cuda(device):
            return "bfloat16"
        return "bfloat16" if cpu_multiplies_bf16() and not has_experts(model_path) else "float32"
    if stored == "float16" and _on_cuda(device):
        return "float16"
    return "float32"
