"""Idefics3 / SmolVLM: a SigLIP tower over an image's tiles and the
pixel-shuffle connector (``models.vision.idefics3``) in front of a Llama
text decoder (``models.llama``).

The processor writes each image as tiles: ``<fake_token_around_image>``, the
tile's tag (``<row_i_col_j>``, or ``<global-img>`` for the whole image),
then its ``<image>`` placeholders; an image's span in the prompt therefore
interleaves tags and newlines with its placeholders, and only the
``<image>`` positions take the connector's rows (the item's embed mask).
"""
from typing import Optional

import torch

from pagedbackend.models.linear import Reduce
from pagedbackend.models.llama import LlamaForCausalLM
from pagedbackend.models.model_args import ModelArgs
from pagedbackend.models.multimodal import wrapped_text_config
from pagedbackend.models.vision.idefics3 import Idefics3VisionEncoder

_VISION = ("vision_model.", "connector.")


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The text decoder of ``models.llama`` and ``vision`` (tower + connector)."""

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        # Idefics3's LM head is its own unless the checkpoint ties it (transformers' default: untied).
        cfg = {"tie_word_embeddings": False, **cfg}
        args = super().parse_config(wrapped_text_config(cfg, ("llama",)))
        args.vision_config = cfg
        return args

    def __init__(self, args: ModelArgs, dtype: torch.dtype, max_positions: Optional[int] = None,
                 tp_rank: int = 0, tp_size: int = 1, reduce: Optional[Reduce] = None):
        super().__init__(args, dtype, max_positions, tp_rank, tp_size, reduce)
        cfg = args.vision_config
        self.image_token_id = cfg.get("image_token_id", 128257)
        self.vision = Idefics3VisionEncoder(cfg.get("vision_config") or {}, cfg.get("scale_factor", 2),
                                            args.hidden_size, self.image_token_id, dtype)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor):
        part = name.removeprefix("model.")
        if part.startswith(_VISION):
            yield "vision." + part, tensor
        elif part.startswith("text_model."):
            yield part[len("text_model."):], tensor
        else:
            yield name, tensor
