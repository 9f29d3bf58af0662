"""Test helper: random PEFT LoRA adapters for a model folder, and Hugging
Face PEFT's greedy tokens with them (the reference the engine must match)."""
from typing import Dict, List, Optional, Sequence

import torch

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(base_dir, out_dir, r: int, lora_alpha: float, targets=PROJECTIONS, seed: int = 0,
                        std: float = 0.15, **config) -> str:
    """A LoRA adapter of ``base_dir`` saved by PEFT into ``out_dir``, made with
    ``init_lora_weights=False`` (so B is not zero) and its A and B redrawn
    from N(0, std) with ``seed``, wide enough to change greedy tokens.
    ``targets``: module names or a regular expression (PEFT's ``target_modules``);
    ``config``: more LoraConfig fields (``use_rslora``, ``rank_pattern``, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets if isinstance(targets, str) else list(targets),
                                                  init_lora_weights=False, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir)
    return str(out_dir)


class PeftReference:
    """One ``PeftModel`` holding every adapter; greedy tokens per prompt with
    the adapter it names (None: the base model), fp32, one prompt at a time."""

    def __init__(self, base_dir, adapters: Dict[str, str]):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)
        self.model.eval()

    def greedy(self, prompts: Sequence[List[int]], names: Sequence[Optional[str]],
               max_new_tokens: int) -> List[List[int]]:
        return [self._one(prompt, name, max_new_tokens) for prompt, name in zip(prompts, names)]

    @torch.no_grad()
    def _one(self, prompt: List[int], name: Optional[str], max_new_tokens: int) -> List[int]:
        """Up to ``max_new_tokens``, ending after the first EOS (as the engine stops)."""
        ids = torch.tensor([prompt])
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      do_sample=False)
        if name is None:
            with self.model.disable_adapter():
                out = self.model.generate(**kwargs)
        else:
            self.model.set_adapter(name)
            out = self.model.generate(**kwargs)
        tokens = out[0, len(prompt):].tolist()
        eos = self.model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        ends = [i for i, t in enumerate(tokens) if t in eos]
        return tokens[:ends[0] + 1] if ends else tokens
