"""Mixture-of-experts feed-forward as one layer: router logits in, hidden states out.

A family's decoder layer calls ``FusedMoE(x)``. The layer computes the router
logits and the top-k routing in float32 (whatever the model's dtype), then
hands the tokens, their experts and routing weights to a kernel chosen once
per machine (``use_kernel``; ``select_kernel`` decides from
``EngineConfig.moe_backend``):

- ``packed``: ``kernels/csrc/fused_moe.c`` on CPU (float32), experts packed at
  load; a step reads only the experts its tokens use, each once;
- ``triton``: the grouped GEMM of ``kernels/fused_moe.py`` (GPUs);
- ``torch``: a loop over the active experts (``fused_experts_torch``);
- ``gguf``: the same loop over a GGUF file's expert blocks as the file holds
  them (``gguf_moe.GGUFExperts``, set by the GGUF loader; no other kernel
  replaces it).

Routing variants (``MoEConfig.scoring``): ``softmax`` (softmax over every
expert, then the top k, rescaled to sum to one with ``renormalize``: Qwen3-MoE's
``norm_topk_prob``, Mixtral always) and ``topk_softmax`` (the top k logits,
then a softmax over them: gpt-oss). Weights are held as ``w13`` ``[E, 2I, H]``
(each expert's I gate rows, then its I up rows), ``w2`` ``[E, H, I]`` and
optional biases; loaders accept per-expert tensors and Hugging Face's fused
3-D ones (``load_expert``, ``load_stacked``).

Tensor parallelism: each rank holds every expert's slice of the intermediate
dimension (gate/up rows and down columns, as a dense MLP splits), or with
``expert_parallel`` whole experts, ``E / tp`` each; either way every rank
routes the same tokens and one reduction sums the partial outputs. The down
projection's bias is held once (rank 0, or the expert's own rank).
"""
import threading
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.kernels import moe_cpu, moe_ref, native
from pagedbackend.models.linear import Reduce, _identity, all_reduce_sum, even_split

SCORINGS = ("softmax", "topk_softmax")
BACKENDS = ("auto", "packed", "triton", "torch")   # EngineConfig.moe_backend


@dataclass(frozen=True)
class MoEConfig:
    """What differs between the families' expert layers."""
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int            # per expert
    scoring: str = "softmax"          # SCORINGS, see the module docstring
    renormalize: bool = False         # softmax scoring: chosen probabilities rescaled to sum to 1
    router_bias: bool = False
    expert_bias: bool = False         # biases on gate/up and down (gpt-oss)
    activation: str = "silu"          # moe_ref.ACTIVATIONS
    swiglu_alpha: float = 1.702       # swigluoai's sigmoid gain
    swiglu_limit: float = 7.0         # swigluoai's clamp

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"unknown MoE scoring {self.scoring!r}; expected one of {', '.join(SCORINGS)}")
        if self.activation not in moe_ref.ACTIVATIONS:
            raise ValueError(f"unsupported expert activation {self.activation!r}; supported: "
                             f"{', '.join(moe_ref.ACTIVATIONS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of "
                             f"experts ({self.num_experts})")


