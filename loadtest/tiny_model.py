"""A tiny random Llama-family model folder, for tests and scheduling benchmarks.

Weights are seeded and drawn wider than Hugging Face's default init, so that
greedy decoding does not sit on near-ties or collapse into one repeated token.
The tokenizer is copied from the prepared default model (SmolLM2's).
"""
import pathlib
import shutil

import torch

TINY_DEFAULTS = dict(
    model_type="llama",
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_llama(path, seed: int = 0, std: float = 0.1, **overrides) -> pathlib.Path:
    """Write config.json, model.safetensors and the tokenizer into ``path``.

    ``overrides`` replace config fields (``model_type="qwen2"``,
    ``tie_word_embeddings=False``, ``rope_parameters={...}``, ...).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedbackend.models.default_model import resolve_model_path

    path = pathlib.Path(path)
    settings = {**TINY_DEFAULTS, **overrides}
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    source = resolve_model_path("default")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    return path
