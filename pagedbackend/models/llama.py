"""Llama, Mistral and Qwen2: the plain decoder of ``decoder.py``.

embedding -> N x [RMSNorm -> GQA attention (RoPE, paged kernels) -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (tied or not).

Tensor parallelism: q/k/v and gate/up are column-parallel (heads and
intermediate features split across ranks), o_proj and down_proj row-parallel
with one reduction each. A rank holds whole KV heads and the query heads that
read them (``linear.kv_heads_of_rank``). The embedding and LM head stay
replicated; only rank 0 computes logits.
"""
from typing import List, Optional

from pagedbackend.models.decoder import CausalLM
from pagedbackend.models.model_args import (ModelArgs, check_activation, common_fields, layer_types_of, refuse,
                                            windows_of)
from pagedbackend.models.rotary import rope_parameters


def sliding_windows(cfg: dict) -> List[Optional[int]]:
    """Per layer, the sliding window Hugging Face applies (None: full
    attention): Mistral's ``sliding_window`` on every layer, Qwen2's (and
    Qwen3's) only with ``use_sliding_window``, on the layers ``layer_types``
    names ``sliding_attention`` (by default those from ``max_window_layers``
    on); Llama has none."""
    model_type, layers = cfg.get("model_type"), cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    qwen = model_type in ("qwen2", "qwen3")
    if model_type == "llama" or window is None or (qwen and not cfg.get("use_sliding_window")):
        return [None] * layers
    if qwen:
        first = cfg.get("max_window_layers", 28)
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        return windows_of(layer_types_of(cfg, default), window)
    return windows_of(["sliding_attention"] * layers, window)


def plain_rope(cfg: dict) -> dict:
    """The one RoPE setting of a family whose HF code rotates whole heads:
    its default RoPE ignores ``partial_rotary_factor``, as HF's does."""
    rope = rope_parameters(cfg)
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        if rope["rope_type"] != "default":
            raise refuse("partial_rotary_factor", partial, f"the {cfg.get('model_type')} family rotates "
                         "whole heads")
        rope.pop("partial_rotary_factor")
    return rope


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral and Qwen2 (q/k/v biases)."""

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        model_type = cfg.get("model_type")
        check_activation(cfg, ("silu",), "hidden_act")
        fields = common_fields(cfg, tie_word_embeddings=False)
        # Llama declares its biases in attention_bias (o_proj too); Qwen2 has q/k/v
        # biases always; Mistral none.
        llama = model_type == "llama"
        return ModelArgs(**fields, ropes=[plain_rope(cfg)], layer_ropes=[0] * fields["num_layers"],
                         layer_windows=sliding_windows(cfg),
                         attention_bias=cfg.get("attention_bias", False) if llama else model_type == "qwen2",
                         output_bias=llama and cfg.get("attention_bias", False),
                         mlp_bias=llama and cfg.get("mlp_bias", False))
