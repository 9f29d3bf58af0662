"""Images end to end on a tiny random LLaVA (loadtest/tiny_vision.py), through
real servers: Triton's ``image`` tensor and the OpenAI API's ``image_url``
parts give exactly the tokens of Hugging Face ``generate`` (greedy, the same
processor, the same images made in the test), and usage counts the image's
placeholder tokens; bad images through the OpenAI API get a 400 naming their
limit. One tritonserver and one API server for the module."""

import httpx
import pytest
import torch

from image_files import b64, encoded, huge_blank_png
from triton_images import MAX_TOKENS, SETTINGS, triton_tokens
from loadtest.harness.openai import OpenAIServer
from loadtest.harness.triton import TritonServer
from pagedbackend.serving.repository import make_model_repository

pytestmark = pytest.mark.slow

QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def llava(tmp_path_factory, default_model_dir):
    from loadtest.tiny_vision import build_tiny_vision
    return build_tiny_vision(tmp_path_factory.mktemp("tiny_llava"), "llava")


@pytest.fixture(scope="module")
def reference(llava):
    """``reference(text, images)``: HF's prompt ids and greedy new tokens."""
    from transformers import AutoProcessor

    from loadtest.tiny_vision import load_hf
    processor, model = AutoProcessor.from_pretrained(llava), load_hf(llava)

    def run(text, images):
        inputs = processor(text=text, images=images, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        prompt = inputs["input_ids"][0].tolist()
        return prompt, out[0, len(prompt):].tolist()
    run.tokenizer = processor.tokenizer
    return run


@pytest.fixture(scope="module")
def triton(tmp_path_factory, llava):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": llava, **SETTINGS})
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


@pytest.fixture(scope="module")
def api(triton, llava):
    with OpenAIServer(triton.grpc_url, tokenizer=llava) as running:
        yield running


def picture(seed: int, width: int = 64, height: int = 48):
    from loadtest.tiny_vision import random_image
    return random_image(seed, width, height)


def chat_text(tokenizer, images: int) -> str:
    content = [{"type": "text", "text": QUESTION}] + [{"type": "image"}] * images
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seeds", [(1,), (2, 3)], ids=["one-image", "two-images"])
def test_the_triton_image_tensor_gives_hf_generates_tokens(triton, reference, seeds):
    text = chat_text(reference.tokenizer, len(seeds))
    images = [picture(s) for s in seeds]
    prompt, expected = reference(text, images)

    got, prompt_tokens = triton_tokens(triton, text, [b64(encoded(i)) for i in images])

    assert got == expected
    assert prompt_tokens == len(prompt)   # the image placeholders included


@pytest.mark.timeout(300)
def test_an_openai_image_url_part_gives_hf_generates_tokens_and_counts_them(api, reference):
    image = picture(4, 80, 60)
    prompt, expected = reference(chat_text(reference.tokenizer, 1), [image])
    body = {"model": "paged_llm", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(encoded(image)),
                                                    "detail": "auto"}}]}]}

    reply = httpx.post(f"{api.base_url}/chat/completions", json=body, timeout=120)

    answer = reply.json()
    assert reply.status_code == 200, answer
    assert answer["choices"][0]["message"]["content"] == reference.tokenizer.decode(expected,
                                                                                    skip_special_tokens=True)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS


@pytest.mark.timeout(300)
def test_the_same_image_as_bare_base64_and_as_jpeg_data_url_is_served(api, reference):
    image = picture(5)
    bare = {"type": "image_url", "image_url": b64(encoded(image))}   # the URL string, bare base64
    body = {"model": "paged_llm", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}, bare]}]}
    _, expected = reference(chat_text(reference.tokenizer, 1), [image])

    reply = httpx.post(f"{api.base_url}/chat/completions", json=body, timeout=120)

    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == reference.tokenizer.decode(
        expected, skip_special_tokens=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("urls, words", [
    (lambda: ["data:image/png;base64," + b64(huge_blank_png(20_000, 20_000))], ["decompression bomb",
                                                                               "max_image_pixels"]),
    (lambda: ["data:image/png;base64," + b64(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)], ["image 0", "corrupt"]),
    (lambda: ["https://images.example.com/cat.png"], ["this server fetches no URLs", "allowed_media_domains"]),
    (lambda: [b64(encoded(picture(6)))] * 5, ["5 images", "limit is 4", "limit_mm_per_prompt"]),
], ids=["20000x20000-png", "corrupt", "remote-url", "one-too-many"])
def test_a_bad_image_url_gets_a_400_naming_its_limit(api, urls, words):
    content = [{"type": "text", "text": QUESTION}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls()]
    body = {"model": "paged_llm", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}

    reply = httpx.post(f"{api.base_url}/chat/completions", json=body, timeout=120)

    message = reply.json()["error"]["message"]
    assert reply.status_code == 400 and all(w in message for w in words), message
