"""LLaVA: a CLIP vision tower and a two-layer projector in front of a
Llama-shaped text decoder (Llama, Mistral, Qwen2). Each ``<image>`` of the
prompt stands for one image's patches (the processor expands it); their
embeddings are the projector's rows (``models.vision.clip``)."""
from typing import Optional

import torch

from pagedbackend.models.linear import Reduce
from pagedbackend.models.llama import LlamaForCausalLM
from pagedbackend.models.model_args import ModelArgs
from pagedbackend.models.multimodal import text_decoder_tensor, wrapped_text_config
from pagedbackend.models.vision.clip import LlavaVision


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The text decoder of ``models.llama`` and ``vision`` (tower + projector)."""

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        args = super().parse_config(wrapped_text_config(cfg, ("llama", "mistral", "qwen2")))
        args.vision_config = cfg
        return args

    def __init__(self, args: ModelArgs, dtype: torch.dtype, max_positions: Optional[int] = None,
                 tp_rank: int = 0, tp_size: int = 1, reduce: Optional[Reduce] = None):
        super().__init__(args, dtype, max_positions, tp_rank, tp_size, reduce)
        cfg = args.vision_config
        self.image_token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
        self.vision = LlavaVision(cfg, args.hidden_size, dtype)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor):
        part = name.removeprefix("model.")
        if part.startswith(("vision_tower.", "multi_modal_projector.")):
            yield "vision." + part, tensor
            return
        yield from text_decoder_tensor(self, name, tensor)
