"""A LoRA adapter on a vision-language model's text decoder, with images in
the prompt, against Hugging Face PEFT on the same LLaVA checkpoint (greedy,
fp32): the adapter changes the tokens after the image as PEFT's does, a
request without it in the same step gets the base model's, and the vision
tower and projector stay the base model's (an adapter on them is refused)."""
import pytest
import torch

from loadtest.tiny_vision import load_hf, random_image
from pagedbackend import LLM, LoRARequest, SamplingParams

PROMPT = "<|im_start|>user\nWhat is in<image> this picture?<|im_end|>\n<|im_start|>assistant\n"
TEXT_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def random_adapter(folder, out_dir, targets, seed=1):
    """A PEFT adapter of the whole vision-language model, its A and B redrawn wide enough to change tokens."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(load_hf(folder), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                       init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    model.save_pretrained(out_dir)
    return model


@pytest.mark.timeout(300)
def test_an_adapter_with_images_equals_peft_beside_the_base_model(tiny_vision, tmp_path):
    from transformers import AutoProcessor
    folder = tiny_vision("llava")
    peft_model = random_adapter(folder, tmp_path / "adapter", TEXT_TARGETS).eval()
    processor = AutoProcessor.from_pretrained(folder)
    images = [random_image(seed, 64, 48) for seed in (3, 4)]

    def peft_greedy(image, adapter: bool):
        inputs = processor(text=PROMPT, images=[image], return_tensors="pt")
        with torch.no_grad():
            if adapter:
                out = peft_model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
            else:
                with peft_model.disable_adapter():
                    out = peft_model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    expected = [peft_greedy(images[0], True), peft_greedy(images[1], False), peft_greedy(images[1], True)]
    assert expected[0] != peft_greedy(images[0], False)   # the adapter changes the answer
    with LLM(model=str(folder), compile=False, block_size=8, enable_lora=True, max_loras=1,
             max_lora_rank=4) as llm:
        adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
        prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": [image]}}
                   for image in (images[0], images[1], images[1])]
        got = llm.generate(prompts, GREEDY, lora_request=[adapter, None, adapter])
    assert [list(o.outputs[0].token_ids) for o in got] == expected


def test_an_adapter_on_the_vision_tower_is_refused_by_name(tiny_vision, tmp_path):
    folder = tiny_vision("llava")
    random_adapter(folder, tmp_path / "tower", r".*vision_tower.*\.(q_proj|v_proj)")
    with LLM(model=str(folder), compile=False, block_size=8, enable_lora=True, max_loras=1,
             max_lora_rank=4) as llm:
        request = {"prompt": PROMPT, "multi_modal_data": {"image": [random_image(5, 64, 48)]}}
        with pytest.raises(Exception, match="vision"):
            llm.generate([request], GREEDY, lora_request=LoRARequest("tower", 1, str(tmp_path / "tower")))
