"""Multi-LoRA serving: PEFT adapters beside the base model, mixed in one step.

- ``request``: ``LoRARequest`` (vLLM's), the errors an adapter gets;
- ``peft_adapter``: reading and checking a PEFT adapter folder;
- ``pool``: the device pool's rank pages and LRU eviction;
- ``manager``: the engine's adapters (registry, host tier, admission, the
  step's page-ins, prefix-cache keys);
- ``layers``: the adapted projections' matmuls and the pool tensors;
- ``punica``: the step's token-to-adapter mapping and the op every adapted
  projection calls (kernels in ``kernels/lora.py``).

Layer: above ``models`` and ``quant`` (it wraps a loaded model's projections),
below ``worker`` (the runner installs it) and ``engine`` (which holds the
manager). Importing this package loads only ``request`` (no torch).
"""
from .request import LoRAError, LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
