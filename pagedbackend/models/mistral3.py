"""Mistral 3 served as text: ``Mistral3ForConditionalGeneration`` checkpoints
(Mistral Small 3.x, Ministral 3, Mistral Large 3), whose text decoder is a
``mistral`` or a ``ministral3`` (Mistral's decoder whose queries are scaled
by ``1 + beta * log(1 + floor(position / original_max_position_embeddings))``
after RoPE, ``rope_parameters.llama_4_scaling_beta``); ``ministral3`` alone
too. The vision tower and projector are not loaded (said in a log line):
images are not served."""
from typing import Optional

import torch
from torch import nn

from pagedbackend.models.decoder import CausalLM
from pagedbackend.models.layers import Attention, DecoderLayer, llama_layer
from pagedbackend.models.linear import Reduce
from pagedbackend.models.llama import LlamaForCausalLM
from pagedbackend.models.model_args import ModelArgs
from pagedbackend.models.multimodal import text_decoder_tensor, wrapped_text_config


class ScaledQueryAttention(Attention):
    """Attention whose queries are scaled by position after RoPE (Llama 4's attention temperature)."""

    def __init__(self, *args, beta: float, original_max_positions: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.beta, self.original_max_positions = beta, original_max_positions

    def scale_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.original_max_positions))
        return q * scale.to(q.dtype)[:, None, None]


class Ministral3ForCausalLM(CausalLM):
    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        # The same fields and windows as Mistral (every layer), read by Llama's parser.
        return LlamaForCausalLM.parse_config({**cfg, "model_type": "mistral"})

    def build_layer(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                    dtype: torch.dtype) -> nn.Module:
        rope = self.args.ropes[0]
        beta = rope.get("llama_4_scaling_beta")
        plain = llama_layer(self.args, layer, tp_rank, tp_size, reduce, dtype)
        if not beta:
            return plain
        attn = ScaledQueryAttention(self.args, layer, tp_rank, tp_size, reduce, dtype, beta=float(beta),
                                    original_max_positions=rope["original_max_position_embeddings"])
        return DecoderLayer(attn, plain.mlp, plain.input_layernorm, plain.post_attention_layernorm)


class Mistral3ForConditionalGeneration(Ministral3ForCausalLM):
    """The text decoder of a Mistral 3 checkpoint; its weights live under ``language_model.``."""

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        return super().parse_config(wrapped_text_config(cfg, ("mistral", "ministral3")))

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor):
        return text_decoder_tensor(self, name, tensor)
