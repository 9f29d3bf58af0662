"""Qwen2.5-VL's vision transformer and patch merger.

An image arrives as the processor's patches: ``pixel_values [patches,
channels * temporal_patch * patch * patch]`` (``temporal_patch_size``
copies of the image stacked as frames), ordered so that each ``merge x
merge`` group of neighbouring patches is consecutive, and ``image_grid_thw``
(its grid in patches). Then: a Conv3d patch embedding (stride = kernel, no
bias) -> N x [RMSNorm -> attention with a 2-D RoPE (the first half of each
head turned by the patch's row, the second by its column) -> residual,
RMSNorm -> gated SiLU MLP -> residual] -> the merger (RMSNorm, each merge
group's patches concatenated, Linear -> GELU -> Linear), one row per merge
group in the text model's width.

Window attention: the blocks not in ``fullatt_block_indexes`` attend within
windows of ``window_size`` pixels (``window_size / patch / merge`` merge
groups a side); the patches are reordered window by window before the
blocks, so each window is a contiguous run, and the merged rows are put
back in row-major order at the end. Parameter names follow transformers'
``Qwen2_5_VisionTransformerPretrainedModel`` (``patch_embed.proj``,
``blocks.N.attn.qkv``, ``merger.mlp.0``), loaded by ``siglip.load_named``.
"""
from typing import Dict, Iterable, List, Mapping, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.models.layers import ACTIVATIONS, RMSNorm
from pagedbackend.models.model_args import refuse
from pagedbackend.models.vision.base import VisionEncoder
from pagedbackend.models.vision.siglip import load_named

EPS = 1e-6   # transformers fixes the tower's and the merger's RMSNorm epsilon


def window_order(t: int, h: int, w: int, merge: int, window: int) -> Tuple[torch.Tensor, List[int]]:
    """The merge groups of a ``t x h x w`` patch grid in window order (an
    index into the row-major groups), and the length of each window in
    patches; ``window``: merge groups a window side (transformers'
    ``get_vision_window_index`` for one image)."""
    gh, gw = h // merge, w // merge
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    pad_h, pad_w = -gh % window, -gw % window
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    nh, nw = (gh + pad_h) // window, (gw + pad_w) // window
    padded = padded.reshape(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, -1)
    lengths = (padded >= 0).sum(-1).reshape(-1)
    order = padded.reshape(-1)
    return order[order >= 0], [int(n) * merge * merge for n in lengths if n > 0]


