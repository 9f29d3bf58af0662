"""Model implementations: our own torch forward passes over the paged KV cache.

Every supported Hugging Face ``model_type`` maps to the class that serves it.
Mistral and Qwen2 are Llama-shaped (Qwen2 adds q/k/v biases); their
sliding-window layers attend to their window (``llama.sliding_windows``) at
any context length. The classes (and
torch with them) load on first use, so checking a model folder stays cheap.
"""
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})

__all__ = ["LlamaArgs", "LlamaForCausalLM", "MODEL_CLASSES", "SUPPORTED_MODEL_TYPES"]


def __getattr__(name):
    if name in ("LlamaArgs", "LlamaForCausalLM"):
        from pagedbackend.models import llama
        return getattr(llama, name)
    if name == "MODEL_CLASSES":
        from pagedbackend.models.llama import LlamaForCausalLM
        return dict.fromkeys(sorted(SUPPORTED_MODEL_TYPES), LlamaForCausalLM)
    raise AttributeError(f"module 'pagedbackend.models' has no attribute {name!r}")
