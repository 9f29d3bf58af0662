"""Rotary position embedding (rotate-half layout, as Hugging Face Llama stores q/k).

Supported ``rope_type`` values: ``default``, ``linear`` and ``llama3``.
``dynamic`` NTK scaling changes the frequencies with the batch's length, which
would invalidate keys already in the paged cache, so it is refused, as are
the other types (yarn, longrope, ...).
"""
import math
from typing import Optional, Tuple

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict) -> dict:
    """The RoPE settings of a config.json, old (``rope_theta`` + ``rope_scaling``)
    or transformers 5 (``rope_parameters``) style, as one dict with a ``rope_type``."""
    params = dict(hf_config.get("rope_scaling") or {})
    params.update(hf_config.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(params: dict, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """``inv_freq[i] = theta^(-2i/d)``, rescaled as ``params["rope_type"]`` says."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, params, max_position_embeddings)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict, max_position_embeddings: int) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, and the band in
    # between interpolated smoothly (Llama 3.1).
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_context = float(params.get("original_max_position_embeddings", max_position_embeddings))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


CosSin = Tuple[torch.Tensor, torch.Tensor]   # [num_tokens, 1, head_dim / 2] each


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; ``forward`` looks up a step's tokens once."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        # Computed in fp32, stored in the compute dtype: [max_positions, head_dim / 2] each.
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> CosSin:
        """cos and sin of each token's position, shaped to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: CosSin) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q``/``k`` ``[num_tokens, heads, head_dim]``."""
    cos, sin = cos_sin
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
