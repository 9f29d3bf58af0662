"""A model family other than Llama served through a real tritonserver and
the OpenAI API (the official ``openai`` client): a tiny random Qwen3 whose
tokenizer, as Qwen3's, has ``<think>`` and ``</think>`` as tokens of their own
and a chat template that reads ``enable_thinking``. Its greedy tokens are
Hugging Face's; with ``--reasoning-parser qwen3`` the thinking goes to
``reasoning_content`` and a constraint applies to what follows it."""
import openai
import pytest
import torch

from loadtest.tiny_families import build_tiny_family, load_hf
from loadtest.harness.triton import TritonServer
from loadtest.harness.openai import OpenAIServer
from pagedbackend.serving.repository import make_model_repository

pytestmark = pytest.mark.slow

SETTINGS = dict(num_kv_blocks=64, max_num_seqs=8, dtype="float32", device="cpu", compile=False)
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Is Paris in France?"}]
YES_NO = {"structured_outputs": {"choice": ["yes", "no"]}}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_model_dir):
    from transformers import AutoTokenizer
    folder = build_tiny_family(tmp_path_factory.mktemp("qwen3_thinking"), "qwen3", vocab_size=49154)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"])   # plain added tokens, as in Qwen3's tokenizer
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def servers(tmp_path_factory, qwen3_dir):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": str(qwen3_dir), **SETTINGS})
    with TritonServer(repo, ready_timeout_s=300) as triton:
        with OpenAIServer(triton.grpc_url, tokenizer=str(qwen3_dir),
                          extra_args=["--reasoning-parser", "qwen3"]) as api:
            with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=180) as client:
                yield triton, client


@pytest.fixture(scope="module")
def end_of_thinking(qwen3_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen3_dir).convert_tokens_to_ids("</think>")


def test_a_served_qwen3_generates_the_greedy_tokens_of_transformers(servers, qwen3_dir):
    _, client = servers
    prompt = torch.randint(3, 49152, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    completion = client.completions.create(model="paged_llm", prompt=prompt, max_tokens=10, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    hf = load_hf(qwen3_dir, "qwen3")
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                          attention_mask=torch.ones(1, 20, dtype=torch.long))
    from transformers import AutoTokenizer
    expected = AutoTokenizer.from_pretrained(qwen3_dir).decode(out[0, 20:], skip_special_tokens=True)
    assert completion.choices[0].text == expected and completion.usage.completion_tokens == 10


def test_thinking_that_never_closes_is_all_reasoning_whole_and_streamed(servers):
    _, client = servers
    kwargs = dict(model="paged_llm", messages=ASK, max_tokens=6, temperature=0.0)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert whole.content is None and whole.reasoning_content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
    assert not any(d.content for d in deltas)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_constraint_applies_after_the_thinking_ends(servers, end_of_thinking, stream):
    """The model is pushed to close its thinking at once (logit_bias); what
    follows is held to the choice, which </think> is no part of."""
    _, client = servers
    reply = client.chat.completions.create(model="paged_llm", messages=ASK, max_tokens=8, temperature=0.0,
                                           logit_bias={str(end_of_thinking): 100}, stream=stream, extra_body=YES_NO)
    if stream:
        deltas = [c.choices[0].delta for c in reply if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = reply.choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning == "" and content in ("yes", "no")


def test_enable_thinking_false_gives_content_held_to_the_constraint_from_the_start(servers):
    _, client = servers
    message = client.chat.completions.create(
        model="paged_llm", messages=ASK, max_tokens=8, temperature=0.0,
        extra_body={**YES_NO, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.reasoning_content is None and message.content in ("yes", "no")


def test_a_template_call_argument_in_chat_template_kwargs_is_a_400(servers):
    _, client = servers
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.add_generation_prompt"):
        client.chat.completions.create(model="paged_llm", messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
