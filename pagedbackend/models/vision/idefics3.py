"""Idefics3 / SmolVLM's vision encoder: SigLIP over an image's tiles, then
the connector (pixel shuffle by ``scale_factor``, a linear projection).

The processor splits an image into a grid of square tiles plus a global view
(each tile ``image_size`` pixels a side), and writes, per tile, a tag
(``<row_i_col_j>`` or ``<global-img>``) followed by ``image_seq_len``
``<image>`` tokens. The tiles of one prompt come as one batch
(``pixel_values [1, tiles, 3, H, W]``, ``pixel_attention_mask [1, tiles, H,
W]`` marking real pixels); which tiles belong to which image is read from the
prompt's ids: every image ends with its global view, whose tag is the one
before the prompt's last run of ``<image>`` tokens. The tiles run through the
tower as a batch, padded patches hidden from attention and given the
positions Hugging Face gives them; the pixel shuffle folds each
``scale_factor`` x ``scale_factor`` group of patches into one token.
"""
from typing import Dict, Iterable, List, Mapping, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.models.vision.base import VisionEncoder
from pagedbackend.models.vision.siglip import SiglipArgs, SiglipVisionTransformer, load_named

# What transformers' Idefics3VisionConfig assumes for a field config.json leaves out.
IDEFICS3_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12,
                                num_attention_heads=16, image_size=224, patch_size=32)


def image_token_runs(ids: List[int], image_token_id: int) -> List[Tuple[int, int]]:
    """``(start, end)`` of each maximal run of ``image_token_id`` in ``ids``."""
    runs, start = [], None
    for i, token in enumerate(ids + [None]):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            runs.append((start, i))
            start = None
    return runs


def tiles_per_image(ids: List[int], image_token_id: int) -> List[int]:
    """How many tiles each image of a prompt has: runs of ``<image>`` tokens,
    an image closed by the run whose tag (the token before it) is the global
    view's, the tag of the prompt's last run."""
    runs = image_token_runs(ids, image_token_id)
    if not runs:
        return []
    if runs[0][0] == 0:
        raise ValueError("an Idefics3 prompt's image tokens need their tile tag before them")
    tags = [ids[start - 1] for start, _ in runs]
    counts, tiles = [], 0
    for tag in tags:
        tiles += 1
        if tag == tags[-1]:
            counts.append(tiles)
            tiles = 0
    return counts


def patch_positions(patch_mask: torch.Tensor, per_side: int) -> torch.Tensor:
    """Position ids ``[tiles, patches]`` of each tile's patches: the real
    patches (``patch_mask [tiles, rows, cols]``) spread over the learned
    ``per_side`` x ``per_side`` grid by their fractional coordinates, padding
    patches at 0 (Hugging Face's Idefics3 embeddings, bucketised alike)."""
    tiles, rows, cols = patch_mask.shape
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=patch_mask.device)
    real_rows, real_cols = patch_mask[:, :, 0].sum(dim=1), patch_mask[:, 0, :].sum(dim=1)
    frac_h = torch.arange(rows, device=patch_mask.device, dtype=torch.float32)[None] * (1.0 / real_rows)[:, None]
    frac_w = torch.arange(cols, device=patch_mask.device, dtype=torch.float32)[None] * (1.0 / real_cols)[:, None]
    bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
    bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
    positions = (bucket_h[:, :, None] * per_side + bucket_w[:, None, :]).reshape(tiles, -1)
    return torch.where(patch_mask.reshape(tiles, -1), positions, torch.zeros_like(positions))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``[tiles, side*side, d]`` -> ``[tiles, side*side/scale^2, d*scale^2]``:
    each ``scale`` x ``scale`` group of patches becomes one token, its
    features in Hugging Face's order."""
    tiles, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(tiles, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(tiles, seq // (scale * scale), dim * scale * scale)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale: int, dtype: torch.dtype):
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision_hidden * scale * scale, text_hidden, bias=False,
                                                  dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(hidden, self.scale))


class Idefics3VisionEncoder(VisionEncoder):
    """SigLIP (``vision_model.``) and the connector (``connector.``)."""

    def __init__(self, vision_cfg: dict, scale_factor: int, text_hidden: int, image_token_id: int,
                 dtype: torch.dtype):
        super().__init__()
        self.args = SiglipArgs.from_config(vision_cfg, **IDEFICS3_VISION_DEFAULTS)
        self.scale_factor, self.image_token_id, self.dtype = scale_factor, image_token_id, dtype
        self.vision_model = SiglipVisionTransformer(self.args, dtype)
        self.connector = Idefics3Connector(self.args.hidden_size, text_hidden, scale_factor, dtype)
        self.connector.requires_grad_(False)

    def split_images(self, processed: Mapping[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
        """One dict per image: its tiles' ``pixel_values [tiles, 3, H, W]`` and
        ``pixel_attention_mask [tiles, H, W]`` (all real when the processor gave none)."""
        if "input_ids" not in processed:
            raise ValueError("Idefics3's images are split by the prompt's ids: the processor's output "
                             "needs input_ids")
        ids, pixels = processed["input_ids"], processed["pixel_values"]
        if ids.shape[0] != 1 or pixels.dim() != 5 or pixels.shape[0] != 1:
            raise ValueError(f"Idefics3's processor output for one prompt expected (input_ids [1, L], "
                             f"pixel_values [1, tiles, 3, H, W]), got {tuple(ids.shape)} and {tuple(pixels.shape)}")
        counts = tiles_per_image(ids[0].tolist(), self.image_token_id)
        masks = processed.get("pixel_attention_mask")
        masks = torch.ones(pixels.shape[1:2] + pixels.shape[3:], dtype=torch.bool) if masks is None else masks[0]
        if sum(counts) != pixels.shape[1]:
            raise ValueError(f"the prompt's ids place {sum(counts)} image tiles, the processor made {pixels.shape[1]}")
        images, first = [], 0
        for count in counts:
            images.append({"pixel_values": pixels[0, first:first + count],
                           "pixel_attention_mask": masks[first:first + count].bool()})
            first += count
        return images

    def tokens_per_tile(self, height: int, width: int) -> int:
        return (height // self.args.patch_size) * (width // self.args.patch_size) // self.scale_factor ** 2

    def num_embeds(self, image: Mapping[str, torch.Tensor]) -> int:
        tiles, _, height, width = image["pixel_values"].shape
        return tiles * self.tokens_per_tile(height, width)

    @torch.no_grad()
    def forward(self, image: Mapping[str, torch.Tensor]) -> torch.Tensor:
        device = self.connector.modality_projection.proj.weight.device
        pixels = image["pixel_values"].to(device)
        patch = self.args.patch_size
        pixel_mask = image["pixel_attention_mask"].to(device)
        # a patch is real when any of its pixels is
        patch_mask = F.max_pool2d(pixel_mask[:, None].float(), patch, stride=patch)[:, 0] > 0
        positions = patch_positions(patch_mask, self.args.patches_per_side)
        key_mask = None if bool(patch_mask.all()) else patch_mask.flatten(1)
        hidden = self.vision_model(pixels, positions, key_mask)
        return self.connector(hidden).reshape(-1, self.connector.modality_projection.proj.out_features)

    def load_weights(self, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        load_named(self, tensors, "Idefics3 vision tower and connector")
