"""SmolLM3: Llama's decoder where some layers use no position embedding at
all (NoPE: ``no_rope_layers[i] == 0``, by default every fourth layer)."""
from pagedbackend.models.decoder import CausalLM
from pagedbackend.models.llama import plain_rope
from pagedbackend.models.model_args import (ModelArgs, check_activation, common_fields, layer_types_of, refuse,
                                            windows_of)


class SmolLM3ForCausalLM(CausalLM):
    @classmethod
    def parse_config(cls, cfg: dict) -> ModelArgs:
        check_activation(cfg, ("silu",), "hidden_act")
        fields = common_fields(cfg, tie_word_embeddings=True)
        layers = fields["num_layers"]
        interval = cfg.get("no_rope_layer_interval", 4)
        uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        if len(uses_rope) != layers:
            raise refuse("no_rope_layers", len(uses_rope), f"needs one entry per layer ({layers})")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        default = ["sliding_attention" if window and not rope else "full_attention" for rope in uses_rope]
        bias = cfg.get("attention_bias", False)   # on q, k, v and o alike
        return ModelArgs(**fields, ropes=[plain_rope(cfg)], layer_ropes=[0 if rope else None for rope in uses_rope],
                         layer_windows=windows_of(layer_types_of(cfg, default), window),
                         attention_bias=bias, output_bias=bias, mlp_bias=cfg.get("mlp_bias", False))
