"""Linear layers through oneDNN's inner product (``mkldnn::_linear_pointwise``,
the op torch's own ``mkldnn`` fusions call) for steps of many rows.

On these CPUs torch's ``F.linear`` on float32 goes to MKL's sgemm, which
reaches 120-140 GFLOP/s on two cores at 512-2048 rows, while oneDNN's
inner product on the same plain weight reaches 190-208 (BENCHMARKS.md,
"embed"). Two uses:

- ``dense_linear``: a prefill step past the packed kernel's rows
  (``packed_linear.KERNEL_MAX_ROWS``) multiplies the weight unpacked for
  the call through oneDNN, float32 sums as ``F.linear``'s (oneDNN's float32
  mode is IEEE unless the user asks torch otherwise);
- ``OneDnnLinear``: a layer whose weight oneDNN holds in its own blocked
  layout, reordered once at load (no second copy: the plain weight is
  dropped). The encoders (``worker.encoder_runner``) use it for every
  projection, where every step is a prefill and oneDNN is faster than
  ``F.linear`` at every row count from one input's ~16 rows up (float32
  1.1-2x, bfloat16 1.05-2.7x); an encoder layer's Q, K and V are one such
  layer, and its MLP's GELU runs inside the up projection
  (``models.bert.Encoder.use_onednn``).

Where torch was built without oneDNN, or its op refuses a trial call,
``F.linear`` serves both (``unavailable`` says why).
"""
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@functools.lru_cache(maxsize=None)
def unavailable() -> Optional[str]:
    """None where oneDNN's inner product runs here, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    try:
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        z = torch.ops.mkldnn._linear_pointwise(x, packed, torch.zeros(3), "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        return f"oneDNN's inner product failed a trial call: {exc}"
    if not (torch.equal(y, torch.full((2, 3), 4.0)) and torch.equal(z, y)):
        return "oneDNN's inner product gave a wrong trial result"
    return None


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (2-D, plain ``weight``): through oneDNN where it runs, else ``F.linear``."""
    if unavailable() is None and x.device.type == "cpu" and x.dtype == weight.dtype:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(), None, "none", [], "")
    return F.linear(x, weight)


# Activations oneDNN applies to the product in its own pass over the output
# (a post-op): name -> (attr, algorithm) of _linear_pointwise. Its erf GELU and
# ReLU give F.gelu's and F.relu's bits; its tanh GELU is within 1 ulp of F.gelu's.
ACTIVATIONS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


class OneDnnLinear(nn.Module):
    """``nn.Linear``'s product with the weight held in oneDNN's layout; given
    several linears, their outputs side by side (one GEMM for a Q, K and V);
    ``activation`` (a key of ``ACTIVATIONS``) applied to the result."""

    def __init__(self, linear, activation: Optional[str] = None):
        super().__init__()
        parts = list(linear) if isinstance(linear, (list, tuple)) else [linear]
        if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
            raise ValueError("OneDnnLinear joins linears of one input width, all with a bias or none")
        weight = torch.cat([p.weight.detach() for p in parts]) if len(parts) > 1 else parts[0].weight.detach()
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"OneDnnLinear takes a float32 or bfloat16 CPU weight; got {weight.dtype} "
                             f"on {weight.device}")
        self.in_features, self.out_features = parts[0].in_features, weight.shape[0]
        self.dtype = weight.dtype
        self.attr, self.algorithm = ACTIVATIONS[activation] if activation else ("none", "")
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.bias = None if parts[0].bias is None else torch.cat(
            [p.bias.detach() for p in parts]).to(weight.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.shape[-1] != self.in_features:
            raise ValueError(f"this layer takes {self.dtype} [..., {self.in_features}] inputs; "
                             f"got {x.dtype} {tuple(x.shape)}")
        flat = x.reshape(-1, self.in_features).contiguous()
        if flat.shape[0] == 0:
            return x.new_empty((*x.shape[:-1], self.out_features))
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, self.attr, [], self.algorithm)
        return y.reshape(*x.shape[:-1], self.out_features)


def use_in(module: nn.Module) -> int:
    """Every ``nn.Linear`` under ``module`` (float32 or bfloat16, on CPU)
    replaced by an ``OneDnnLinear``; how many were. Nothing where
    ``unavailable()``."""
    if unavailable() is not None:
        return 0
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
             and child.weight.dtype in (torch.float32, torch.bfloat16)]
    for parent, name, child in swaps:
        setattr(parent, name, OneDnnLinear(child))
    return len(swaps)
