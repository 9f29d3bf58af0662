"""Gemma 3 (text, and ``Gemma3ForConditionalGeneration``: the text decoder
with its SigLIP vision encoder) and Gemma 2.

What differs from Llama: RMSNorm multiplies by ``1 + w``; four norms per
layer (before and after attention, before and after the MLP); a GELU-tanh
gated MLP; embeddings scaled by ``sqrt(hidden_size)``; the softmax scale is
``query_pre_attn_scalar ** -0.5``; Gemma 3 normalises q and k per head; layers
are sliding or full (``layer_types``), each type with its own RoPE; the logits
may be soft-capped (``final_logit_softcapping``). Attention-score
soft-capping (Gemma 2's ``attn_logit_softcapping``) is not in the attention
paths: a config that sets it is refused.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

from pagedbackend.models.decoder import CausalLM
from pagedbackend.models.layers import ACTIVATIONS, Attention, GatedMLP
from pagedbackend.models.linear import Reduce
from pagedbackend.models.model_args import (ModelArgs, check_activation, common_fields, distinct,
                                            layer_types_of, refuse, windows_of)
from pagedbackend.models.multimodal import text_decoder_tensor, wrapped_text_config
from pagedbackend.models.rotary import CosSin, rope_parameters
from pagedbackend.models.vision.gemma3 import Gemma3VisionEncoder

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass
class GemmaArgs(ModelArgs):
    hidden_act: str = "gelu_pytorch_tanh"
    final_logit_softcapping: Optional[float] = None


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)``, all in fp32, cast back (HF Gemma)."""

    def __init__(self, size: int, eps: float, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)

    @torch.no_grad()
    def divide_gain_(self, s: torch.Tensor) -> None:
        """Divide the output channels by ``s``: the gain is ``1 + w``."""
        self.weight.copy_((1.0 + self.weight.float()) / s - 1.0)


