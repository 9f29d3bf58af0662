"""The chat API's reasoning without a server: how qwen3's and deepseek_r1's
outputs split into reasoning_content and content, the same whole and piece
by piece, in answers and stream chunks; structured outputs and tool calls
constrained only after the reasoning (checked on the grammar the engine
compiles); chat_template_kwargs reach the template."""
import asyncio
import json

import pytest

from pagedbackend.structured.compiler import parse
from pagedbackend.serving.openai.answers import ChatAnswer, Run
from pagedbackend.serving.openai.app import chat_prompt
from pagedbackend.serving.openai.protocol import ChatCompletionRequest, OpenAIError
from pagedbackend.serving.openai.reasoning import Reasoning
from pagedbackend.serving.openai.structured import Tools
from pagedbackend.serving.openai.triton_client import Update
from pagedbackend.structured.params import StructuredOutputsParams

USER = [{"role": "user", "content": "hi"}]
OPEN_PROMPT = "<|im_start|>assistant\n"                            # the model thinks first
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"   # Qwen3 with thinking off


def chat(**fields):
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


@pytest.mark.parametrize("parser, prompt, kwargs, text, expected", [
    ("qwen3", OPEN_PROMPT, None, "<think>\nhm</think>\n\nParis", ("\nhm", "\n\nParis")),
    ("qwen3", OPEN_PROMPT, None, "still thinking", ("still thinking", None)),     # cut off: all reasoning
    ("qwen3", OPEN_PROMPT, {"enable_thinking": False}, "Paris", (None, "Paris")),
    ("qwen3", CLOSED_PROMPT, None, "Paris</think>", (None, "Paris</think>")),     # the prompt closed it
    ("deepseek_r1", OPEN_PROMPT + "<think>\n", {"enable_thinking": False}, "a</think>b", ("a", "b")),
    ("deepseek_r1", OPEN_PROMPT, None, "</think>b", ("", "b")),
    ("deepseek_r1", OPEN_PROMPT, None, "  <think>a</think>", ("a", None)),
])
def test_an_output_splits_into_reasoning_and_content(parser, prompt, kwargs, text, expected):
    assert Reasoning(parser, prompt, kwargs).split(text) == expected


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("text", ["<think>one two</think>three </think>", "a<b</thin</think>c", "<thi", "x</thin"])
def test_streamed_pieces_add_up_to_the_whole_split(size, text):
    reasoning = Reasoning("qwen3", OPEN_PROMPT)
    stream = reasoning.stream()
    pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i:i + size])] + stream.finish()
    whole_reasoning, whole_content = reasoning.split(text)
    assert "".join(r or "" for r, _ in pieces) == (whole_reasoning or "")
    assert "".join(c or "" for _, c in pieces) == (whole_content or "")


def updates(pieces, reason="stop"):
    async def run():
        for i, text in enumerate(pieces):
            yield 0, Update([text], [reason if i == len(pieces) - 1 else None], [1], 5, None)
    return run()


def answer(req, reasoning, pieces, tools=None):
    """The whole answer and the stream chunks of ``pieces`` of generated text."""
    whole_run, stream_run = Run(1, 1), Run(1, 1)
    whole = ChatAnswer(req, "m", tools, reasoning)
    for piece in pieces:
        for _ in whole_run.fold(0, Update([piece], [None], [1], 5, None)):
            pass
    whole_run.choices[0].finish_reason = "stop"

    async def collect():
        return [c async for c in ChatAnswer(req, "m", tools, reasoning).chunks(stream_run, updates(pieces))]
    chunks = asyncio.run(collect())
    deltas = [json.loads(line[6:]) for c in chunks for line in c.decode().split("\n\n") if line.startswith("data: ")]
    return whole.whole(whole_run)["choices"][0], [d["choices"][0] for d in deltas]


def test_answers_carry_reasoning_content_whole_and_as_deltas():
    req = chat()
    message, deltas = answer(req, Reasoning("qwen3", OPEN_PROMPT), ["<think>Let", " me</th", "ink>Pa", "ris"])
    assert message["message"] == {"role": "assistant", "content": "Paris", "reasoning_content": "Let me"}
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "Let me"
    assert "".join(d["delta"].get("content", "") for d in deltas[1:]) == "Paris"   # after the role chunk
    assert deltas[-1]["finish_reason"] == "stop"
    hidden, _ = answer(chat(include_reasoning=False), Reasoning("qwen3", OPEN_PROMPT, include=False), ["a</think>b"])
    assert hidden["message"] == {"role": "assistant", "content": "b"}


def test_tool_calls_are_parsed_from_the_content_after_the_reasoning():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    req = chat(tools=[weather])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = ["I should call <tool_call> it", "</think>", call]
    message, deltas = answer(req, Reasoning("qwen3", OPEN_PROMPT), text, Tools.of(req))
    assert message["message"]["reasoning_content"] == "I should call <tool_call> it"
    assert [c["function"]["name"] for c in message["message"]["tool_calls"]] == ["get_weather"]
    assert message["finish_reason"] == "tool_calls" and deltas[-1]["finish_reason"] == "tool_calls"
    assert any("tool_calls" in d["delta"] for d in deltas)


@pytest.fixture(scope="module")
def matcher_of(default_model_dir):
    """A grammar matcher for a constraint, compiled as the engine compiles it."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(default_model_dir), vocab_size=49152)
    compiler = xgr.GrammarCompiler(info)
    return lambda constraint: xgr.GrammarMatcher(compiler.compile_grammar(parse(StructuredOutputsParams(**constraint))))


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("constraint, good, bad", [
    ({"json": SCHEMA}, '{"city": "Paris"}', "Paris"),
    ({"choice": ["yes", "no"]}, "yes", "maybe"),
    ({"regex": "[0-9]+"}, "42", "forty"),
    ({"json_object": True}, '{"a": 1}', "[1]"),
])
def test_a_constraint_applies_only_after_the_reasoning(matcher_of, constraint, good, bad):
    after = Reasoning("qwen3", OPEN_PROMPT).constrain(constraint)
    for reasoning in ("<think>free { text ] here\n", "anything at all "):
        assert matcher_of(after).accept_string(reasoning + "</think>" + good)
        assert not matcher_of(after).accept_string(reasoning + "</think>" + bad)
    # Thinking off (or closed in the prompt): the constraint starts at once, unchanged.
    assert Reasoning("qwen3", OPEN_PROMPT, {"enable_thinking": False}).constrain(constraint) == constraint
    assert Reasoning("deepseek_r1", CLOSED_PROMPT).constrain(constraint) == constraint


def test_a_tool_call_constraint_applies_after_the_reasoning(matcher_of):
    req = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}], tool_choice="required")
    constraint = {"structural_tag": json.dumps(Tools.of(req).structural_tag())}
    after = Reasoning("deepseek_r1", OPEN_PROMPT).constrain(constraint)
    call = '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert matcher_of(after).accept_string("must call f</think>" + call)
    assert not matcher_of(after).accept_string("must call f</think>no call")


QWEN3_LIKE = ("{{ messages[0].content }}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_its_call_arguments_are_refused(default_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = QWEN3_LIKE
    off = chat_prompt(tokenizer, chat(chat_template_kwargs={"enable_thinking": False}))
    assert off == "hi" + CLOSED_PROMPT and chat_prompt(tokenizer, chat()) == "hi" + OPEN_PROMPT
    assert Reasoning("qwen3", off).split("Paris") == (None, "Paris")
    with pytest.raises(OpenAIError, match="chat_template_kwargs.tokenize is not a template variable"):
        chat_prompt(tokenizer, chat(chat_template_kwargs={"tokenize": True}))
