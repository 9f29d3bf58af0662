"""Granite (3.x dense): Llama's decoder with four scalars: the embedding is
multiplied by ``embedding_multiplier``, each residual branch by
``residual_multiplier``, the softmax scale is ``attention_multiplier``, and
the logits are divided by ``logits_scaling``."""
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

from pagedbackend.models.decoder import CausalLM
from pagedbackend.models.layers import DecoderLayer, llama_layer
from pagedbackend.models.linear import Reduce
from pagedbackend.models.llama import plain_rope
from pagedbackend.models.model_args import ModelArgs, check_activation, common_fields
from pagedbackend.models.rotary import CosSin


@dataclass
class GraniteArgs(ModelArgs):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteDecoderLayer(DecoderLayer):
    """``h + m * attn(norm(h))``, then ``h + m * mlp(norm(h))``."""

    def __init__(self, layer: DecoderLayer, residual_multiplier: float):
        super().__init__(layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
        self.residual_multiplier = residual_multiplier

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ropes: List[CosSin]) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, ropes) * self.residual_multiplier
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier


class GraniteForCausalLM(CausalLM):
    @classmethod
    def parse_config(cls, cfg: dict) -> GraniteArgs:
        check_activation(cfg, ("silu",), "hidden_act")
        fields = common_fields(cfg, tie_word_embeddings=False)
        bias = cfg.get("attention_bias", False)   # on q, k, v and o alike
        return GraniteArgs(**fields, ropes=[plain_rope(cfg)], layer_ropes=[0] * fields["num_layers"],
                           layer_windows=[None] * fields["num_layers"], attention_bias=bias, output_bias=bias,
                           mlp_bias=cfg.get("mlp_bias", False),
                           attention_scale=cfg.get("attention_multiplier", 1.0),
                           embedding_multiplier=cfg.get("embedding_multiplier", 1.0),
                           residual_multiplier=cfg.get("residual_multiplier", 1.0),
                           logits_scaling=cfg.get("logits_scaling", 1.0))

    def build_layer(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                    dtype: torch.dtype) -> nn.Module:
        return GraniteDecoderLayer(llama_layer(self.args, layer, tp_rank, tp_size, reduce, dtype),
                                   self.args.residual_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.args.embedding_multiplier

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.args.logits_scaling
