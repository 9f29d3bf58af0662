"""Qwen3: Llama's decoder with a per-head RMSNorm of q and k before RoPE, and a
``head_dim`` of its own (not hidden size / heads)."""
from typing import Optional

import torch
from torch import nn

from pagedbackend.models.decoder import CausalLM
from pagedbackend.models.layers import RMSNorm, llama_layer
from pagedbackend.models.linear import Reduce
from pagedbackend.models.llama import plain_rope, sliding_windows
from pagedbackend.models.model_args import ModelArgs, check_activation, common_fields


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        check_activation(cfg, ("silu",), "hidden_act")
        fields = common_fields(cfg, tie_word_embeddings=False, head_dim=128)
        bias = cfg.get("attention_bias", False)   # on q, k, v and o alike
        return ModelArgs(**fields, ropes=[plain_rope(cfg)], layer_ropes=[0] * fields["num_layers"],
                         layer_windows=sliding_windows(cfg), attention_bias=bias, output_bias=bias)

    def build_layer(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                    dtype: torch.dtype) -> nn.Module:
        return llama_layer(self.args, layer, tp_rank, tp_size, reduce, dtype, qk_norm=RMSNorm)
