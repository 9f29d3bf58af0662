"""A GGUF file served as ``make serve MODEL=file.gguf`` serves it: tritonserver
with the file as the model and the OpenAI API reading the tokenizer and chat
template from the same file, answering what transformers generates when it
loads that file (Triton's generate route, token for token) and the same text
through ``/v1/completions`` and ``/v1/chat/completions``."""
import json
import urllib.request

import openai
import pytest
import torch

from loadtest.harness.openai import OpenAIServer
from loadtest.harness.triton import TritonServer
from loadtest.tiny_gguf import VOCAB, build_tiny_gguf, load_hf_gguf
from pagedbackend.serving.repository import make_model_repository

SETTINGS = dict(block_size=16, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256,
                dtype="float32", device="cpu", compile=False)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return build_tiny_gguf(tmp_path_factory.mktemp("gguf"), "qwen3", "Q4_K_M")


@pytest.fixture(scope="module")
def triton(tmp_path_factory, gguf_path):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": str(gguf_path), **SETTINGS})
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


@pytest.fixture(scope="module")
def api(triton, gguf_path):
    with OpenAIServer(triton.grpc_url, tokenizer=str(gguf_path)) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from pagedbackend.models.default_model import resolve_model_path
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(resolve_model_path(str(gguf_path))), local_files_only=True)


def hf_greedy(gguf_path, prompt_ids):
    hf = load_hf_gguf(gguf_path)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=NEW_TOKENS,
                          max_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def http_generate(triton, body):
    request = urllib.request.Request(f"{triton.http_url}/v2/models/paged_llm/generate",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_the_served_gguf_generates_what_transformers_generates_from_the_file(triton, api, gguf_path, tokenizer):
    prompt = "import json\nimport pathlib\n"
    prompt_ids = tokenizer(prompt)["input_ids"]
    expected = hf_greedy(gguf_path, prompt_ids)
    assert len(set(expected)) > 1   # a real sequence, not one repeated token
    params = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
    answer = http_generate(triton, {"input_ids": prompt_ids, "exclude_input_in_output": True,
                                    "return_output_ids": True, "sampling_parameters": json.dumps(params)})
    assert answer["output_ids"] == expected
    with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        completion = client.completions.create(model="paged_llm", prompt=prompt, max_tokens=NEW_TOKENS,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == tokenizer.decode(expected)
        assert completion.usage.prompt_tokens == len(prompt_ids)
        chat = client.chat.completions.create(model="paged_llm", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
    chat_text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert chat.usage.prompt_tokens == len(tokenizer(chat_text, add_special_tokens=False)["input_ids"])   # the file's chat template framed the message
    assert chat.usage.completion_tokens == 4 and len(tokenizer) == VOCAB