def route(logits: torch.Tensor, config: MoEConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 routing weights and int32 expert ids ``[T, k]`` from float32 logits ``[T, E]``."""
    if config.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, config.top_k, dim=-1)
        if config.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = torch.topk(logits, config.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    return weights, ids.to(torch.int32)


class FusedMoE(nn.Module):
    """Router plus experts of one decoder layer, one tensor-parallel rank's share."""

    def __init__(self, config: MoEConfig, tp_rank: int = 0, tp_size: int = 1,
                 reduce: Optional[Reduce] = None, dtype: Optional[torch.dtype] = None,
                 expert_parallel: bool = False):
        super().__init__()
        self.config = config
        self.expert_parallel = expert_parallel and tp_size > 1
        experts, inter, hidden = config.num_experts, config.intermediate_size, config.hidden_size
        if self.expert_parallel:
            self.first_expert, self.local_experts = even_split(experts, tp_rank, tp_size, "num_experts")
            self.inter_start, self.local_inter = 0, inter
        else:
            self.first_expert, self.local_experts = 0, experts
            self.inter_start, self.local_inter = even_split(inter, tp_rank, tp_size,
                                                            "the experts' intermediate size")
        self.reduce = reduce or (_identity if tp_size == 1 else all_reduce_sum)
        # Weights are buffers, filled through load_router / load_expert /
        # load_stacked: a decoder's generic loader never sees them. The router
        # is float32: logits and top-k are computed in float32.
        self.register_buffer("router_weight", torch.empty(experts, hidden, dtype=torch.float32))
        self.register_buffer("router_bias", torch.empty(experts, dtype=torch.float32) if config.router_bias
                             else None)
        self.register_buffer("w13", torch.empty(self.local_experts, 2 * self.local_inter, hidden, dtype=dtype))
        self.register_buffer("w2", torch.empty(self.local_experts, hidden, self.local_inter, dtype=dtype))
        bias = config.expert_bias
        self.register_buffer("b13", torch.empty(self.local_experts, 2 * self.local_inter, dtype=dtype)
                             if bias else None)
        # The down bias is added once, after the reduction's sum: rank 0's, or the expert's own rank's.
        self.register_buffer("b2", torch.empty(self.local_experts, hidden, dtype=dtype)
                             if bias and (self.expert_parallel or tp_rank == 0) else None)
        self.kernel = "torch"
        self.gguf: Optional[nn.Module] = None   # with kernel "gguf": the file's expert blocks
        self._loaded: Set[Tuple[str, int]] = set()

    # ---- forward --------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` -> the experts' weighted sum ``[T, H]`` (summed over ranks)."""
        logits = F.linear(x.float(), self.router_weight, self.router_bias)
        weights, ids = route(logits, self.config)
        if self.expert_parallel:   # other ranks' experts: out of range, skipped
            ids = ids - self.first_expert
            ids = torch.where((ids >= 0) & (ids < self.local_experts), ids, -1)
        return self.reduce(self.experts(x, ids, weights))

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``x`` for local ``ids`` (others: -1) and float32 ``weights``."""
        c = self.config
        if self.kernel == "gguf":
            return self.gguf(x, ids, weights, c.activation, c.swiglu_alpha, c.swiglu_limit)
        if self.kernel == "packed":
            return moe_cpu.fused_moe_cpu(x, ids, weights, self.w13, self.w2, self.b13, self.b2,
                                         self.local_inter, c.activation, c.swiglu_alpha, c.swiglu_limit)
        if self.kernel == "triton":
            return torch.ops.pagedbackend.fused_experts_grouped(
                x, ids, weights, self.w13, self.w2, self.b13, self.b2, c.activation, c.swiglu_alpha,
                c.swiglu_limit)
        return torch.ops.pagedbackend.fused_experts_torch(x, ids, weights, self.w13, self.w2, self.b13,
                                                          self.b2, c.activation, c.swiglu_alpha,
                                                          c.swiglu_limit)

    def use_kernel(self, kernel: str) -> None:
        """Serve through ``kernel`` (``packed``, ``triton`` or ``torch``); packing happens here, once.
        Experts served from GGUF blocks stay so."""
        if self.kernel == "gguf":
            return
        if kernel == "packed" and self.kernel != "packed":
            # Weights published in bfloat16 (every value exact in it) stay bfloat16: the
            # kernel widens them exactly, the same sums for half the bytes.
            held = torch.bfloat16 if moe_cpu.exact_in_bfloat16(self.w13, self.w2) else self.w13.dtype
            self.w13 = moe_cpu.pack_gate_up(self.w13.to(held))
            self.w2 = moe_cpu.pack_down(self.w2.to(held))
        if kernel == "triton":
            _register_grouped()
        self.kernel = kernel

    def expert_weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` of this rank, unpacked."""
        if self.kernel == "gguf":
            return self.gguf.dequantized()
        if self.kernel == "packed":
            return (moe_cpu.unpack_gate_up(self.w13, self.local_inter).float(),   # the kernel is float32
                    moe_cpu.unpack_down(self.w2, self.config.hidden_size, self.local_inter).float())
        return self.w13, self.w2

    def serve_gguf(self, experts: nn.Module) -> None:
        """Serve every expert from a GGUF file's blocks (``gguf_moe.GGUFExperts``);
        the float expert weights are dropped."""
        if self.local_experts != self.config.num_experts or self.local_inter != self.config.intermediate_size:
            raise ValueError("GGUF experts are served on one rank: use tensor_parallel_size=1")
        self.gguf, self.kernel = experts, "gguf"
        self.w13, self.w2 = self.w13.new_empty(0), self.w2.new_empty(0)
        self._loaded |= {(f"{proj}.weight", e) for e in range(self.config.num_experts)
                         for proj in ("gate", "up", "down")}

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights on this rank, as its kernel holds them."""
        if self.kernel == "gguf":
            return self.gguf.expert_bytes()
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    # ---- loading --------------------------------------------------------

    @torch.no_grad()
    def load_router(self, kind: str, tensor: torch.Tensor) -> None:
        """The router's ``weight`` ``[E, H]`` or ``bias`` ``[E]``."""
        target = self.router_weight if kind == "weight" else self.router_bias
        if target is None:
            raise ValueError("checkpoint has a router bias this model was built without")
        _copy_checked(target, tensor, f"router {kind}")
        self._loaded.add((f"router.{kind}", -1))

    @torch.no_grad()
    def load_expert(self, expert: int, proj: str, kind: str, tensor: torch.Tensor) -> None:
        """One expert's ``gate``, ``up`` or ``down`` ``weight`` (``[I, H]``,
        ``[I, H]``, ``[H, I]``) or ``bias`` (``[I]``, ``[I]``, ``[H]``), full size."""
        if not 0 <= expert < self.config.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the model has {self.config.num_experts}")
        self._loaded.add((f"{proj}.{kind}", expert))
        local = expert - self.first_expert
        if not 0 <= local < self.local_experts:
            return   # another rank's expert
        start, length, inter = self.inter_start, self.local_inter, self.config.intermediate_size
        if proj in ("gate", "up"):
            rows = slice(0, length) if proj == "gate" else slice(length, 2 * length)
            target = self.w13[local, rows] if kind == "weight" else self._bias("b13")[local, rows]
            _check_rows(tensor, inter, f"expert {expert} {proj} {kind}")
            _copy_checked(target, tensor.narrow(0, start, length), f"expert {expert} {proj} {kind}")
        elif proj == "down":
            if kind == "bias":
                if self.b2 is not None:
                    _copy_checked(self.b2[local], tensor, f"expert {expert} down bias")
                elif not self.config.expert_bias:
                    raise ValueError("checkpoint has expert biases this model was built without")
                return
            if tensor.dim() != 2 or tensor.shape[1] != inter:
                raise ValueError(f"expert {expert} down weight has shape {tuple(tensor.shape)}, "
                                 f"expected [{self.config.hidden_size}, {inter}]")
            _copy_checked(self.w2[local], tensor.narrow(1, start, length), f"expert {expert} down weight")
        else:
            raise ValueError(f"unknown expert projection {proj!r}")

    def load_stacked(self, proj: str, kind: str, tensor: torch.Tensor, interleaved: bool = False) -> None:
        """Every expert's ``gate_up`` (``[E, 2I, H]``: gate rows then up rows, or
        alternating with ``interleaved``) or ``down`` (``[E, H, I]``) ``weight``,
        or their ``bias`` (``[E, 2I]``, ``[E, H]``)."""
        if tensor.shape[0] != self.config.num_experts:
            raise ValueError(f"checkpoint's stacked experts {proj} {kind} has {tensor.shape[0]} experts, "
                             f"expected {self.config.num_experts}")
        for expert in range(self.config.num_experts):
            part = tensor[expert]
            if proj == "down":
                self.load_expert(expert, "down", kind, part)
            elif proj == "gate_up":
                gate, up = (part[0::2], part[1::2]) if interleaved else part.chunk(2, dim=0)
                self.load_expert(expert, "gate", kind, gate)
                self.load_expert(expert, "up", kind, up)
            else:
                raise ValueError(f"unknown stacked expert projection {proj!r}")

    def missing(self) -> List[str]:
        """The parts no checkpoint tensor has set yet (empty when complete)."""
        kinds = ["weight", "bias"] if self.config.expert_bias else ["weight"]
        wanted = [(f"router.{kind}", -1) for kind in (["weight", "bias"] if self.config.router_bias
                                                      else ["weight"])]
        wanted += [(f"{proj}.{kind}", e) for e in range(self.config.num_experts)
                   for proj in ("gate", "up", "down") for kind in kinds]
        return [f"{name}[{e}]" if e >= 0 else name for name, e in wanted if (name, e) not in self._loaded]

    def _bias(self, name: str) -> torch.Tensor:
        bias = getattr(self, name)
        if bias is None:
            raise ValueError("checkpoint has expert biases this model was built without")
        return bias


def _check_rows(tensor: torch.Tensor, rows: int, what: str) -> None:
    if tensor.shape[0] != rows:
        raise ValueError(f"checkpoint {what} has {tensor.shape[0]} rows, expected {rows}")


def _copy_checked(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ValueError(f"checkpoint {what} has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
    target.copy_(source)


# The torch and Triton paths as opaque operators: the torch loop over the
# experts a step uses depends on the data, which a compiled graph cannot
# trace; the grouped GEMM's launches stay as they are written. The Triton one
# is registered on first use (importing triton is not cheap).
_ops = torch.library.Library("pagedbackend", "FRAGMENT")
_SCHEMA = ("(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2, Tensor? b13, Tensor? b2, "
           "str activation, float alpha, float limit) -> Tensor")


def _register(name: str, impl) -> None:
    _ops.define(name + _SCHEMA)
    _ops.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pagedbackend::{name}")(
        lambda x, ids, weights, w13, w2, b13, b2, activation, alpha, limit: x.new_empty(x.shape))


_register("fused_experts_torch", moe_ref.fused_experts_torch)
_grouped_registered = False
_grouped_lock = threading.Lock()


def _register_grouped() -> None:
    global _grouped_registered
    with _grouped_lock:   # tensor-parallel ranks may be threads of one process
        if not _grouped_registered:
            from pagedbackend.kernels import fused_moe
            _register("fused_experts_grouped", fused_moe.fused_experts_grouped)
            _grouped_registered = True


def select_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel that ``EngineConfig.moe_backend`` asks for and this machine runs
    (``auto``: ``triton`` on CUDA, ``packed`` where the C kernel runs, else ``torch``);
    raises ValueError when an explicit choice cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"moe_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "triton" and device.type != "cuda":
        raise ValueError("moe_backend=triton needs a CUDA device (the Triton-lang kernel); "
                         f"the model runs on {device.type}")
    reason = native.unavailable(device, dtype, "fused_moe") if backend in ("auto", "packed") else None
    if backend == "packed" and reason is not None:
        raise ValueError(f"moe_backend=packed cannot run here: {reason}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else ("packed" if reason is None else "torch")
    return backend


def experts_of(model: nn.Module) -> List[FusedMoE]:
    """Every expert layer of ``model``."""
    return [module for module in model.modules() if isinstance(module, FusedMoE)]


def use_kernel(model: nn.Module, backend: str, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Give every expert layer of ``model`` the kernel ``backend`` selects; that
    kernel's name, or None for a model without experts."""
    layers = experts_of(model)
    if not layers:
        return None
    if all(layer.kernel == "gguf" for layer in layers):
        return "gguf"
    kernel = select_kernel(backend, device, dtype)
    for layer in layers:
        layer.use_kernel(kernel)
    return kernel
