"""Phi-3 and Phi-4-mini (``phi3``): Llama's decoder with q/k/v and gate/up
stored fused in the checkpoint (``qkv_proj``, ``gate_up_proj``: split here
into the shards each rank loads), a partial rotary dimension
(``partial_rotary_factor``) and LongRoPE (``rotary.py`` says how its short
and long factors are chosen)."""
from typing import Iterable, Tuple

import torch

from pagedbackend.models.decoder import CausalLM
from pagedbackend.models.model_args import ModelArgs, check_activation, common_fields
from pagedbackend.models.rotary import rope_parameters


class Phi3ForCausalLM(CausalLM):
    MERGED = (("self_attn.qkv_proj", ("qkv_proj",)), ("self_attn.o_proj", ("o_proj",)),
              ("mlp.gate_up_proj", ("gate_up_proj",)), ("mlp.down_proj", ("down_proj",)))

    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        check_activation(cfg, ("silu",), "hidden_act")
        fields = common_fields(cfg, tie_word_embeddings=False, rms_norm_eps=1e-5)
        rope = rope_parameters(cfg)
        rope.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if rope["rope_type"] in ("su", "yarn"):   # Phi-3's older names for its LongRoPE
            rope["rope_type"] = "longrope"
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("original_max_position_embeddings", fields["max_position_embeddings"]))
        window = cfg.get("sliding_window")   # HF applies it to every layer
        return ModelArgs(**fields, ropes=[rope], layer_ropes=[0] * fields["num_layers"],
                         layer_windows=[window] * fields["num_layers"])

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[Tuple[str, torch.Tensor]]:
        name = name.removeprefix("model.")
        prefix, _, leaf = name.rpartition(".qkv_proj.")
        if prefix:
            args = self.args
            sizes = [args.num_heads * args.head_dim] + [args.num_kv_heads * args.head_dim] * 2
            yield from zip((f"{prefix}.{p}.{leaf}" for p in ("q_proj", "k_proj", "v_proj")),
                           tensor.split(sizes, dim=0))
            return
        prefix, _, leaf = name.rpartition(".gate_up_proj.")
        if prefix:
            yield from zip((f"{prefix}.gate_proj.{leaf}", f"{prefix}.up_proj.{leaf}"), tensor.chunk(2, dim=0))
            return
        yield name, tensor
