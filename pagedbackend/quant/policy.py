"""The one decision: how each linear projection and the LM head of a loaded
model multiply, from ``EngineConfig.quantization`` and ``linear_backend``
and what this machine can run.

- ``none``: float weights, through the packed C kernel
  (``kernels.packed_linear``) where it runs and ``linear_backend`` allows,
  else torch's ``F.linear``; a bfloat16 model through ``models.bf16_linear``
  (bfloat16 products: AMX tiles, AVX512-BF16, or oneDNN where faster);
- ``int8``: int8 weights (``int8``), packed the same way (in any model dtype:
  the layer widens the rows of x to float32) or in torch's kernel;
- ``int4``: Q4_1 blocks of 32 (``int4``; the default model's shipped ones)
  through the GGUF kernel, x rounded to int8 (``int4_activations``: by
  default where the CPU has AVX-512 VNNI) or as given; an int8 LM head, as
  the GGUF keeps it at 8 bits;
- ``w8a8``: int8 weights and activations (``w8a8``) after smoothing
  (``smooth``), the LM head too; on a GGUF model, the file's blocks times
  activations rounded to int8 (``gguf_linear``'s int8 activations).

The embedding stays as loaded. The model class knows none of this: it offers
its projections (``hf_projections``) and its LM head (``head_weight``,
``use_head_matmul``), and each linear layer takes a matmul (``use_matmul``).
"""
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from pagedbackend.kernels import native, packed_linear
from pagedbackend.models import bf16_linear, default_model, gguf_linear, moe
from pagedbackend.quant import int4, smooth
from pagedbackend.quant.int8 import INT8_KERNEL_MAX_ROWS, Int8Linear, PackedInt8Linear
from pagedbackend.quant.w8a8 import W8A8Linear

logger = logging.getLogger("pagedbackend")


@dataclass(frozen=True)
class LinearPlan:
    """What the runner needs to know of the choice: which kernels serve the
    float32 or int8 layers (``torch`` or ``packed``; ``bf16`` for bf16_linear), and the step sizes at
    which a layer takes a branch of its own (a graph to warm up each)."""
    backend: str = "torch"
    warm_up_rows: Tuple[int, ...] = ()


def _gguf_native(model: nn.Module, config) -> None:
    """The GGUF layers call the C++ operators where they build and ``native_ops`` allows."""
    packed_linear.native_ops().configure(config.native_ops, config.int8_bf16)
    native = gguf_linear.native_ops_usable()
    for layer in model.modules():
        if isinstance(layer, gguf_linear.GGUFLinear):
            layer.native = native


