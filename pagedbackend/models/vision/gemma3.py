"""Gemma 3's vision encoder: SigLIP on one square image, then the
multimodal projector: the patch grid average-pooled down to
``mm_tokens_per_image`` tokens, the soft-embedding RMSNorm (``x / rms(x) *
(1 + w)``, in fp32) and the input projection (a matrix ``[vision hidden,
text hidden]``, no bias).

The processor writes ``<start_of_image>``, ``mm_tokens_per_image`` image soft
tokens and ``<end_of_image>`` per image (pan-and-scan crops: the image and
its crops, each so wrapped, with text between them) and gives
``pixel_values [images + crops, 3, H, W]``, an image followed by its crops.
"""
from typing import Dict, Iterable, List, Mapping, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.models.model_args import refuse
from pagedbackend.models.vision.base import VisionEncoder
from pagedbackend.models.vision.siglip import SiglipArgs, SiglipVisionTransformer, load_named


class Gemma3Projector(nn.Module):
    """Pool, normalise, project (HF's ``Gemma3MultiModalProjector``)."""

    def __init__(self, args: SiglipArgs, text_hidden: int, tokens_per_image: int, dtype: torch.dtype):
        super().__init__()
        side = int(round(tokens_per_image ** 0.5))
        if side * side != tokens_per_image or args.patches_per_side % side:
            raise refuse("mm_tokens_per_image", tokens_per_image,
                         f"a square grid that divides the {args.patches_per_side} x {args.patches_per_side} patches")
        self.patches_per_side, self.kernel = args.patches_per_side, args.patches_per_side // side
        self.eps = args.layer_norm_eps
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(args.hidden_size, text_hidden, dtype=dtype),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(args.hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, _, dim = hidden.shape
        grid = hidden.transpose(1, 2).reshape(batch, dim, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (x * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(hidden)


class Gemma3VisionEncoder(VisionEncoder):
    """SigLIP (``vision_tower.``) and the projector (``multi_modal_projector.``);
    an image's soft tokens attend to each other both ways."""
    bidirectional = True

    def __init__(self, vision_cfg: dict, tokens_per_image: int, text_hidden: int, dtype: torch.dtype):
        super().__init__()
        self.args = SiglipArgs.from_config(vision_cfg)
        self.tokens_per_image = tokens_per_image
        self.vision_tower = SiglipVisionTransformer(self.args, dtype)
        self.multi_modal_projector = Gemma3Projector(self.args, text_hidden, tokens_per_image, dtype)

    def split_images(self, processed: Mapping[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
        """One dict per image: ``pixel_values [1 + crops, 3, H, W]``."""
        pixels = processed["pixel_values"]
        if pixels.dim() != 4:
            raise ValueError(f"Gemma 3's pixel_values expected [images, 3, H, W], got {tuple(pixels.shape)}")
        crops = processed.get("num_crops")
        crops = [0] * pixels.shape[0] if crops is None else torch.as_tensor(crops).flatten().tolist()
        if sum(crops) + len(crops) != pixels.shape[0]:
            raise ValueError(f"Gemma 3's processor gave {pixels.shape[0]} pixel rows for {len(crops)} image(s) "
                             f"with {sum(crops)} crops")
        images, first = [], 0
        for count in crops:
            images.append({"pixel_values": pixels[first:first + 1 + count]})
            first += 1 + count
        return images

    def num_embeds(self, image: Mapping[str, torch.Tensor]) -> int:
        return image["pixel_values"].shape[0] * self.tokens_per_image

    @torch.no_grad()
    def forward(self, image: Mapping[str, torch.Tensor]) -> torch.Tensor:
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = image["pixel_values"].to(weight.device)
        if pixels.shape[-1] != self.args.image_size or pixels.shape[-2] != self.args.image_size:
            raise ValueError(f"Gemma 3's tower takes {self.args.image_size}-pixel square images, "
                             f"got {tuple(pixels.shape[-2:])}")
        return self.multi_modal_projector(self.vision_tower(pixels)).reshape(-1, weight.shape[1])

    def load_weights(self, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        # SigLIP's attention pooling head (present when vision_use_head) is not used by Gemma 3.
        load_named(self, tensors, "Gemma 3 vision tower and projector", skip=("vision_tower.head.",))
