"""Mixtral: Mistral's decoder with top-2 of 8 experts in every layer.

Router: softmax over every expert, the top ``num_experts_per_tok`` rescaled
to sum to one (a softmax over the chosen logits). Expert tensors come per
expert (``block_sparse_moe.experts.N.w1`` gate, ``w3`` up, ``w2`` down, as
transformers saves them) or fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``).
"""
from typing import Optional

import torch
from torch import nn

from pagedbackend.models.layers import Attention, DecoderLayer, RMSNorm
from pagedbackend.models.linear import Reduce
from pagedbackend.models.llama import plain_rope
from pagedbackend.models.model_args import check_activation, common_fields, required
from pagedbackend.models.moe import MoEConfig
from pagedbackend.models.moe_decoder import MoEArgs, MoECausalLM

_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}


class MixtralForCausalLM(MoECausalLM):

    @classmethod
    def parse_config(cls, cfg: dict) -> MoEArgs:
        check_activation(cfg, ("silu",), "hidden_act")
        fields = common_fields(cfg, tie_word_embeddings=False, rms_norm_eps=1e-5)
        layers = fields["num_layers"]
        moe = MoEConfig(cfg.get("num_local_experts", 8), cfg.get("num_experts_per_tok", 2), fields["hidden_size"],
                        required(cfg, "intermediate_size"), "softmax", renormalize=True)
        return MoEArgs(**fields, ropes=[plain_rope(cfg)], layer_ropes=[0] * layers,
                       layer_windows=[cfg.get("sliding_window")] * layers, moe=moe, sparse_layers=[True] * layers)

    def build_layer(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                    dtype: torch.dtype) -> nn.Module:
        args = self.args
        return DecoderLayer(Attention(args, layer, tp_rank, tp_size, reduce, dtype),
                            self.build_mlp(layer, tp_rank, tp_size, reduce, dtype),
                            RMSNorm(args.hidden_size, args.rms_norm_eps, dtype),
                            RMSNorm(args.hidden_size, args.rms_norm_eps, dtype))

    def load_expert_tensor(self, layer: int, name: str, tensor: torch.Tensor) -> bool:
        parts = name.split(".")
        if name == "gate.weight":
            self.experts(layer).load_router("weight", tensor)
        elif len(parts) == 4 and parts[0] == "experts" and parts[2] in _PROJECTIONS:
            self.experts(layer).load_expert(int(parts[1]), _PROJECTIONS[parts[2]], parts[3], tensor)
        elif name in ("experts.gate_up_proj", "experts.down_proj"):
            self.experts(layer).load_stacked(parts[1][:-5], "weight", tensor)
        else:
            return False
        return True
