"""The experts of a mixture-of-experts GGUF file (``qwen3moe``), served from their blocks.

llama.cpp writes each layer's experts as three 3-D tensors,
``blk.N.ffn_gate_exps`` and ``ffn_up_exps`` (GGUF shape ``[H, I, E]``: expert
e's I rows of H values) and ``ffn_down_exps`` (``[I, H, E]``), one expert
after another, so each expert's rows are a contiguous run of whole blocks.
``GGUFExperts`` keeps the three tensors as views into the file's mapping and
multiplies, per active expert, the rows routed to it by that expert's run of
blocks with ``gguf_linear``'s kernel (gate and up as one two-part call), then
sums the slots with their routing weights as the reference loop does
(``moe_ref.each_expert``). Nothing is widened at load. The router
(``ffn_gate_inp``, which llama.cpp keeps in float) loads as a float tensor;
experts of an unquantised file load into ``FusedMoE``'s own weights.
"""
from typing import Callable, List, Set, Tuple

import torch
from torch import nn

from pagedbackend.kernels import moe_ref
from pagedbackend.models.gguf_file import QUANTIZED, GGUFError, GGUFFile
from pagedbackend.models.gguf_linear import TYPE_IDS, _check_weight
from pagedbackend.models.moe import FusedMoE

_ops = torch.library.Library("pagedbackend", "FRAGMENT")
_ops.define("gguf_experts(Tensor x, Tensor ids, Tensor weights, Tensor[] blocks, int[] types, "
            "str activation, float alpha, float limit) -> Tensor")
_NO_MAP = torch.empty(0, dtype=torch.int64)


def _gguf_experts_cpu(x, ids, weights, blocks, types, activation, alpha, limit):
    """``fused_experts_torch``'s sum with each expert's gate/up ``[E, I, bytes]``
    and down ``[E, H, bytes]`` blocks (``blocks``, of ggml ``types``)."""
    gate, up, down = blocks
    hidden, inter = x.shape[1], gate.shape[1]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = torch.ops.pagedbackend.gguf_linear(rows, [gate[e], up[e]], [_NO_MAP, _NO_MAP], types[:2], 2 * inter)
        h = moe_ref.activate(h, activation, alpha, limit)
        return torch.ops.pagedbackend.gguf_linear(h, [down[e]], [_NO_MAP], types[2:], hidden)
    return moe_ref.each_expert(x, ids, weights, gate.shape[0], expert)


_ops.impl("gguf_experts", _gguf_experts_cpu, "CPU")
torch.library.register_fake("pagedbackend::gguf_experts")(
    lambda x, ids, weights, blocks, types, activation, alpha, limit: x.new_empty(x.shape))


