"""MXFP4 expert weights, as gpt-oss checkpoints publish them.

A weight ``W`` ``[..., rows, K]`` is stored as ``W_blocks`` uint8 ``[...,
rows, K / 32, 16]`` (two e2m1 values per byte, the low nibble first) and
``W_scales`` uint8 ``[..., rows, K / 32]`` (one e8m0 exponent per block of
32 values, biased by 127): ``w = e2m1 * 2^(scale - 127)``. gpt-oss stores
its experts' ``gate_up_proj`` and ``down_proj`` so, in the orientation of a
linear weight (output rows, input columns); Hugging Face's model holds them
transposed, and so does ``dequantize_checkpoint``'s output.

No kernel here multiplies MXFP4 directly: the experts are dequantised at
load to the model's dtype. That costs memory: 4.25 bits per weight become 32
(float32, 7.5x) or 16 (bfloat16, 3.8x); gpt-oss-20b's experts, about 10 GB
as published, take about 38 GB in bfloat16 (docs/moe.md).
"""
from typing import Dict, Iterable, Iterator, Tuple

import torch

# e2m1 codes 0..15: sign bit, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32           # values per shared exponent
SCALE_BIAS = 127
BITS_PER_WEIGHT = 4 + 8 / BLOCK


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., G, 16]`` blocks and ``[..., G]`` scales -> ``[..., G * 32]`` values in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)   # [..., G, 32]: low nibble, high nibble, ...
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` (K a multiple of 32) -> MXFP4 ``(blocks, scales)``: each
    block's exponent is the smallest that fits its largest magnitude in e2m1's
    range (6), each value rounded to the nearest e2m1 value."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs a last dimension divisible by {BLOCK}; got {weight.shape[-1]}")
    groups = weight.float().unflatten(-1, (-1, BLOCK))
    amax = groups.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax.clamp(min=2.0 ** -126) / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    code = code + 8 * (scaled < 0)   # -0.0 for a negative value that rounds to zero
    code = code.to(torch.uint8).unflatten(-1, (BLOCK // 2, 2))
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks, (exponent.to(torch.int32) + SCALE_BIAS).to(torch.uint8)


def dequantize_checkpoint(tensors: Iterable[Tuple[str, torch.Tensor]],
                          dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every ``X_blocks`` / ``X_scales`` pair
    replaced by ``X`` in ``dtype``, transposed as Hugging Face's model holds it
    (``[E, K, rows]``); other tensors pass through. A pair is dequantised as
    soon as both halves have been read, so one layer's worth is in memory at a time."""
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        for part in ("blocks", "scales"):
            if name.endswith(f"_{part}"):
                base = name[: -len(part) - 1]
                halves = pending.setdefault(base, {})
                halves[part] = tensor
                if len(halves) == 2:
                    del pending[base]
                    yield base, dequantize(halves["blocks"], halves["scales"], dtype).transpose(-1, -2)
                break
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"MXFP4 checkpoint lacks the blocks or scales of {sorted(pending)[:3]}")