@torch.no_grad()
def apply(model: nn.Module, config, device: torch.device, dtype: torch.dtype,
          calibration: Optional[smooth.Calibration] = None) -> LinearPlan:
    """Give every projection and the LM head of ``model`` (loaded, float) the
    matmul that ``config`` asks for and this machine runs; ``calibration``:
    the prefill that w8a8's smoothing measures on (none: no smoothing)."""
    mode = config.quantization   # one of config.QUANTIZATION_MODES (EngineConfig checks it)
    if getattr(model, "gguf_types", None) is not None:   # served from a GGUF file's own blocks
        if mode not in ("none", "w8a8"):
            raise ValueError(f"quantization={mode} applies to float checkpoints; a GGUF file's weights are "
                             "served in their own blocks: use quantization=none, or w8a8 for int8 activations")
        _require_cpu("a GGUF model", device)
        if mode == "w8a8":   # the file's blocks times activations rounded to int8, as llama.cpp multiplies
            reason = gguf_linear.int8_activations_unavailable()
            if reason is not None:
                raise ValueError(f"quantization=w8a8 on a GGUF model cannot run here: {reason}; "
                                 "use quantization=none")
            for layer in model.modules():
                if isinstance(layer, gguf_linear.GGUFLinear):
                    layer.int8_activations = True
        _gguf_native(model, config)
        return LinearPlan("gguf")
    if mode != "none" and moe.experts_of(model):
        raise ValueError(f"quantization={mode} does not cover the expert weights of a mixture-of-experts "
                         "model (most of its weights); serve it with quantization=none")
    if mode == "w8a8":
        _require_cpu(mode, device)
        packed_linear.native_ops().configure(config.native_ops, config.int8_bf16)
        if calibration is not None:
            smooth.smooth_with(model, calibration)
        _serve_through(model, W8A8Linear)
        return LinearPlan()
    if mode == "int4":
        _require_cpu(mode, device)
        int8_activations = config.int4_activations == "int8" or (
            config.int4_activations == "auto" and int4.unavailable(True) is None)
        reason = int4.unavailable(int8_activations)
        if reason is not None:
            raise ValueError(f"quantization=int4 with int4_activations={config.int4_activations} cannot run "
                             f"here: {reason}" + ("; use int4_activations=float" if int8_activations else ""))
        ready = None
        if config.model == "default":   # its GGUF's 4-bit values, not a second rounding
            ready = default_model.q4_1_weights(model.args.num_heads, model.args.num_kv_heads)
        for names, linear in model.hf_projections():
            linear.use_matmul(int4.int4_layer(linear.weight, names, ready, int8_activations))
        model.use_head_matmul(Int8Linear(model.head_weight()))
        _gguf_native(model, config)
        return LinearPlan()
    if mode == "none" and _bf16_usable(config, device, dtype):
        _serve_through(model, bf16_linear.Bf16Linear)
        return LinearPlan("bf16")   # the op picks torch's GEMM inside: no graph of its own
    # int8 layers widen a bfloat16 or float16 model's rows to float32 for the kernel
    if _packed_usable(config, device, torch.float32 if mode == "int8" else dtype):
        _serve_through(model, PackedInt8Linear if mode == "int8" else packed_linear.PackedLinear)
        if mode == "int8" and dtype == torch.bfloat16 and bf16_linear.pairs():
            # a bfloat16 model's prefills past the int8 kernel's rows take the paired kernel: one more graph
            return LinearPlan("packed", warm_up_rows=(packed_linear.KERNEL_MAX_ROWS + 1,))
        return LinearPlan("packed")
    if mode == "int8":
        _require_cpu(mode, device)
        _serve_through(model, Int8Linear)
        # Int8Linear widens the weight for F.linear above its kernel's rows: one more graph
        return LinearPlan(warm_up_rows=(INT8_KERNEL_MAX_ROWS + 1,))
    return LinearPlan()


def _serve_through(model: nn.Module, layer: Callable[[torch.Tensor], nn.Module]) -> None:
    """Every projection and the LM head through ``layer(weight)`` (a tied head
    gets its own copy)."""
    for _, linear in model.hf_projections():
        linear.use_matmul(layer(linear.weight))
    model.use_head_matmul(layer(model.head_weight()))


def _require_cpu(mode: str, device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError(f"quantization={mode} runs on CPU only (its kernels are "
                         f"CPU kernels); got device {device.type}: use quantization=none")


def _bf16_usable(config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a bfloat16 model's layers go through ``bf16_linear``'s kernel."""
    if config.linear_backend == "torch" or dtype != torch.bfloat16 or device.type != "cpu":
        return False
    reason = bf16_linear.unavailable(device, dtype)
    if reason is not None:
        if config.linear_backend == "packed":
            raise ValueError(f"linear_backend=packed cannot run here: {reason}")
        logger.info("pagedbackend: linear layers use torch's kernels: %s", reason)
        return False
    return True


def _packed_usable(config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the float32 or int8 layers go through the packed kernels: the
    config asks (or leaves it to us) and they can run here."""
    if config.linear_backend == "torch":
        return False
    reason = native.unavailable(device, dtype)
    if reason is not None:
        if config.linear_backend == "packed":
            raise ValueError(f"linear_backend=packed cannot run here: {reason}")
        logger.info("pagedbackend: linear layers use torch's kernels: %s", reason)
        return False
    ops = packed_linear.native_ops()
    ops.configure(config.native_ops, config.int8_bf16)
    if not ops.decide():
        logger.info("pagedbackend: packed linear layers call their C kernels through Python: %s",
                    ops.native_ops_failure or "native_ops is false")
    return True