class GGUFExperts(nn.Module):
    """Every expert of one layer: gate and up uint8 ``[E, I, H bytes]``, down
    ``[E, H, I bytes]``, each of its own type (a name of ``TYPE_IDS``)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types: List[str],
                 hidden: int, inter: int):
        super().__init__()
        for name, blocks, cols, kind in zip(("gate", "up", "down"), (gate, up, down), (hidden, hidden, inter),
                                            types):
            for e in range(blocks.shape[0]):
                _check_weight(blocks[e], TYPE_IDS[kind], cols)
            # A view into the file's mapping, never copied (not saved with the module).
            self.register_buffer(name, blocks, persistent=False)
        self.types = [TYPE_IDS[kind] for kind in types]
        self.type_names = list(types)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, activation: str = "silu",
                alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
        return torch.ops.pagedbackend.gguf_experts(x, ids, weights, [self.gate, self.up, self.down], self.types,
                                                   activation, alpha, limit)

    def expert_bytes(self) -> int:
        """Bytes of one expert's blocks."""
        return self.gate[0].numel() + self.up[0].numel() + self.down[0].numel()

    def dequantized(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` in float32, the values the kernel multiplies by."""
        def widen(blocks, type_id, cols):
            ids = torch.arange(blocks.shape[1])
            return torch.stack([torch.ops.pagedbackend.gguf_embedding(ids, b, type_id, cols) for b in blocks])
        hidden, inter = self.down.shape[1], self.gate.shape[1]
        w13 = torch.cat([widen(self.gate, self.types[0], hidden), widen(self.up, self.types[1], hidden)], dim=1)
        return w13, widen(self.down, self.types[2], inter)


Matrix = Callable[[str], Tuple[torch.Tensor, str]]


def load_gguf_experts(model: nn.Module, gguf: GGUFFile, matrix: Matrix) -> Set[str]:
    """Routers and experts of every expert layer of ``model`` (``model.layers[N].mlp``)
    from ``blk.N.ffn_gate_inp`` and ``ffn_{gate,up,down}_exps``; ``matrix(name)``
    hands out an expert tensor (and counts its type). Returns the routers' names."""
    routers = set()
    for i, layer in enumerate(model.layers):
        moe = layer.mlp
        if not isinstance(moe, FusedMoE):
            continue
        c = moe.config
        router = f"blk.{i}.ffn_gate_inp.weight"
        moe.load_router("weight", _router(gguf, router, c.num_experts, c.hidden_size))
        routers.add(router)
        shapes = {"gate": (c.hidden_size, c.intermediate_size), "up": (c.hidden_size, c.intermediate_size),
                  "down": (c.intermediate_size, c.hidden_size)}
        parts = {proj: _experts_tensor(gguf, matrix, f"blk.{i}.ffn_{proj}_exps.weight", cols, rows, c.num_experts)
                 for proj, (cols, rows) in shapes.items()}
        kinds = [kind for _, kind in parts.values()]
        if all(kind in QUANTIZED for kind in kinds):
            moe.serve_gguf(GGUFExperts(*(t for t, _ in parts.values()), kinds, c.hidden_size, c.intermediate_size))
        elif any(kind in QUANTIZED for kind in kinds):
            raise GGUFError(f"{gguf.path.name}: the experts of layer {i} mix float and quantised types "
                            f"({', '.join(kinds)}); one layer's experts are served from one or the other")
        else:   # an unquantised file: FusedMoE's own weights and kernels
            gate, up, down = (t.float() for t, _ in parts.values())
            moe.load_stacked("gate_up", "weight", torch.cat([gate, up], dim=1))
            moe.load_stacked("down", "weight", down)
    missing = [f"layers.{i}.mlp.{part}" for i, layer in enumerate(model.layers)
               if isinstance(layer.mlp, FusedMoE) for part in layer.mlp.missing()]
    if missing:
        raise GGUFError(f"{gguf.path.name} lacks {len(missing)} expert tensor(s), e.g. {missing[:3]}")
    return routers


def _experts_tensor(gguf: GGUFFile, matrix: Matrix, name: str, cols: int, rows: int,
                    experts: int) -> Tuple[torch.Tensor, str]:
    """``name`` as ``[E, rows, row bytes]`` (float: ``[E, rows, cols]``), its shape checked."""
    if name not in gguf.tensors:
        raise GGUFError(f"{gguf.path.name} lacks tensor {name}, which the model needs")
    shape = gguf.tensors[name].shape
    if len(shape) != 3 or shape[2] != experts:
        held = f"{shape[2]} experts" if len(shape) == 3 else f"{len(shape)} dimensions"
        raise GGUFError(f"{gguf.path.name}: {name} of shape {list(shape)} holds {held}; the metadata "
                        f"(expert_count) says {experts}, so [{cols}, {rows}, {experts}] is expected")
    if shape[:2] != (cols, rows):
        raise GGUFError(f"{gguf.path.name}: {name} has shape {list(shape)}, the model's config "
                        f"[{cols}, {rows}, {experts}] (hidden size, expert_feed_forward_length)")
    tensor, kind = matrix(name)
    return tensor.view(experts, rows, tensor.shape[-1]), kind


def _router(gguf: GGUFFile, name: str, experts: int, hidden: int) -> torch.Tensor:
    """The float32 ``[E, H]`` router (widened if a file quantised it)."""
    if name not in gguf.tensors:
        raise GGUFError(f"{gguf.path.name} lacks tensor {name}, which the model needs")
    info = gguf.tensors[name]
    if info.shape != (hidden, experts):
        raise GGUFError(f"{gguf.path.name}: {name} has shape {list(info.shape)}; the metadata says "
                        f"[{hidden}, {experts}] (hidden size, expert_count)")
    tensor = gguf.tensor(name)
    if info.type_name in QUANTIZED:
        return torch.ops.pagedbackend.gguf_embedding(torch.arange(experts), tensor, TYPE_IDS[info.type_name],
                                                     hidden)
    return tensor.float()

