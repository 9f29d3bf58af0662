"""Multimodal RoPE (M-RoPE, Qwen2-VL and Qwen2.5-VL): three position streams
(temporal, height, width) instead of one, and the rotary frequencies split
in sections, each section turned by one stream.

Positions of a prompt with images (transformers' ``get_rope_index``): a text
token's three streams are equal, counting on from the previous token; an
image of ``t x h x w`` merged patches (its placeholder span, row-major) starts
at the position ``s`` that follows the text before it, and its token
``(i, j, k)`` sits at ``(s + i, s + j, s + k)``; the text after it continues
from ``s + max(h, w)`` (an image is never temporal beyond one frame group, so
``t`` is 1). A position ``p`` past the last image has all three streams at
``p + delta``, ``delta`` the sum over the images of ``max(h, w) - h * w``:
what decoding steps use. Positions only depend on the sequence's own
images, so a chunk that starts anywhere (chunked prefill, a prefix-cache
hit, a decode) computes its own from the images' spans and grids.
"""
from typing import Iterable, List, Sequence, Tuple

import torch

from pagedbackend.models.model_args import refuse
from pagedbackend.models.rotary import CosSin, RotaryEmbedding

STREAMS = 3   # temporal, height, width


def image_grid(item, merge: int) -> Tuple[int, int, int]:
    """``(t, h, w)`` of an image item in merged patches (its ``image_grid_thw`` is in patches)."""
    t, h, w = (int(x) for x in item.data["image_grid_thw"].reshape(-1).tolist())
    return t, h // merge, w // merge


def rope_delta(items: Iterable, merge: int) -> int:
    """How far M-RoPE positions after the images lag behind token positions."""
    delta = 0
    for item in items:
        t, h, w = image_grid(item, merge)
        delta += max(h, w) - t * h * w
    return delta


def sequence_positions(items: Sequence, start: int, end: int, merge: int) -> torch.Tensor:
    """int64 ``[3, end - start]``: the M-RoPE positions of a sequence's
    tokens ``start..end-1``, given its image items (``offset``, ``length``,
    ``image_grid_thw``) in prompt order."""
    out = torch.arange(start, end, dtype=torch.long).expand(STREAMS, -1).clone()
    delta = 0
    for item in sorted(items, key=lambda i: i.offset):
        t, h, w = image_grid(item, merge)
        if t * h * w != item.length:
            raise ValueError(f"an image of {t}x{h}x{w} merged patches has {item.length} placeholders")
        first = item.offset + delta   # the image's starting position in every stream
        lo, hi = max(start, item.offset), min(end, item.end)
        if lo < hi:
            index = torch.arange(lo - item.offset, hi - item.offset)
            grid = torch.stack([index // (h * w), index // w % h, index % w])
            out[:, lo - start:hi - start] = grid + first
        delta += max(h, w) - t * h * w
        after = max(item.end, start)
        if after < end:
            out[:, after - start:] = torch.arange(after, end).expand(STREAMS, -1) + delta
    return out


def step_positions(entries: Sequence, merge: int, positions: torch.Tensor) -> torch.Tensor:
    """int64 ``[3, tokens]`` for a step's entries (``start_pos``,
    ``token_ids``, ``mm_items``: the sequence's images) from their token
    positions ``[tokens]``: a sequence without images keeps them in all
    three streams, one past its images (a decode) adds its delta, and only a
    chunk that reaches into an image's span computes its streams in full."""
    out = positions.expand(STREAMS, -1).clone()
    row = 0
    for entry in entries:
        n, items = len(entry.token_ids), getattr(entry, "mm_items", ())
        if items:
            start = entry.start_pos
            if start >= max(item.end for item in items):
                out[:, row:row + n] += rope_delta(items, merge)
            else:
                out[:, row:row + n] = sequence_positions(items, start, start + n, merge)
        row += n
    return out


class MRotaryEmbedding(RotaryEmbedding):
    """cos/sin of M-RoPE: positions ``[3, N]``; frequency ``f`` of each head
    half takes the stream of its section (``mrope_section``, e.g. [16, 24,
    24]: temporal, height, width). One-stream positions ``[N]`` (a text-only
    warm-up) turn every section alike."""

    def __init__(self, params: dict, head_dim: int, *args, **kwargs):
        super().__init__(params, head_dim, *args, **kwargs)
        sections = list(params.get("mrope_section") or ())
        if len(sections) != STREAMS or sum(sections) != self.rotary_dim // 2:
            raise refuse("rope_parameters.mrope_section", sections,
                         f"needs three sections summing to {self.rotary_dim // 2} (rotated dimensions / 2)")
        stream = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sections)])
        self.register_buffer("stream", stream, persistent=False)

    def forward(self, positions: torch.Tensor) -> CosSin:
        if positions.dim() == 1:
            return super().forward(positions)
        columns = torch.arange(self.stream.numel(), device=positions.device)
        picked = positions[self.stream]   # [half, N]: each frequency's stream
        cos, sin = self.cos[picked, columns[:, None]], self.sin[picked, columns[:, None]]
        return cos.t().unsqueeze(1), sin.t().unsqueeze(1)
