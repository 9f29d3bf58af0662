"""The causal decoder of the mixture-of-experts families (Qwen3-MoE, Mixtral,
gpt-oss): ``CausalLM`` whose decoder layers take a ``FusedMoE`` as their MLP
(or, on the layers a family keeps dense, a gated MLP).

A family says how it reads its config (``parse_config`` into ``MoEArgs``)
and how its checkpoint names its router and experts
(``load_expert_tensor``); expert tensors go straight to their layer's loader,
everything else through the decoder's. The experts' kernel is chosen after
loading, once per machine (``moe.use_kernel``).
"""
import re
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from pagedbackend.models.decoder import CausalLM, Tensors
from pagedbackend.models.layers import GatedMLP
from pagedbackend.models.linear import Reduce
from pagedbackend.models.model_args import ModelArgs
from pagedbackend.models.moe import FusedMoE, MoEConfig


@dataclass
class MoEArgs(ModelArgs):
    """``ModelArgs`` plus the experts. ``intermediate_size`` is the dense MLP's."""
    moe: Optional[MoEConfig] = None
    # Per layer: experts (True) or a dense gated MLP (Qwen3-MoE's mlp_only_layers).
    sparse_layers: List[bool] = field(default_factory=list)
    # Whole experts per rank under tensor parallelism (EngineConfig.enable_expert_parallel).
    expert_parallel: bool = False


class MoECausalLM(CausalLM):
    """A decoder whose layers' MLPs are experts; ``self.args`` is a ``MoEArgs``."""

    # The layer's MLP in checkpoint names: ``layers.N.<MLP>.`` (Mixtral's older
    # checkpoints say block_sparse_moe).
    _LAYER_RE = re.compile(r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)$")

    def build_mlp(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                  dtype: torch.dtype) -> nn.Module:
        args = self.args
        if args.sparse_layers[layer]:
            return FusedMoE(args.moe, tp_rank, tp_size, reduce, dtype, args.expert_parallel)
        return GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, tp_rank, tp_size, reduce, dtype)

    def experts(self, layer: int) -> FusedMoE:
        mlp = self.layers[layer].mlp
        if not isinstance(mlp, FusedMoE):
            raise ValueError(f"checkpoint has experts for layer {layer}, which the config makes dense")
        return mlp

    def load_expert_tensor(self, layer: int, name: str, tensor: torch.Tensor) -> bool:
        """Load ``tensor``, named ``name`` inside layer ``layer``'s MLP, if it is
        a router or expert tensor of this family's checkpoints; False otherwise."""
        raise NotImplementedError

    @torch.no_grad()
    def load_weights(self, tensors: Tensors) -> None:
        super().load_weights(self._divert_experts(tensors))
        missing = [f"layers.{i}.mlp.{part}" for i, layer in enumerate(self.layers)
                   if isinstance(layer.mlp, FusedMoE) for part in layer.mlp.missing()]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} expert tensor(s), e.g. {missing[:3]}")

    def _divert_experts(self, tensors: Tensors) -> Tensors:
        for hf_name, tensor in tensors:
            found = self._LAYER_RE.match(hf_name.removeprefix("model."))
            if not (found and self.args.sparse_layers[int(found.group(1))]
                    and self.load_expert_tensor(int(found.group(1)), found.group(2), tensor)):
                yield hf_name, tensor

    def hf_projections(self) -> Iterator[Tuple[Tuple[str, ...], nn.Module]]:
        """The attention projections of every layer and the MLP projections of the dense layers."""
        for i, layer in enumerate(self.layers):
            for merged, parts in self.MERGED:
                block = merged.split(".")[0]
                if block == "mlp" and self.args.sparse_layers[i]:
                    continue
                yield (tuple(f"model.layers.{i}.{block}.{part}.weight" for part in parts),
                       layer.get_submodule(merged))


def sparse_layer_pattern(layers: int, num_experts: int, step: int = 1,
                         dense: Optional[List[int]] = None) -> List[bool]:
    """Qwen-MoE's rule: layer ``i`` has experts unless it is listed in
    ``mlp_only_layers`` or ``(i + 1)`` is not a multiple of ``decoder_sparse_step``."""
    dense = set(dense or [])
    return [num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)]
