"""Tiny random checkpoints of every served model family, saved by
transformers itself, for the family tests and ``loadtest.bench models``.

Each family gets a small config of its own kind (a few layers, hidden 64-128)
that exercises what makes it differ: Qwen3's head_dim apart from the hidden
size, Gemma 3's sliding and full layers with their own RoPE, Phi-3's partial
rotary dims and fused tensors, SmolLM3's NoPE layers, Granite's multipliers,
Mistral 3's and Gemma 3's multimodal wrappers (a one-layer vision tower that
Mistral 3 skips and Gemma 3 loads). Weights are seeded and drawn wider than HF's init so that
greedy decoding does not sit on near-ties; the tokenizer is SmolLM2's.
"""
import pathlib
import shutil

import torch

from loadtest.tiny_model import TOKENIZER_FILES

VOCAB = 49152   # SmolLM2's tokenizer
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)
# Sliding windows of 16 positions, so that test sequences run past three windows.
WINDOW = 16

# name -> (model_type, config fields): one checkpoint per family, and the
# RoPE variants that need a checkpoint of their own.
CASES = {
    "qwen3": ("qwen3", dict(TEXT, head_dim=32, tie_word_embeddings=True, use_sliding_window=True,
                            sliding_window=WINDOW, max_window_layers=1,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                             "original_max_position_embeddings": 128})),
    "gemma3_text": ("gemma3_text", dict(
        TEXT, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}})),
    "gemma3": ("gemma3", dict(
        text_config=dict(TEXT, model_type="gemma3_text", head_dim=16, sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4)),
    "gemma2": ("gemma2", dict(TEXT, head_dim=16, query_pre_attn_scalar=32, sliding_window=WINDOW,
                              attn_logit_softcapping=None, final_logit_softcapping=5.0)),
    "phi3": ("phi3", dict(TEXT, hidden_size=128, partial_rotary_factor=0.5, tie_word_embeddings=False,
                          sliding_window=WINDOW)),
    # LongRoPE: short factors up to 32 positions, long ones past them.
    "phi3-longrope": ("phi3", dict(
        TEXT, hidden_size=128, max_position_embeddings=128, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0 + 0.25 * i for i in range(8)],
                         "long_factor": [2.0 + 1.5 * i for i in range(8)]})),
    "smollm3": ("smollm3", dict(TEXT, num_hidden_layers=4, no_rope_layer_interval=2, tie_word_embeddings=True,
                                use_sliding_window=True, sliding_window=WINDOW)),
    "granite": ("granite", dict(TEXT, embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2,
                                logits_scaling=2.5, tie_word_embeddings=False)),
    "mistral3": ("mistral3", dict(
        text_config=dict(TEXT, model_type="mistral", head_dim=16, tie_word_embeddings=False,
                         sliding_window=WINDOW),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=16, image_size=28, patch_size=14),
        tie_word_embeddings=False)),
    # Ministral 3's text decoder: YaRN and the position-scaled queries.
    "ministral3": ("ministral3", dict(
        TEXT, head_dim=16, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                         "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.5,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
    # Dynamic NTK: sequences that cross max_position_embeddings (32) while generating.
    "llama-dynamic": ("llama", dict(TEXT, max_position_embeddings=32,
                                    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                     "factor": 2.0})),
}

# Norms that multiply by (1 + w): their weights are drawn around 0, not 1.
OFFSET_NORMS = ("gemma",)


def build_tiny_family(path, case: str, seed: int = 0, std: float = 0.15, shape=None,
                      **overrides) -> pathlib.Path:
    """Write config.json, model.safetensors and SmolLM2's tokenizer of
    ``case`` (a key of ``CASES``) into ``path``; ``overrides`` replace config
    fields, ``shape`` those of the text decoder (``hidden_size``,
    ``num_hidden_layers``, ...: its layer types repeat to the new depth)."""
    from transformers import AutoConfig

    from pagedbackend.models.default_model import resolve_model_path

    path = pathlib.Path(path)
    model_type, settings = CASES[case]
    settings = {**settings, **overrides}
    if shape:
        text = dict(settings.get("text_config", settings), **shape)
        if "layer_types" in text:
            text["layer_types"] = [text["layer_types"][i % len(text["layer_types"])]
                                   for i in range(text["num_hidden_layers"])]
        settings = {**settings, "text_config": text} if "text_config" in settings else text
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = hf_model_class(model_type).from_config(config, dtype=torch.float32)
    offset = model_type.startswith(OFFSET_NORMS)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_((0.0 if offset else 1.0) + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    source = resolve_model_path("default")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    return path


def hf_model_class(model_type: str):
    """The Auto class that builds ``model_type`` with an LM head."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if model_type == "mistral3" else AutoModelForCausalLM


def load_hf(path, case: str):
    """The saved checkpoint of ``case`` in transformers, fp32, for reference outputs."""
    return hf_model_class(CASES[case][0]).from_pretrained(path, dtype=torch.float32).eval()