class GemmaDecoderLayer(nn.Module):
    """``h + norm(attn(norm(h)))``, then ``h + norm(mlp(norm(h)))``."""

    def __init__(self, args: GemmaArgs, self_attn: nn.Module, mlp: nn.Module, dtype: torch.dtype):
        super().__init__()
        def norm():
            return GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.input_layernorm, self.self_attn, self.post_attention_layernorm = norm(), self_attn, norm()
        self.pre_feedforward_layernorm, self.mlp, self.post_feedforward_layernorm = norm(), mlp, norm()

    @property
    def pre_mlp_norm(self) -> nn.Module:
        return self.pre_feedforward_layernorm

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ropes: List[CosSin]) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), positions, ropes))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def gemma_ropes(cfg: dict, layer_types: List[str]) -> List[Optional[dict]]:
    """Per layer, its type's RoPE: transformers 5 nests them by type; older
    Gemma 3 configs give ``rope_theta`` (+ ``rope_scaling``) for full layers
    and ``rope_local_base_freq`` for sliding ones."""
    given = cfg.get("rope_parameters") or {}
    if cfg.get("model_type") == "gemma3_text" and not any(kind in given for kind in layer_types):
        full = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1e6),
                **(cfg.get("rope_scaling") or {}), **given}
        sliding = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}
        cfg = {**cfg, "layer_types": layer_types,
               "rope_parameters": {"full_attention": full, "sliding_attention": sliding}}
    settings = [rope_parameters(cfg, kind) for kind in layer_types]
    for params in settings:
        if params is not None and params.get("partial_rotary_factor", 1.0) != 1.0:
            raise refuse("partial_rotary_factor", params["partial_rotary_factor"], "Gemma rotates whole heads")
    return settings


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text (``gemma3_text``); ``Gemma2ForCausalLM`` is the same
    without the q/k norms."""
    QK_NORM = True
    DEFAULT_PATTERN = 6   # Gemma 3: five sliding layers, then a full one
    # What HF's config class assumes when config.json leaves a field out.
    DEFAULT_SOFTCAPS = {"attn_logit_softcapping": None, "final_logit_softcapping": None}

    @classmethod
    def parse_config(cls, cfg: dict) -> GemmaArgs:
        cfg = {**cls.DEFAULT_SOFTCAPS, **cfg}
        if cfg["attn_logit_softcapping"] is not None:
            raise refuse("attn_logit_softcapping", cfg["attn_logit_softcapping"],
                         "attention-score soft-capping is not in the attention kernels")
        if cfg.get("use_bidirectional_attention"):
            raise refuse("use_bidirectional_attention", True, "only causal attention is served")
        act = check_activation(cfg, GEMMA_ACTIVATIONS, "hidden_activation")
        fields = common_fields(cfg, tie_word_embeddings=True, head_dim=256)
        layers = fields["num_layers"]
        pattern = cfg.get("sliding_window_pattern") or cls.DEFAULT_PATTERN
        layer_types = layer_types_of(cfg, ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                           for i in range(layers)])
        ropes, layer_ropes = distinct(gemma_ropes(cfg, layer_types))
        bias = cfg.get("attention_bias", False)
        return GemmaArgs(**fields, ropes=ropes, layer_ropes=layer_ropes,
                         layer_windows=windows_of(layer_types, cfg.get("sliding_window", 4096)),
                         attention_bias=bias, output_bias=bias,
                         attention_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5, hidden_act=act,
                         final_logit_softcapping=cfg["final_logit_softcapping"])

    def __init__(self, args: GemmaArgs, dtype: torch.dtype, *rest, **kwargs):
        super().__init__(args, dtype, *rest, **kwargs)
        # HF multiplies by sqrt(hidden) rounded to the compute dtype.
        self.register_buffer("embed_scale", torch.tensor(args.hidden_size ** 0.5).to(dtype), persistent=False)

    def build_layer(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                    dtype: torch.dtype) -> nn.Module:
        args = self.args
        attn = Attention(args, layer, tp_rank, tp_size, reduce, dtype,
                         qk_norm=GemmaRMSNorm if self.QK_NORM else None)
        mlp = GatedMLP(args.hidden_size, args.intermediate_size, False, tp_rank, tp_size, reduce, dtype,
                       act=ACTIVATIONS[args.hidden_act])
        return GemmaDecoderLayer(args, attn, mlp, dtype)

    def build_norm(self, size: int, dtype: torch.dtype) -> nn.Module:
        return GemmaRMSNorm(size, self.args.rms_norm_eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: one RoPE for every layer, sliding and full layers alternating,
    no q/k norms; served when its attention scores are not soft-capped."""
    QK_NORM = False
    DEFAULT_PATTERN = 2
    DEFAULT_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's multimodal checkpoint: the text decoder and ``vision``
    (SigLIP and the projector, ``models.vision.gemma3``). An image's soft
    tokens attend to each other both ways (its encoder is ``bidirectional``:
    the runner lists each image's span as a block, ``models.attention``); the
    scheduler computes a span in one prefill chunk."""

    @classmethod
    def parse_config(cls, cfg: dict) -> GemmaArgs:
        args = super().parse_config(wrapped_text_config(cfg, ("gemma3_text",)))
        args.vision_config = cfg
        return args

    def __init__(self, args: GemmaArgs, dtype: torch.dtype, *rest, **kwargs):
        super().__init__(args, dtype, *rest, **kwargs)
        cfg = args.vision_config
        self.image_token_id = cfg.get("image_token_index", cfg.get("image_token_id", 262144))
        self.vision = Gemma3VisionEncoder(cfg.get("vision_config") or {}, cfg.get("mm_tokens_per_image", 256),
                                          args.hidden_size, dtype)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor):
        part = name.removeprefix("model.")
        if part.startswith(("vision_tower.", "multi_modal_projector.")):
            yield "vision." + part, tensor
            return
        yield from text_decoder_tensor(self, name, tensor)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The image placeholder may lie past the vocabulary (its rows are replaced): as transformers, id 0 there.
        vocab = self.embed_tokens.num_embeddings
        return super().embed(torch.where(input_ids < vocab, input_ids, torch.zeros_like(input_ids)))
