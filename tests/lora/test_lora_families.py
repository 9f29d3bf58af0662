"""Adapters on other model families than Llama, against Hugging Face PEFT
(greedy, fp32): the LoRA layers wrap the shared projections of every family
(``CausalLM.hf_projections``), so an adapter saved by PEFT for a family's own
Hugging Face class serves as it does there, in a step beside the base model."""
import pytest
import torch

from pagedbackend import LLM, LoRARequest, SamplingParams
from peft_reference import PROJECTIONS, PeftReference, save_random_adapter

MAX_TOKENS = 8
# Each family and the PEFT target modules of its Hugging Face class.
FAMILIES = {
    "qwen3": PROJECTIONS,   # q/k norms, head_dim apart from hidden, sliding window on some layers
    "gemma3_text": PROJECTIONS,   # sliding and full layers in two KV groups
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],   # fused in the checkpoint and the adapter
    # Multimodal: the text decoder's projections only (PEFT names them under language_model).
    "gemma3": r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
}


@pytest.mark.parametrize("case", list(FAMILIES))
def test_an_adapter_on_the_family_equals_peft_beside_the_base_model(tiny_family, tmp_path, case):
    folder = tiny_family(case)
    adapter = save_random_adapter(folder, tmp_path / "adapter", r=4, lora_alpha=8, targets=FAMILIES[case], seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (12, 25, 20)]
    names = ["a", None, "a"]
    llm = LLM(model=str(folder), compile=False, num_kv_blocks=64, enable_lora=True, max_loras=1, max_lora_rank=4)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       lora_request=[LoRARequest(n, 1, adapter) if n else None for n in names])
    peft = PeftReference(folder, {"a": adapter})
    assert [o.outputs[0].token_ids for o in got] == peft.greedy(prompts, names, MAX_TOKENS)
    assert peft.greedy(prompts[:1], ["a"], MAX_TOKENS) != peft.greedy(prompts[:1], [None], MAX_TOKENS)
