"""Model implementations: our own torch forward passes over the paged KV cache.

Every supported Hugging Face ``model_type`` maps to the class that serves it.
Mistral and Qwen2 are Llama-shaped (Qwen2 adds q/k/v biases); a sliding-window
model is served up to its window length (see ``LlamaArgs``).
"""
from pagedbackend.models.llama import LlamaArgs, LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}
SUPPORTED_MODEL_TYPES = frozenset(MODEL_CLASSES)

__all__ = ["LlamaArgs", "LlamaForCausalLM", "MODEL_CLASSES", "SUPPORTED_MODEL_TYPES"]
