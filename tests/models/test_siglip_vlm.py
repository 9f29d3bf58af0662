"""Idefics3 / SmolVLM and Gemma 3 with images, through the engine: greedy
output equal to Hugging Face ``generate`` with the same processor and the
same random images, one and two images per prompt, batched with a text-only
request; prefix caching on (the same image again: a hit and the same
tokens; another image: HF's tokens for it); prefill chunks smaller than a
prompt (Idefics3's spans cross chunks; Gemma 3's image spans are never
split, their soft tokens attending both ways); preemption."""
import json

import pytest
import torch

from loadtest.tiny_vision import build_tiny_vision, load_hf, random_image
from pagedbackend import LLM, SamplingParams
from pagedbackend.core.kv_groups import kv_layout
from pagedbackend.models import model_args

NEW_TOKENS = 8
PLACEHOLDER = {"idefics3": "<image>", "gemma3_vision": "<start_of_image>"}


@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model_dir):
    """``built(case)``: (case, folder, HF model, processor), built once per case."""
    from transformers import AutoProcessor
    cases = {}

    def get(case):
        if case not in cases:
            folder = build_tiny_vision(tmp_path_factory.mktemp(case), case)
            cases[case] = case, folder, load_hf(folder), AutoProcessor.from_pretrained(folder)
        return cases[case]
    return get


@pytest.fixture(params=["idefics3", "gemma3_vision"])
def vlm(request, built):
    return built(request.param)


@pytest.fixture
def gemma3(built):
    return built("gemma3_vision")


def chat(processor, case, text, images):
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)


def hf_greedy(hf, processor, prompt, images):
    """HF's greedy tokens for one prompt, up to and with its EOS."""
    if images:
        inputs = processor(text=prompt, images=images, return_tensors="pt")
    else:
        inputs = processor(text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def engine(folder, **overrides):
    settings = dict(model=str(folder), dtype="float32", device="cpu", block_size=8, num_kv_blocks=96,
                    enable_prefix_caching=True, compile=False)
    return LLM(**{**settings, **overrides})


def requests(processor, case):
    """One image, two images of other aspect ratios, and text only."""
    one = [random_image(1, 64, 48)]
    two = [random_image(2, 40, 96), random_image(3, 96, 40)]
    return [(chat(processor, case, "what is this?", one), one),
            (chat(processor, case, "compare them", two), two),
            (chat(processor, case, "say something about llamas", []), [])]


def generate(llm, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    inputs = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
              for text, images in prompts]
    return [out.outputs[0].token_ids for out in llm.generate(inputs, params)]


# "chunked": steps of 6 tokens end inside every image span: Idefics3's run on
# over several chunks, Gemma 3's are cut before the span and run whole.
@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 6}], ids=["whole", "chunked"])
def test_greedy_output_is_transformers_with_images_batched_with_text(vlm, settings):
    case, folder, hf, processor = vlm
    prompts = requests(processor, case)
    expected = [hf_greedy(hf, processor, text, images) for text, images in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)   # the images matter: a real check
    llm = engine(folder, **settings)
    assert generate(llm, prompts) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_output_is_transformers_under_preemption(vlm, mode):
    case, folder, hf, processor = vlm
    prompts = requests(processor, case)
    prompts.append((prompts[0][0], [random_image(4, 48, 64)]))
    expected = [hf_greedy(hf, processor, text, images) for text, images in prompts]
    lengths = [len(processor(text=t, images=i or None, return_tensors="pt")["input_ids"][0]) for t, i in prompts]
    need = [-(-(n + NEW_TOKENS) // 8) for n in lengths]
    # per KV group (Gemma 3: sliding and full layers), room for the largest
    # request and a little more: the others preempt each other
    groups = len(kv_layout(model_args(json.loads((folder / "config.json").read_text())).layer_windows).windows)
    llm = engine(folder, num_kv_blocks=(max(need) + 2) * groups, preemption_mode=mode,
                 swap_space_blocks=max(need) * groups, enable_prefix_caching=False)
    assert generate(llm, prompts) == expected
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_gemma3_image_tokens_attend_both_ways_as_in_transformers(gemma3):
    """Without its bidirectional image mask (no token_type_ids) transformers
    gives other tokens: matching it above needs the image blocks."""
    case, folder, hf, processor = gemma3
    for text, images in requests(processor, case)[:2]:
        inputs = processor(text=text, images=images, return_tensors="pt")
        causal = {name: t for name, t in inputs.items() if name != "token_type_ids"}
        with torch.no_grad():
            out = hf.generate(**causal, do_sample=False, max_new_tokens=NEW_TOKENS)
        assert out[0, inputs["input_ids"].shape[1]:].tolist() != hf_greedy(hf, processor, text, images)


def test_gemma3_refuses_an_image_longer_than_a_step_by_name(gemma3):
    case, folder, hf, processor = gemma3
    from pagedbackend.errors import InvalidRequestError
    llm = engine(folder, max_num_batched_tokens=3, max_num_seqs=3)
    text, images = requests(processor, case)[0]
    with pytest.raises(InvalidRequestError, match="image of 4 tokens.*max_num_batched_tokens=3"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, SamplingParams(max_tokens=2))


def test_the_same_image_again_hits_the_prefix_cache_another_image_does_not(vlm):
    case, folder, hf, processor = vlm
    text = chat(processor, case, "what is this?", [None])
    first, other = [random_image(5, 64, 48)], [random_image(6, 64, 48)]
    ids = processor(text=text, images=first, return_tensors="pt")["input_ids"][0].tolist()
    image_at = ids.index(processor.tokenizer.convert_tokens_to_ids(PLACEHOLDER[case]))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    llm = engine(folder)

    def run(images):
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params)[0]
        return list(out.outputs[0].token_ids), out.metrics.num_cached_prompt_tokens

    expected_first, expected_other = hf_greedy(hf, processor, text, first), hf_greedy(hf, processor, text, other)
    assert expected_first != expected_other
    assert run(first) == (expected_first, 0)
    tokens, cached = run(first)
    assert tokens == expected_first and cached >= len(ids) - 8   # every full block, past the image
    tokens, cached = run(other)
    assert tokens == expected_other and cached <= image_at       # no block past the image's start
    # each distinct image went through the tower once
    assert llm.engine.runner.image_rows.encoded_images == 2
