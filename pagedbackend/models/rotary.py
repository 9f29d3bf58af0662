"""Rotary position embedding (rotate-half layout, as Hugging Face stores q/k).

A config's RoPE settings are read per layer type (``rope_parameters``):
transformers 5 nests them by layer type when layers differ (Gemma 3:
``{"full_attention": {...}, "sliding_attention": {...}}``), older configs give
``rope_theta`` and ``rope_scaling``. Each setting becomes one cos/sin table
over the served positions, looked up once per step and shared by the layers
that use it; a layer without RoPE (NoPE) uses none.

Types: ``default``, ``linear``, ``llama3``, ``yarn`` (its attention factor
scales cos and sin, as in HF), ``longrope`` and ``dynamic``; a
``partial_rotary_factor`` rotates only the first dimensions of each head.
Keys in a paged cache keep the rotation they were written with, so the two
length-dependent types are fixed per position here:

- ``longrope``: HF switches between the short and the long factors with the
  length of each forward call. We use the long factors for every position
  when the served length (``max_model_len``) exceeds
  ``original_max_position_embeddings``, else the short ones (vLLM's rule):
  equal to HF for every sequence when serving at most the original length,
  and for every prompt longer than it otherwise.
- ``dynamic`` (NTK): HF re-bases the frequencies to the length of each
  forward call once it passes ``max_position_embeddings``. Position ``p`` is
  rotated here with the base of length ``max(p + 1, max_position_embeddings)``:
  what HF's ``generate`` does for every token of a prompt no longer than
  ``max_position_embeddings`` and every token generated after it (a longer
  prompt is rotated by HF with its own length as a whole).
"""
import math
from typing import Optional, Tuple

import torch
from torch import nn

from pagedbackend.models.model_args import SUPPORTED_ROPE_TYPES, refuse


def rope_parameters(cfg: dict, layer_type: Optional[str] = None,
                    default_theta: float = 10000.0) -> Optional[dict]:
    """The RoPE settings of layers of ``layer_type`` as one dict with a
    ``rope_type`` and a ``rope_theta``; None when those layers have no RoPE
    (a nested entry saved as null). A flat setting applies to every layer type."""
    given = cfg.get("rope_parameters")
    nested = isinstance(given, dict) and any(key in (cfg.get("layer_types") or ()) for key in given)
    if nested:
        if layer_type not in given:
            raise refuse("rope_parameters", sorted(given), f"no RoPE settings for layer type {layer_type!r}")
        if given[layer_type] is None:
            return None
        params = dict(given[layer_type])
    else:
        params = dict(cfg.get("rope_scaling") or {})
        params.update(given or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if not nested and cfg.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return params


def rotary_dim(params: dict, head_dim: int) -> int:
    """How many dimensions of each head are rotated (``partial_rotary_factor``)."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0)))


def frequencies(params: dict, dim: int, max_position_embeddings: int,
                max_positions: int) -> Tuple[torch.Tensor, float]:
    """``(inv_freq, attention_factor)`` for ``dim`` rotated dimensions:
    ``inv_freq`` is ``[dim / 2]``, or ``[max_positions, dim / 2]`` when it
    depends on the position (``dynamic``); cos and sin are scaled by the factor."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise refuse("rope_parameters.rope_type", rope_type,
                     f"supported RoPE types: {', '.join(SUPPORTED_ROPE_TYPES)}")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params, max_position_embeddings), 1.0
    if rope_type == "yarn":
        return _yarn(params, dim, base, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(params, exponents, base, max_position_embeddings, max_positions)
    if rope_type == "dynamic":
        return _dynamic_ntk(params, dim, base, max_position_embeddings, max_positions), 1.0
    return inv_freq, 1.0


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, dim: int, base: float, max_position_embeddings: int) -> Tuple[torch.Tensor, float]:
    # YaRN (Peng et al., 2023): frequencies that turn fewer than beta_slow times over
    # the original context are interpolated by `factor`, those turning more than
    # beta_fast times are kept, with a linear ramp between; cos/sin get mscale.
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp   # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def _longrope(params: dict, exponents: torch.Tensor, base: float, max_position_embeddings: int,
              max_positions: int) -> Tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if max_positions > original else "short_factor"
    ext = torch.tensor(params[key], dtype=torch.float32)
    if ext.shape != exponents.shape:
        raise refuse(f"rope_parameters.{key}", len(params[key]),
                     f"needs {exponents.numel()} entries (rotated dimensions / 2)")
    return 1.0 / (ext * base ** exponents), float(attention_factor)


def _dynamic_ntk(params: dict, dim: int, base: float, max_position_embeddings: int,
                 max_positions: int) -> torch.Tensor:
    # Row p: the NTK base of a length max(p + 1, max_position_embeddings). Up to
    # max_position_embeddings it is the base HF computes at load, in Python floats;
    # past it, the float32 arithmetic HF uses when it grows the base during
    # generation. HF raises one 0-d tensor to the power (rounded correctly); torch's
    # vectorised float32 pow over many rows rounds some last bits differently, so
    # that power is taken in float64 and rounded to float32.
    factor = float(params["factor"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    first = base * ((factor * max_position_embeddings / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    lengths = torch.arange(1, max_positions + 1, dtype=torch.int64)
    stretch = (factor * lengths / max_position_embeddings) - (factor - 1)
    bases = base * (stretch.double() ** (dim / (dim - 2))).float()
    grown = 1.0 / (bases[:, None] ** exponents[None, :])
    return torch.where((lengths > max_position_embeddings)[:, None], grown, 1.0 / (first ** exponents))


CosSin = Tuple[torch.Tensor, torch.Tensor]   # [num_tokens, 1, rotary_dim / 2] each


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every served position; ``forward`` looks up a step's tokens once."""

    def __init__(self, params: dict, head_dim: int, max_position_embeddings: int, max_positions: int,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.rotary_dim = rotary_dim(params, head_dim)
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise refuse("partial_rotary_factor", params.get("partial_rotary_factor"),
                         f"rotates {self.rotary_dim} of {head_dim} dimensions (needs an even count > 0)")
        inv_freq, attention_factor = frequencies(params, self.rotary_dim, max_position_embeddings,
                                                 max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()
        # Computed in fp32, stored in the compute dtype: [max_positions, rotary_dim / 2] each.
        self.register_buffer("cos", (freqs.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_factor).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> CosSin:
        """cos and sin of each token's position, shaped to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: CosSin) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q``/``k`` ``[num_tokens, heads, head_dim]``: the first
    ``2 * cos.shape[-1]`` dimensions of each head rotate, the rest pass."""
    cos, sin = cos_sin
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
