"""Adapters beside the layers they modify: each linear projection of a
loaded model gets a matmul that runs the projection's own (float, packed or
quantised, whatever serves it) and then, in steps with adapters, adds the
LoRA deltas of every module merged into it (``punica.lora_add_``).

The model class does not know: ``LoRAModel`` walks ``model.hf_projections()``
(Hugging Face module names -> our merged projections: q/k/v in ``qkv_proj``,
gate/up in ``gate_up_proj``) and swaps each projection's matmul through
``use_matmul``, as the quantisation package does. Per Hugging Face module it
holds the pool's pages: ``A`` ``[pages, in]`` and ``B`` ``[pages, out]``
(``pool.py`` says what a page is), written when an adapter is paged in.
"""
import logging
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import lora as kernels
from .peft_adapter import LoRAWeights
from .punica import LoRAMapping, state

logger = logging.getLogger("pagedbackend")
LARGE_SEGMENT_ROWS = 64


class _FloatMatmul(nn.Module):
    """``x W^T`` of a projection served by ``F.linear`` (its weight, moved here)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LoRALinear(nn.Module):
    """A projection's matmul, then its adapters' deltas in steps that have any."""

    def __init__(self, base: nn.Module, slot: int):
        super().__init__()
        self.base, self.slot = base, slot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if state.active:
            torch.ops.pagedbackend.lora_add_(y, x, self.slot)
        return y


@dataclass
class Shard:
    """One Hugging Face module inside a (possibly merged) projection."""
    name: str              # model.layers.0.self_attn.q_proj
    kind: str              # q_proj
    offset: int            # its first column in the projection's output
    in_features: int
    out_features: int
    A: torch.Tensor        # [pages, in]
    B: torch.Tensor        # [pages, out]


class LoRAModel:
    """The adapted projections of one model and the pool pages they read."""

    def __init__(self, model: nn.Module, num_pages: int, dtype: torch.dtype, device: torch.device):
        self.slots: List[List[Shard]] = []
        self.shards: Dict[str, Shard] = {}
        self.kernel_name, self._c_kernel = _choose_kernel(device, dtype)
        # With the C kernel, an adapter's rows of a step from this many on (a
        # prefill) multiply through torch's GEMM, faster there than the
        # segment kernel (BENCHMARKS.md, "lora"); the rest through the kernel.
        self.split_rows = LARGE_SEGMENT_ROWS if self.kernel_name == "c" else 0
        for names, linear in model.hf_projections():
            shards = []
            for name, (offset, in_features, out_features) in zip(names, _layout(linear, len(names))):
                module = name.removesuffix(".weight")
                shard = Shard(module, module.rsplit(".", 1)[-1], offset, in_features, out_features,
                              torch.zeros((num_pages, in_features), dtype=dtype, device=device),
                              torch.zeros((num_pages, out_features), dtype=dtype, device=device))
                shards.append(shard)
                self.shards[module] = shard
            base = linear.matmul if linear.matmul is not None else _FloatMatmul(linear.weight)
            linear.use_matmul(LoRALinear(base, len(self.slots)))
            self.slots.append(shards)

    def shapes(self) -> Dict[str, Tuple[int, int]]:
        """Hugging Face module name -> (in features, out features), for loading adapters."""
        return {name: (s.in_features, s.out_features) for name, s in self.shards.items()}

    @torch.no_grad()
    def write(self, weights: LoRAWeights, pages: Sequence[int]) -> None:
        """Write an adapter into ``pages`` (as many as its rank): each module's
        A rows and B columns; pages past a module's own rank, and the modules
        of adapted kinds that it leaves out, hold zeros."""
        index = torch.tensor(list(pages), dtype=torch.long, device=self._device)
        for name, shard in self.shards.items():
            if shard.kind not in weights.kinds:
                continue   # segments of this kind never include the adapter
            shard.A.index_fill_(0, index, 0.0)
            shard.B.index_fill_(0, index, 0.0)
            if name in weights.modules:
                a, b = weights.modules[name]
                used = index[:a.shape[0]]
                shard.A.index_copy_(0, used, a.to(shard.A))
                shard.B.index_copy_(0, used, b.t().to(shard.B))

    @property
    def _device(self) -> torch.device:
        return next(iter(self.shards.values())).A.device

    def add(self, y: torch.Tensor, x: torch.Tensor, slot: int, mapping: LoRAMapping) -> None:
        """``y += x A^T B^T`` for every module merged into projection ``slot``
        (each into its columns of ``y``), over the step's segments of the
        adapters that adapt its kind, through the chosen kernel."""
        if self.kernel_name == "c":   # straight to the C function: a step makes one call per module
            x = x if x.is_contiguous() else x.contiguous()
            rows, pages, segs = mapping.addresses()
            x_at, y_at, ldy, size = x.data_ptr(), y.data_ptr(), y.stride(0), y.element_size()
            for shard in self.slots[slot]:
                seg = segs.get(shard.kind)
                if seg is not None and self._c_kernel(
                        x_at, x.stride(0), shard.in_features, y_at + shard.offset * size, ldy, shard.out_features,
                        shard.A.data_ptr(), shard.B.data_ptr(), rows, pages, seg[0], seg[1]) != 0:
                    raise MemoryError("lora_sgmv: no memory for the step's shrunk rows")
                for batch_rows, adapter_pages in mapping.large.get(shard.kind, ()):   # prefills: torch's GEMM
                    delta = (x[batch_rows] @ shard.A[adapter_pages].t()) @ shard.B[adapter_pages]
                    out = y.narrow(1, shard.offset, shard.out_features)
                    if isinstance(batch_rows, slice):
                        out[batch_rows] += delta
                    else:
                        out.index_add_(0, batch_rows, delta)
            return
        for shard in self.slots[slot]:
            segs = mapping.segs.get(shard.kind)
            if segs is None:
                continue
            out = y.narrow(1, shard.offset, shard.out_features)
            if self.kernel_name == "triton":
                kernels.sgmv_triton(out, x, shard.A, shard.B, mapping.rows, mapping.pages, segs,
                                    mapping.max_rows, mapping.max_rank)
            else:
                kernels.sgmv_ref(out, x, shard.A, shard.B, mapping.rows, mapping.pages, segs)


def _layout(linear: nn.Module, num_modules: int) -> List[Tuple[int, int, int]]:
    """(column offset, in features, out features) of each of the
    ``num_modules`` Hugging Face modules merged into a projection: a
    column-parallel one lists its shards' output sizes; a row-parallel one,
    or one the checkpoint stores fused (Phi-3's ``qkv_proj``), is one module."""
    matmul = linear.matmul
    in_features = linear.weight.shape[1] if linear.weight is not None else matmul.in_features
    sizes = getattr(linear, "output_sizes_per_rank", None)
    if sizes is not None and num_modules == 1:
        return [(0, in_features, sum(sizes))]
    if sizes is None:
        out_features = linear.weight.shape[0] if linear.weight is not None else matmul.out_features
        return [(0, in_features, out_features)]
    return [(offset, in_features, size) for offset, size in zip(linear.offsets, sizes)]


def _choose_kernel(device: torch.device, dtype: torch.dtype):
    """``("triton", None)`` on CUDA; on CPU ``("c", kernel)`` for float32
    where the C kernel builds, else ``("torch", None)`` with one log line."""
    if device.type == "cuda":
        return "triton", None
    if dtype != torch.float32:
        logger.info("pagedbackend: LoRA deltas use torch's kernels (the C kernel takes float32, the model "
                    "is %s)", dtype)
        return "torch", None
    try:
        return "c", kernels.c_kernel()
    except RuntimeError as exc:
        logger.warning("pagedbackend: LoRA deltas use torch's kernels: %s", exc)
        return "torch", None