def patch_rows_cols(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """int64 ``[t * h * w, 2]``: each patch's row and column, in the
    processor's order (merge groups row-major, patches row-major inside)."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten()
    cols = cols.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32 over whole heads, ``cos``/``sin`` ``[N, 1, head_dim / 2]``."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, cos_sin, segments: List[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).unbind(1)
        q, k = rotate(q, *cos_sin), rotate(k, *cos_sin)
        outs = [F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None])[0].transpose(0, 1)
                for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments))]
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act, dtype: torch.dtype):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(hidden, intermediate, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, act, dtype: torch.dtype):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(hidden, EPS, dtype), RMSNorm(hidden, EPS, dtype)
        self.attn = VisionAttention(hidden, heads, dtype)
        self.mlp = VisionMLP(hidden, intermediate, act, dtype)

    def forward(self, x: torch.Tensor, cos_sin, segments: List[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int, out: int, dtype: torch.dtype):
        super().__init__()
        self.width = hidden * merge * merge
        self.ln_q = RMSNorm(hidden, EPS, dtype)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width, dtype=dtype), nn.GELU(),
                                 nn.Linear(self.width, out, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2_5_VisionTransformer(VisionEncoder):
    """One image's patches to its merged rows ``[t * h * w / merge^2, text hidden]``."""

    def __init__(self, cfg: dict, text_hidden: int, dtype: torch.dtype):
        super().__init__()
        hidden, self.heads = cfg.get("hidden_size", 1280), cfg.get("num_heads", 16)
        if hidden % self.heads or (hidden // self.heads) % 4:
            raise refuse("vision_config.num_heads", self.heads,
                         f"hidden_size {hidden} needs heads of a size divisible by 4 (2-D RoPE)")
        act = cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise refuse("vision_config.hidden_act", act, f"served: {', '.join(ACTIVATIONS)}")
        self.patch, self.merge = cfg.get("patch_size", 14), cfg.get("spatial_merge_size", 2)
        self.temporal = cfg.get("temporal_patch_size", 2)
        self.channels = cfg.get("in_channels", cfg.get("in_chans", 3))
        window = cfg.get("window_size", 112)
        self.window = window // self.merge // self.patch   # merge groups a window side
        if self.window < 1:
            raise refuse("vision_config.window_size", window, f"smaller than one merge group "
                         f"({self.merge} x {self.patch} pixels)")
        self.full_blocks = set(cfg.get("fullatt_block_indexes", ()))
        depth = cfg.get("depth", 32)
        out = cfg.get("out_hidden_size", text_hidden)
        if out != text_hidden:
            raise refuse("vision_config.out_hidden_size", out, f"the text model's hidden_size is {text_hidden}")
        rope = cfg.get("rope_parameters") or {}
        head_dim = hidden // self.heads
        theta = float(rope.get("rope_theta", 10000.0))
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float)
                                                          / (head_dim // 2)), persistent=False)
        self.patch_embed = nn.Module()
        kernel = (self.temporal, self.patch, self.patch)
        self.patch_embed.proj = nn.Conv3d(self.channels, hidden, kernel, stride=kernel, bias=False, dtype=dtype)
        self.blocks = nn.ModuleList(VisionBlock(hidden, self.heads, cfg.get("intermediate_size", 3420),
                                                ACTIVATIONS[act], dtype) for _ in range(depth))
        self.merger = PatchMerger(hidden, self.merge, out, dtype)
        self.requires_grad_(False)

    def split_images(self, processed: Mapping[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
        grids = processed["image_grid_thw"]
        pixels = processed["pixel_values"].split(grids.prod(-1).tolist())
        return [{"pixel_values": p, "image_grid_thw": g[None]} for p, g in zip(pixels, grids)]

    def num_embeds(self, image: Mapping[str, torch.Tensor]) -> int:
        return int(image["image_grid_thw"].prod()) // (self.merge * self.merge)

    def forward(self, image: Mapping[str, torch.Tensor]) -> torch.Tensor:
        t, h, w = (int(x) for x in image["image_grid_thw"].reshape(-1).tolist())
        if h % self.merge or w % self.merge:
            raise ValueError(f"an image grid of {h}x{w} patches is not made of {self.merge}x{self.merge} groups")
        weight = self.patch_embed.proj.weight
        pixels = image["pixel_values"].to(weight.dtype)
        if pixels.shape[0] != t * h * w:
            raise ValueError(f"pixel_values has {pixels.shape[0]} patches; image_grid_thw says {t * h * w}")
        x = self.patch_embed.proj(pixels.view(-1, self.channels, self.temporal, self.patch, self.patch))
        x = x.view(t * h * w, -1)
        unit = self.merge * self.merge
        order, windows = window_order(t, h, w, self.merge, self.window)
        order = order.to(x.device)
        x = x.view(-1, unit, x.shape[-1])[order].view(t * h * w, -1)
        freqs = patch_rows_cols(t, h, w, self.merge).to(x.device)[..., None].float() * self.inv_freq
        freqs = freqs.flatten(1).view(-1, unit, freqs.shape[1] * freqs.shape[2])[order].flatten(0, 1)
        cos_sin = freqs.cos()[:, None], freqs.sin()[:, None]
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, [t * h * w] if i in self.full_blocks else windows)
        return self.merger(x)[torch.argsort(order)]

    def load_weights(self, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        load_named(self, tensors, "Qwen2.5-VL vision tower")
