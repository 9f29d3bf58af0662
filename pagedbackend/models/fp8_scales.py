"""Per-layer scales of an fp8 KV cache (vLLM's ``k_scale`` / ``v_scale``).

A layer with scales ``k_scale``, ``v_scale`` stores ``k / k_scale`` and
``v / v_scale`` in its cache (clamped to the format's range and rounded as
``kv_cache_dtype.encode`` does) and reads ``stored * scale``. No kernel sees
a scale: the attention op divides the step's new K/V before the write (one
operation per written value), multiplies the softmax scale by ``k_scale``
(``q . (k / k_scale) * (scale * k_scale) = q . k * scale``) and the output by
``v_scale`` (softmax weights sum over values linearly), so every attention
path (C decode kernel, gather, SDPA, torch twin, Triton-lang) honours them
and a cache at scale 1 takes today's path, bit for bit.

Where the scales come from:

- a checkpoint's tensors, named as vLLM reads them:
  ``model.layers.N.self_attn.k_scale`` / ``v_scale``, the older
  ``...self_attn.k_proj.output_scale`` / ``v_proj.output_scale``, and the
  deprecated ``...self_attn.kv_scale`` (one scale for both); one positive
  value each (per-tensor: vLLM's per-head scales are refused by name). A
  ``q_scale`` is read and not used (attention runs in the model's dtype);
- else, with ``calculate_kv_scales``, vLLM's on-the-fly calibration: the
  first step the engine serves (a prefill) sets each layer's scales from its
  own K/V before writing them: ``k_scale = absmax(k) / 200``,
  ``v_scale = absmax(v) / 100`` (vLLM's ``K_SCALE_CONSTANT`` and
  ``V_SCALE_CONSTANT``: the first prompt's largest value lands at 200 or 100,
  under e4m3's 448, leaving room for later tokens' larger ones);
- else scale 1 (vLLM's default without calibration).

The scales apply to an fp8 cache only (``auto``, ``bfloat16`` and ``int8``
caches ignore a checkpoint's, as vLLM does).
"""
import re
from typing import List, Optional, Tuple

import torch
from torch import nn

from pagedbackend.kernels.kv_cache_dtype import FP8_DTYPES
from pagedbackend.models.attention import PagedAttention

K_SCALE_CONSTANT = 200.0   # vLLM's calculate_kv_scales: k_scale = absmax(k) / 200
V_SCALE_CONSTANT = 100.0   # ... and v_scale = absmax(v) / 100

# Our name of a checkpoint tensor (``model.`` dropped) -> layer and which scale.
_SCALE_RE = re.compile(r"^layers\.(\d+)\.self_attn\.(?:(k|v|kv|q)_scale|(k|v|q)_proj\.output_scale)$")


def checkpoint_scale(name: str) -> Optional[Tuple[int, str]]:
    """``(layer, "k" | "v" | "kv" | "q")`` of a KV-cache scale's name, None for another tensor."""
    found = _SCALE_RE.match(name)
    return None if found is None else (int(found.group(1)), found.group(2) or found.group(3))


def scale_value(hf_name: str, tensor: torch.Tensor) -> float:
    """The one positive finite value of a per-tensor scale; a refusal naming the tensor otherwise."""
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {hf_name}: a KV cache scale of shape {tuple(tensor.shape)}; only "
                         "per-tensor scales (one value a layer) are read, not per-head ones")
    value = float(tensor.float())   # a float32 value, as vLLM holds it
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"checkpoint tensor {hf_name}: a KV cache scale must be a positive finite number, "
                         f"got {value}")
    return value


def load_scale(model: nn.Module, hf_name: str, name: str, tensor: torch.Tensor) -> bool:
    """Set the scale that checkpoint tensor ``name`` holds on its layer's
    attention (``PagedAttention.k_scale`` / ``v_scale``); False for another tensor."""
    found = checkpoint_scale(name)
    if found is None:
        return False
    layer, which = found
    value = scale_value(hf_name, tensor)
    attention = attention_of(model, layer, hf_name)
    if which in ("k", "kv"):
        attention.k_scale = value
    if which in ("v", "kv"):
        attention.v_scale = value
    return True


def attention_of(model: nn.Module, layer: int, hf_name: str) -> nn.Module:
    for module in model.modules():
        if isinstance(module, PagedAttention) and module.layer == layer:
            return module
    raise ValueError(f"checkpoint tensor {hf_name}: the model has no attention layer {layer}")


class KVScales:
    """Each layer's ``k_scale`` and ``v_scale`` (floats) for one runner's fp8
    cache, read by the attention op in the step context. ``calculate``: the
    first step after ``arm()`` sets them from its K/V, once."""

    def __init__(self, k: List[float], v: List[float], calculate: bool = False):
        self.k, self.v = list(k), list(v)
        self.calculate = calculate
        self.pending = False   # this step's K/V set the scales (armed, not yet calculated)

    @classmethod
    def for_model(cls, model: nn.Module, kv_dtype: torch.dtype, calculate: bool) -> Optional["KVScales"]:
        """The scales of ``model``'s layers (a checkpoint's, else 1) for a cache
        of ``kv_dtype``; None where there is nothing to apply (not fp8, or every
        scale 1 and none to calculate): the op then takes today's path."""
        if kv_dtype not in FP8_DTYPES:
            return None
        layers = sorted((m.layer, m) for m in model.modules() if isinstance(m, PagedAttention))
        k, v = [m.k_scale for _, m in layers], [m.v_scale for _, m in layers]
        loaded = any(s != 1.0 for s in k + v)
        if calculate and loaded:   # vLLM's rule: a checkpoint's scales win over calibration
            calculate = False
        return cls(k, v, calculate) if loaded or calculate else None

    def arm(self) -> None:
        """Calculate on the next step (the runner calls it once its warm-ups are done)."""
        self.pending = self.calculate

    def step_done(self) -> bool:
        """End of a step: True when it calculated the scales (a CUDA graph must then be captured again)."""
        calculated, self.pending = self.pending, False
        if calculated:
            self.calculate = False
        return calculated

    def apply(self, layer: int, k: torch.Tensor, v: torch.Tensor, scale: float
              ) -> Tuple[torch.Tensor, torch.Tensor, float, float]:
        """``(k / k_scale, v / v_scale, scale * k_scale, v_scale)``: what the
        attention op writes and attends with, and what its output is multiplied by."""
        if self.pending:
            self.k[layer] = _calculated(k, K_SCALE_CONSTANT)
            self.v[layer] = _calculated(v, V_SCALE_CONSTANT)
        k_scale, v_scale = self.k[layer], self.v[layer]
        return (k if k_scale == 1.0 else k / k_scale, v if v_scale == 1.0 else v / v_scale,
                scale * k_scale, v_scale)

    def describe(self) -> dict:
        """What the layout of a stored block depends on (the disk tier's check)."""
        return {"k_scales": list(self.k), "v_scales": list(self.v)}


def _calculated(x: torch.Tensor, constant: float) -> float:
    """vLLM's calculated scale: ``absmax / constant`` (1 for a layer of zeros)."""
    absmax = x.abs().max().float() if x.numel() else torch.zeros(())
    value = float(absmax / constant)   # in float32, as vLLM divides
    return value if value > 0 and value < float("inf") else 1.0
