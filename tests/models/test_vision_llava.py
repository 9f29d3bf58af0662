"""LLaVA through the engine against Hugging Face ``generate`` on a tiny
random checkpoint saved by transformers with its processor: images in place
of their placeholders, batched with text, chunked prefill over an image's
span, prefix caching that sees images, the encoder cache, preemption, and
the refusals."""
import pytest
import torch

from loadtest.tiny_vision import load_hf, random_image
from pagedbackend import LLM, SamplingParams
from pagedbackend.errors import InvalidRequestError

CHAT = "<|im_start|>user\nWhat is in<image> this picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = "Compare <image> with <image>, please."
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tiny_vision):
    return tiny_vision("llava")


@pytest.fixture(scope="module")
def reference(llava):
    """HF's greedy tokens of (prompt, images) and its prompt ids, cached per case."""
    from transformers import AutoProcessor
    model, processor = load_hf(llava), AutoProcessor.from_pretrained(llava)
    found = {}

    def tokens(prompt, seeds):
        key = (prompt, tuple(seeds))
        if key not in found:
            inputs = processor(text=prompt, images=[image(s) for s in seeds], return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
            found[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
        return found[key]
    return tokens


def image(seed):
    # Images of several sizes and aspect ratios: the processor resizes and crops them.
    sizes = [(64, 48), (30, 90), (120, 120), (57, 41)]
    return random_image(seed, *sizes[seed % len(sizes)])


def request(prompt, seeds):
    return {"prompt": prompt, "multi_modal_data": {"image": [image(s) for s in seeds]}}


def tokens_of(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(llava):
    engine = LLM(model=str(llava), block_size=8, compile=False)
    yield engine
    engine.shutdown()


def test_images_give_hf_tokens_batched_with_text(llm, reference):
    cases = [(CHAT, [0]), (TWO, [1, 2]), (CHAT, [3])]
    outputs = llm.generate([request(p, s) for p, s in cases] + ["A text-only prompt in the same batch"], GREEDY)
    assert tokens_of(outputs[:3]) == [reference(p, s) for p, s in cases]
    # Different images, different answers: the images reach the model.
    assert reference(CHAT, [0]) != reference(CHAT, [3])
    text_only = llm.generate("A text-only prompt in the same batch", GREEDY)
    assert tokens_of(outputs[3:]) == tokens_of([text_only[0]])
    # Usage counts every placeholder: 16 patches per image at 56 px.
    assert len(outputs[1].prompt_token_ids) == len(llm.get_tokenizer().encode(TWO)) - 2 + 2 * 16


def test_prefix_cache_shares_the_same_image_only(llava, reference):
    with LLM(model=str(llava), block_size=8, compile=False) as engine:
        rows = engine.engine.runner.image_rows
        first = engine.generate(request(CHAT, [0]), GREEDY)[0]
        encoded = rows.encoded_images
        again = engine.generate(request(CHAT, [0]), GREEDY)[0]
        other = engine.generate(request(CHAT, [3]), GREEDY)[0]
    assert tokens_of([first, again, other]) == [reference(CHAT, [0])] * 2 + [reference(CHAT, [3])]
    prompt_len = len(first.prompt_token_ids)
    image_start = first.prompt_token_ids.index(engine.engine.runner.model.image_token_id)
    # The same image: every whole block but the last token's is a hit.
    assert again.metrics.num_cached_prompt_tokens == (prompt_len - 1) // 8 * 8
    # Another image: only the blocks before the image's first placeholder.
    assert other.metrics.num_cached_prompt_tokens == image_start // 8 * 8
    assert rows.encoded_images == encoded + 1   # the cached image skipped the tower


def test_image_span_over_prefill_chunks(llava, reference):
    # 12 tokens a step: each 16-placeholder image spans two or three chunks.
    with LLM(model=str(llava), block_size=8, compile=False, max_num_batched_tokens=12,
             long_prefill_token_threshold=0, tpot_target_s=0) as engine:
        outputs = engine.generate([request(TWO, [1, 2]), request(CHAT, [0])], GREEDY)
    assert tokens_of(outputs) == [reference(TWO, [1, 2]), reference(CHAT, [0])]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_image_requests_keep_hf_tokens(llava, reference, mode):
    # A pool for about two of the four sequences: the later ones are preempted while decoding.
    settings = dict(swap_space_blocks=64) if mode == "swap" else {}
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with LLM(model=str(llava), block_size=8, compile=False, num_kv_blocks=24, preemption_mode=mode,
             enable_prefix_caching=False, **settings) as engine:
        outputs = engine.generate([request(CHAT, [s]) for s in range(4)], long)
        stats = engine.engine.get_stats()
        free = engine.engine.block_manager.pool.num_free
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert free == 24   # every block back
    assert [t[:GREEDY.max_tokens] for t in tokens_of(outputs)] == [reference(CHAT, [s]) for s in range(4)]


def test_refusals_name_the_problem(llm, tiny_model_dir):
    with pytest.raises(InvalidRequestError, match="limit is 4 .*limit_mm_per_prompt"):
        llm.generate(request(" ".join(["<image>"] * 5), [0, 1, 2, 3, 0]), GREEDY)
    with pytest.raises(InvalidRequestError, match="processor refused .*<image> tokens"):
        llm.generate(request("No placeholder here", [0]), GREEDY)
    with pytest.raises(InvalidRequestError, match="must be text"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": image(0)}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="not a PIL image"):
        llm.generate({"prompt": CHAT, "multi_modal_data": {"image": [b"png bytes"]}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="modality 'video'"):
        llm.generate({"prompt": CHAT, "multi_modal_data": {"video": [image(0)]}}, GREEDY)
    # The engine serves on after each refusal, with nothing held.
    assert llm.generate(request(CHAT, [0]), GREEDY)[0].outputs[0].token_ids
    assert llm.engine.block_manager.pool.num_free == llm.engine.runner.num_kv_blocks
    with LLM(model=str(tiny_model_dir), compile=False) as text_model:
        with pytest.raises(InvalidRequestError, match="takes no image input"):
            text_model.generate(request("Hello <image>", [0]), GREEDY)


def test_limit_mm_per_prompt_setting(llava):
    with LLM(model=str(llava), compile=False, limit_mm_per_prompt={"image": 1}) as engine:
        with pytest.raises(InvalidRequestError, match="2 images in one prompt; the limit is 1"):
            engine.generate(request(TWO, [1, 2]), GREEDY)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(model=str(llava), compile=False, limit_mm_per_prompt="{not json")


def test_encoder_budget_spreads_images_over_steps(llava, reference):
    # 16 encoder tokens a step: one image (16 rows) per step, however much token room is left.
    with LLM(model=str(llava), block_size=8, compile=False, max_num_encoder_input_tokens=16) as llm:
        engine, rows = llm.engine, llm.engine.runner.image_rows
        engine.add_request("two", request(TWO, [1, 2]), GREEDY)
        engine.add_request("one", request(CHAT, [3]), GREEDY)
        per_step, tokens = [], {"two": [], "one": []}
        while engine.has_unfinished_requests():
            before = rows.encoded_images
            for out in engine.step():   # deltas
                tokens[out.request_id] += out.outputs[0].token_ids
            per_step.append(rows.encoded_images - before)
    assert per_step[:3] == [1, 1, 1] and sum(per_step) == 3
    assert tokens == {"two": reference(TWO, [1, 2]), "one": reference(CHAT, [3])}


def test_encoder_cut_unit():
    from pagedbackend.core.encoder_budget import encoder_cut
    from pagedbackend.multimodal.inputs import MultiModalItem

    items = [MultiModalItem("image", "aa", offset, 16, None, {}) for offset in (4, 30)]
    assert encoder_cut(items, 0, 64, 100, True) == (64, 32)     # both fit
    assert encoder_cut(items, 0, 64, 20, True) == (30, 16)      # the second waits for the next step
    assert encoder_cut(items, 30, 20, 8, True) == (20, 16)      # alone at the chunk's start: runs
    assert encoder_cut(items, 30, 20, 8, False) == (0, 0)       # ... unless the step has used some
    assert encoder_cut(items, 20, 5, 0, False) == (5, 0)        # no image starts in it


def test_prompt_logprobs_speculation_and_structured_outputs_with_images(llava, reference):
    from transformers import AutoProcessor
    model, processor = load_hf(llava), AutoProcessor.from_pretrained(llava)
    inputs = processor(text=CHAT, images=[image(0)], return_tensors="pt")
    with torch.no_grad():
        hf_logprobs = torch.log_softmax(model(**inputs).logits[0].float(), -1)
    ids = inputs["input_ids"][0].tolist()
    with LLM(model=str(llava), block_size=8, compile=False,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        scored = llm.generate(request(CHAT, [0]), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
        speculated = llm.generate(request(CHAT, [0]), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
        choice = llm.generate(request(CHAT, [0]), SamplingParams(
            max_tokens=8, temperature=0, structured_outputs={"choice": ["cat", "dog", "kite"]}))[0]
    # Every prompt token's log-probability (after the images' rows) is HF's.
    got = [next(iter(entry.values())).logprob for entry in scored.prompt_logprobs[1:]]
    want = [hf_logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert got == pytest.approx(want, abs=2e-4)
    assert speculated.outputs[0].token_ids[:GREEDY.max_tokens] == reference(CHAT, [0])
    assert choice.outputs[0].text in ("cat", "dog", "kite")
