"""Model implementations: our own torch forward passes over the paged KV cache."""
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
