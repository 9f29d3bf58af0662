"""Smoothing before w8a8 (activations rounded to int8 per row).

One int8 scale per row of activations is set by the row's largest value, so a
few input channels that are always large leave the others only a few int8
steps. Smoothing moves part of each input channel's range into the weight
(SmoothQuant, Xiao et al., ICML 2023): ``x W^T = (x / s) (W diag(s))^T`` with
``s_j = max|x_j|^alpha / max_i |W_ij|^(1 - alpha)``. The division by ``s`` is
folded into what computes ``x``, so it costs nothing at run time:

- qkv and gate_up: the gain of the RMSNorm in front of them (``divide_gain_``);
- down: the rows of up (``silu(gate) * up`` is linear in up);
- o: the rows of v (attention's output is linear in v). A query head reads
  the v of its KV group, so the channels of the query heads sharing a KV
  head get one factor, from their largest input and weight;
- the LM head: the final norm, and a copy of the head of its own when the
  embedding is tied to it.

``max|x_j|`` is measured once at load, in float32, on a prefill of English
text that ships with every Python (``pydoc_data``'s topics): not the text
``loadtest.bench quant_quality`` scores.
"""
import logging
import pathlib
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from torch import nn

CALIBRATION_TOKENS = 512
ALPHA = 0.5
HEAD = "lm_head"

logger = logging.getLogger("pagedbackend")


@dataclass
class Calibration:
    """A float32 prefill that the runner runs for a scheme that measures
    activations: ``prefill(ids)`` runs the model on ``ids`` (at most
    ``max_tokens``, the room in its KV cache) and returns the hidden states,
    writing only KV blocks that no sequence holds yet."""
    model_path: pathlib.Path
    max_tokens: int
    prefill: Callable[[List[int]], torch.Tensor]


def smooth_with(model: nn.Module, calibration: Calibration) -> None:
    """Measure each projection's input channels on a prefill of the
    calibration text and fold the smoothing factors into the weights."""
    count = min(CALIBRATION_TOKENS, calibration.max_tokens)
    ids = calibration_token_ids(calibration.model_path, count) if count > 0 else []
    if not ids:
        logger.warning("pagedbackend: w8a8 without smoothing: the KV cache leaves no room "
                       "for a calibration prefill")
        return
    with torch.inference_mode():
        maxima = input_maxima(model, lambda: calibration.prefill(ids))
    with torch.inference_mode(False):
        smooth(model, maxima)


def calibration_token_ids(model_path: pathlib.Path, count: int) -> List[int]:
    """The first ``count`` token ids of the calibration text."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer   # the model folder's own tokenizer, as the engine loads it
    text = "\n\n".join(topics[name] for name in sorted(topics))
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [int(i) for i in ids[:count]]


def _projections(model: nn.Module) -> Dict[str, nn.Module]:
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    return {f"layers.{i}.{name}": layer.get_submodule(name)
            for i, layer in enumerate(model.layers) for name in names}


def input_maxima(model: nn.Module, run_prefill: Callable[[], torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``max |x_j|`` over the rows that reach each projection (and the LM head,
    under ``HEAD``) while ``run_prefill()`` runs the model; it returns the
    hidden states, whose final norm is the LM head's input."""
    maxima: Dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        maxima[name] = torch.maximum(maxima[name], seen) if name in maxima else seen

    hooks = [module.register_forward_pre_hook(lambda _, args, name=name: record(name, args[0]))
             for name, module in _projections(model).items()]
    try:
        hidden = run_prefill()
        record(HEAD, model.norm(hidden))
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def _factors(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    return (x_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def smooth(model: nn.Module, maxima: Dict[str, torch.Tensor], alpha: float = ALPHA) -> None:
    """Fold the smoothing factors into a float model's weights (before it is
    quantised); the model computes the same function up to float rounding."""
    args = model.args
    group = args.num_heads // args.num_kv_heads
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for norm, linear, name in ((layer.input_layernorm, attn.qkv_proj, "self_attn.qkv_proj"),
                                   (layer.pre_mlp_norm, mlp.gate_up_proj, "mlp.gate_up_proj")):
            s = _factors(maxima[f"layers.{i}.{name}"], linear.weight.abs().amax(0).float(), alpha)
            norm.divide_gain_(s)
            linear.weight.mul_(s.to(linear.weight.dtype))

        # down: divide the rows of up (the second half of gate_up)
        down, gate_up = mlp.down_proj, mlp.gate_up_proj
        s = _factors(maxima[f"layers.{i}.mlp.down_proj"], down.weight.abs().amax(0).float(), alpha)
        half = gate_up.weight.shape[0] // 2
        gate_up.weight[half:].div_(s.to(gate_up.weight.dtype)[:, None])
        if gate_up.bias is not None:
            gate_up.bias[half:].div_(s.to(gate_up.bias.dtype))
        down.weight.mul_(s.to(down.weight.dtype))

        # o: divide the rows of v, one factor per KV head's channel
        o, qkv, d = attn.o_proj, attn.qkv_proj, args.head_dim
        kv_heads = attn.num_kv_heads
        x_max = maxima[f"layers.{i}.self_attn.o_proj"].view(kv_heads, group, d).amax(1)
        w_max = o.weight.abs().amax(0).float().view(kv_heads, group, d).amax(1)
        s = _factors(x_max, w_max, alpha)                             # [kv_heads, head_dim]
        v_start = (attn.num_heads + kv_heads) * d
        v_rows = slice(v_start, v_start + kv_heads * d)
        qkv.weight[v_rows].div_(s.reshape(-1, 1).to(qkv.weight.dtype))
        if qkv.bias is not None:
            qkv.bias[v_rows].div_(s.reshape(-1).to(qkv.bias.dtype))
        o.weight.mul_(s[:, None, :].expand(kv_heads, group, d).reshape(-1).to(o.weight.dtype))

    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    s = _factors(maxima[HEAD], head.abs().amax(0).float(), alpha)
    model.norm.divide_gain_(s)
    if model.lm_head is None:   # a tied head: the embedding keeps the loaded weight
        model.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, dtype=head.dtype,
                                  device=head.device)
        model.lm_head.weight.requires_grad_(False)
        model.lm_head.weight.copy_(head)
    model.lm_head.weight.mul_(s.to(head.dtype))
