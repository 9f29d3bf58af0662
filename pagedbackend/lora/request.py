"""``LoRARequest``: which adapter a request runs with, in vLLM's words."""
from dataclasses import dataclass
from typing import Optional

from ..errors import InvalidRequestError


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served: a folder that is not a PEFT LoRA
    adapter, a kind of adapter or a rank that is refused, an unknown name."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: a PEFT
    adapter folder (``adapter_config.json``, ``adapter_model.safetensors``),
    its name and a positive integer id, both unique among the engine's
    adapters. ``base_model_name`` (vLLM's) names the parent in listings."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise LoRAError(f"lora_path must be a string (a folder), got {self.lora_path!r}")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
