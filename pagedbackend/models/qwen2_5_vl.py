"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): its vision tower with
window attention (``models.vision.qwen2_5_vl``) in front of a Qwen2 text
decoder whose RoPE is multimodal (``models.mrope``: three position streams,
the step's positions ``[3, tokens]``).

The prompt holds each image as ``<|vision_start|>``, one ``<|image_pad|>``
per merged patch group, ``<|vision_end|>``; the pads take the tower's rows.
Checkpoints come in two layouts: transformers 5's (``text_config``,
``model.language_model.*``, ``model.visual.*``) and the original one (text
fields at the top, ``model.layers.*``, ``visual.*``); both load.
"""
from typing import Optional

import torch
from torch import nn

from pagedbackend.models.linear import Reduce
from pagedbackend.models.llama import LlamaForCausalLM
from pagedbackend.models.model_args import ModelArgs, refuse
from pagedbackend.models.mrope import MRotaryEmbedding, step_positions
from pagedbackend.models.vision.qwen2_5_vl import Qwen2_5_VisionTransformer
from pagedbackend.multimodal.qwen2_5_vl import load_images_processor


def text_config(cfg: dict) -> dict:
    """The text decoder's fields as Qwen2's (q/k/v biases, its sliding-window
    rule), with the M-RoPE sections kept in its RoPE settings."""
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    if text.get("model_type", "qwen2_5_vl_text") not in ("qwen2_5_vl_text", "qwen2_5_vl"):
        raise refuse("text_config.model_type", text.get("model_type"), "served text decoder: qwen2_5_vl_text")
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type")) in ("mrope", None):
        rope["rope_type"] = "default"
    rope.pop("type", None)
    if not rope.get("mrope_section"):
        raise refuse("rope_parameters.mrope_section", None, "Qwen2.5-VL's text RoPE needs its three sections")
    text["rope_parameters"] = rope
    text.pop("rope_scaling", None)
    text["model_type"] = "qwen2"
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """The Qwen2 text decoder with M-RoPE, and ``vision`` (tower + merger)."""
    load_processor = staticmethod(load_images_processor)   # images only (multimodal.qwen2_5_vl)

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        args = super().parse_config(text_config(cfg))
        args.vision_config = cfg
        return args

    def __init__(self, args: ModelArgs, dtype: torch.dtype, max_positions: Optional[int] = None,
                 tp_rank: int = 0, tp_size: int = 1, reduce: Optional[Reduce] = None):
        if tp_size > 1:
            raise refuse("tensor_parallel_size", tp_size, "Qwen2.5-VL's M-RoPE positions are served on one rank")
        super().__init__(args, dtype, max_positions, tp_rank, tp_size, reduce)
        cfg = args.vision_config
        self.image_token_id = cfg.get("image_token_id", 151655)
        vision = cfg.get("vision_config") or {}
        self.vision = Qwen2_5_VisionTransformer(vision, args.hidden_size, dtype)
        self.rotary = nn.ModuleList(MRotaryEmbedding(params, args.head_dim, args.max_position_embeddings,
                                                     max_positions or args.served_positions, dtype)
                                    for params in args.ropes)

    def step_positions(self, entries, positions: torch.Tensor) -> torch.Tensor:
        """int64 ``[3, tokens]``: the M-RoPE positions of a step's entries
        (``positions``: their token positions, ``[tokens]``)."""
        return step_positions(entries, self.vision.merge, positions)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor):
        part = name.removeprefix("model.")
        if part.startswith("visual."):
            yield "vision." + part[len("visual."):], tensor
        else:
            yield part.removeprefix("language_model."), tensor
