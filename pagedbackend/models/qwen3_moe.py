"""Qwen3-MoE: Qwen3's decoder (per-head RMSNorm of q and k) with experts.

Router: softmax over every expert, the top ``num_experts_per_tok`` kept,
rescaled to sum to one with ``norm_topk_prob``. Layers listed in
``mlp_only_layers``, or whose number is not a multiple of
``decoder_sparse_step``, keep a dense MLP of ``intermediate_size``. Expert
tensors come per expert (``mlp.experts.N.gate_proj.weight``, as transformers
saves them) or fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``).
"""
from typing import Optional

import torch
from torch import nn

from pagedbackend.models.layers import Attention, DecoderLayer, RMSNorm
from pagedbackend.models.linear import Reduce
from pagedbackend.models.llama import plain_rope
from pagedbackend.models.model_args import check_activation, common_fields, required
from pagedbackend.models.moe import MoEConfig
from pagedbackend.models.moe_decoder import MoEArgs, MoECausalLM, sparse_layer_pattern


class Qwen3MoeForCausalLM(MoECausalLM):

    @classmethod
    def parse_config(cls, cfg: dict) -> MoEArgs:
        check_activation(cfg, ("silu",), "hidden_act")
        fields = common_fields(cfg, tie_word_embeddings=False)
        layers = fields["num_layers"]
        # transformers saves num_experts under its attribute-map name.
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        sparse = sparse_layer_pattern(layers, experts, cfg.get("decoder_sparse_step", 1),
                                      cfg.get("mlp_only_layers"))
        moe = MoEConfig(experts, required(cfg, "num_experts_per_tok"), fields["hidden_size"],
                        required(cfg, "moe_intermediate_size"), "softmax",
                        renormalize=cfg.get("norm_topk_prob", False)) if any(sparse) else None
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        bias = cfg.get("attention_bias", False)
        return MoEArgs(**fields, ropes=[plain_rope(cfg)], layer_ropes=[0] * layers, layer_windows=[window] * layers,
                       attention_bias=bias, output_bias=bias, moe=moe, sparse_layers=sparse)

    def build_layer(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                    dtype: torch.dtype) -> nn.Module:
        args = self.args
        return DecoderLayer(Attention(args, layer, tp_rank, tp_size, reduce, dtype, qk_norm=RMSNorm),
                            self.build_mlp(layer, tp_rank, tp_size, reduce, dtype),
                            RMSNorm(args.hidden_size, args.rms_norm_eps, dtype),
                            RMSNorm(args.hidden_size, args.rms_norm_eps, dtype))

    def load_expert_tensor(self, layer: int, name: str, tensor: torch.Tensor) -> bool:
        parts = name.split(".")
        if name == "gate.weight":
            self.experts(layer).load_router("weight", tensor)
        elif len(parts) == 4 and parts[0] == "experts" and parts[2] in ("gate_proj", "up_proj", "down_proj"):
            self.experts(layer).load_expert(int(parts[1]), parts[2][:-5], parts[3], tensor)
        elif name in ("experts.gate_up_proj", "experts.down_proj"):
            self.experts(layer).load_stacked(parts[1][:-5], "weight", tensor)
        else:
            return False
        return True
