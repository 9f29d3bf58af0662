"""Reading PEFT adapter folders: what is loaded (per-module A and B with the
scaling folded in, the rank, a content hash) and what is refused at load,
naming the reason: DoRA, modules_to_save, the embedding and the LM head,
ranks above max_lora_rank, modules or shapes the model does not have,
pickled weights, a folder that is no adapter."""
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from pagedbackend.lora import LoRAError
from pagedbackend.lora.peft_adapter import load_peft_adapter
from peft_reference import save_random_adapter


@pytest.fixture(scope="module")
def shapes(tiny_model_dir):
    """The tiny model's projections by Hugging Face module name: (in, out)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in name}


def test_weights_carry_the_scaling_of_each_module(tiny_model_dir, shapes, tmp_path):
    path = save_random_adapter(tiny_model_dir, tmp_path / "a", r=4, lora_alpha=8, seed=1, use_rslora=True,
                               rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 2})
    weights = load_peft_adapter(path, shapes, max_lora_rank=8)
    raw = {}
    from safetensors import safe_open
    with safe_open(f"{path}/adapter_model.safetensors", "pt") as f:
        for key in f.keys():
            raw[key] = f.get_tensor(key)
    prefix = "base_model.model.model.layers.0"
    for module, r, alpha in (("self_attn.q_proj", 4, 8), ("mlp.down_proj", 2, 8), ("self_attn.o_proj", 4, 2)):
        a, b = weights.modules[f"model.layers.0.{module}"]
        assert a.shape[0] == r
        assert torch.equal(a, raw[f"{prefix}.{module}.lora_A.weight"])
        assert torch.allclose(b, raw[f"{prefix}.{module}.lora_B.weight"] * alpha / math.sqrt(r))
    assert weights.rank == 4 and weights.kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                   "up_proj", "down_proj"}
    same = load_peft_adapter(path, shapes, max_lora_rank=8)
    other = load_peft_adapter(save_random_adapter(tiny_model_dir, tmp_path / "b", r=4, lora_alpha=8, seed=2),
                              shapes, max_lora_rank=8)
    assert same.content_hash == weights.content_hash != other.content_hash


@pytest.mark.parametrize("config, message", [
    ({"use_dora": True}, "DoRA adapters \\(use_dora\\) are not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save are not supported"),
    ({"targets": ["q_proj", "embed_tokens"]}, "it adapts embed_tokens .*LoRA on the embedding and the LM head"),
    ({"targets": ["v_proj", "lm_head"]}, "it adapts lm_head .*not supported"),
    ({"r": 16}, "rank 16 of model.layers.0.mlp.down_proj exceeds max_lora_rank=8"),
    ({"bias": "lora_only"}, "adapters that train biases"),
])
def test_adapters_that_cannot_be_served_are_refused_at_load(tiny_model_dir, shapes, tmp_path, config, message):
    spec = {"r": 4, "lora_alpha": 8, **config}
    path = save_random_adapter(tiny_model_dir, tmp_path / "x", seed=3, **spec)
    with pytest.raises(LoRAError, match=message):
        load_peft_adapter(path, shapes, max_lora_rank=8, name="x")


def test_adapters_of_another_model_are_refused_naming_the_module(tiny_model_dir, tiny_untied_model_dir,
                                                                 shapes, tmp_path):
    path = save_random_adapter(tiny_untied_model_dir, tmp_path / "wide", r=4, lora_alpha=8)
    with pytest.raises(LoRAError, match=r"down_proj has lora_A \(4, 512\) and lora_B \(384, 4\); "
                                         r".* needs \[r, 512\] and \[256, r\]"):
        load_peft_adapter(path, shapes, max_lora_rank=8)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    save_file({"base_model.model.model.layers.0.mlp.c_fc.lora_A.weight": torch.zeros(2, 256),
               "base_model.model.model.layers.0.mlp.c_fc.lora_B.weight": torch.zeros(512, 2)},
              str(foreign / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="it adapts model.layers.0.mlp.c_fc, which is not a linear projection"):
        load_peft_adapter(str(foreign), shapes, max_lora_rank=8)


def test_folders_that_are_not_safe_adapters_are_refused(tiny_model_dir, shapes, tmp_path):
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_peft_adapter(str(tmp_path), shapes, max_lora_rank=8)
    path = save_random_adapter(tiny_model_dir, tmp_path / "bin", r=4, lora_alpha=8, seed=4)
    (tmp_path / "bin" / "adapter_model.safetensors").rename(tmp_path / "bin" / "adapter_model.bin")
    with pytest.raises(LoRAError, match="adapter_model.bin is not read: pickled weights"):
        load_peft_adapter(path, shapes, max_lora_rank=8)
    (tmp_path / "bin" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "r": 4,
                                                                      "lora_alpha": 8}))
    with pytest.raises(LoRAError, match="a IA3 adapter; only LoRA adapters are served"):
        load_peft_adapter(path, shapes, max_lora_rank=8)
