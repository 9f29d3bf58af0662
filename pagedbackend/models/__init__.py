"""Model implementations: our own torch forward passes over the paged KV cache.

A registry maps every served Hugging Face ``model_type`` to the class that
serves it, one module per family sharing ``decoder.py`` and ``layers.py``.
The classes (and torch with them) load on first use, so checking a model
folder stays cheap. A family's ``parse_config`` refuses, by field name, what
it does not serve (``UnsupportedModelError``), and reads each layer's sliding
window, which its attention honours at any context length.
"""
import importlib

from pagedbackend.pooling_choice import ENCODER_MODEL_TYPES
from pagedbackend.models.model_args import ModelArgs, UnsupportedModelError

# model_type -> "module:class" under pagedbackend.models.
FAMILIES = {
    "llama": "llama:LlamaForCausalLM",
    "mistral": "llama:LlamaForCausalLM",
    "idefics3": "idefics3:Idefics3ForConditionalGeneration",
    "qwen2": "llama:LlamaForCausalLM",
    "qwen2_5_vl": "qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "qwen3": "qwen3:Qwen3ForCausalLM",
    "gemma3_text": "gemma3:Gemma3ForCausalLM",
    "gemma3": "gemma3:Gemma3ForConditionalGeneration",
    "gemma2": "gemma3:Gemma2ForCausalLM",
    "phi3": "phi3:Phi3ForCausalLM",
    "mistral3": "mistral3:Mistral3ForConditionalGeneration",
    "ministral3": "mistral3:Ministral3ForCausalLM",
    "smollm3": "smollm3:SmolLM3ForCausalLM",
    "granite": "granite:GraniteForCausalLM",
    "qwen3_moe": "qwen3_moe:Qwen3MoeForCausalLM",
    "mixtral": "mixtral:MixtralForCausalLM",
    "gpt_oss": "gpt_oss:GptOssForCausalLM",
    "llava": "llava:LlavaForConditionalGeneration",
}
# Encoders (models.bert): served by their own executor, for embeddings and scores only.
SUPPORTED_MODEL_TYPES = frozenset(FAMILIES) | ENCODER_MODEL_TYPES

__all__ = ["ENCODER_MODEL_TYPES", "FAMILIES", "ModelArgs", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "model_args",
           "model_class"]


def model_class(model_type: str) -> type:
    """The class serving ``model_type`` (a ``decoder.CausalLM``)."""
    if model_type not in FAMILIES:
        raise UnsupportedModelError(f"unsupported model_type {model_type!r}; served model types: "
                                    f"{', '.join(sorted(FAMILIES))}")
    module, name = FAMILIES[model_type].split(":")
    return getattr(importlib.import_module(f"pagedbackend.models.{module}"), name)


def model_args(hf_config: dict) -> ModelArgs:
    """The architecture of a config.json, read by its family (which refuses
    any field it does not serve, by name)."""
    args = model_class(hf_config.get("model_type")).parse_config(hf_config)
    architectures = hf_config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        # A decoder with a score head on its last token (a converted reranker such
        # as Qwen3-Reranker-seq-cls): scores only, no LM head.
        labels = len(hf_config.get("id2label") or {}) or int(hf_config.get("num_labels", 1))
        if labels != 1:
            raise UnsupportedModelError(f"num_labels {labels}: a sequence-classification decoder with one "
                                        "label (a reranker's score) is served")
        args.num_labels, args.tie_word_embeddings = 1, True
    return args
