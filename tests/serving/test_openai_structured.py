"""The OpenAI layer's structured outputs without a server: response_format
and vLLM's fields become the model's structured_outputs, tools and
tool_choice are checked and become a structural tag, and tool calls are
parsed out of generated text, whole and piece by piece."""
import json

import pytest

from pagedbackend.serving.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from pagedbackend.serving.openai.structured import (TOOL_CALL_BEGIN, ToolCallStream, Tools, messages_with_tools,
                                                    parse_tool_calls, structured_outputs)

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def chat(**fields):
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                 "strict": True}}},
     {"json": {"type": "object"}}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
    ({"guided_choice": ["a", "b"], "guided_decoding_backend": "xgrammar"},
     {"choice": ["a", "b"], "backend": "xgrammar"}),
    ({"guided_json": {"type": "object"}}, {"json": {"type": "object"}}),
    ({}, None),
])
def test_each_way_of_asking_becomes_one_structured_outputs_object(fields, expected):
    assert structured_outputs(chat(**fields)) == expected
    assert structured_outputs(CompletionRequest.model_validate({"prompt": "x", **fields})) == expected


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", ["response_format.type", "'xml'"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format",
     ["json_schema must be an object with a name"]),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format",
     ["must not be combined with guided_regex"]),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs", ["must not both be set"]),
])
def test_conflicting_or_unknown_formats_are_a_400_naming_the_field(fields, param, words):
    with pytest.raises(OpenAIError) as refused:
        structured_outputs(chat(**fields))
    assert refused.value.status == 400 and refused.value.param == param
    assert all(w in refused.value.message for w in words), refused.value.message


@pytest.mark.parametrize("tools, choice, param, words", [
    ([{"type": "retrieval"}], None, "tools", ["tools[0]", "function"]),
    ([{"type": "function", "function": {}}], None, "tools", ["tools[0].function must be an object with a name"]),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools", ["parameters"]),
    ([WEATHER, WEATHER], None, "tools", ["listed twice"]),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", ["'nope'"]),
    ([WEATHER], "sometimes", "tool_choice", ["tool_choice must be"]),
    (None, "required", "tool_choice", ["tool_choice needs tools"]),
    ([{"type": "function", "function": {"name": "a</tool_call>b"}}], "required", "tools",
     ["'a</tool_call>b'", "letters, digits, underscores or hyphens"]),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools", ["1 to 64"]),
    ([{"type": "function", "function": {"name": "get weather"}}], None, "tools", ["'get weather'"]),
])
def test_bad_tools_are_a_400_naming_the_field(tools, choice, param, words):
    with pytest.raises(OpenAIError) as refused:
        Tools.of(chat(tools=tools, tool_choice=choice))
    assert refused.value.param == param and all(w in refused.value.message for w in words), refused.value.message


@pytest.mark.parametrize("choice, kind, names, first_only", [
    ("auto", "triggered_tags", ["get_weather", "add"], False),
    ("required", "tags_with_separator", ["get_weather", "add"], False),
    ({"type": "function", "function": {"name": "add"}}, "tags_with_separator", ["add"], True),
])
def test_tool_choice_decides_the_structural_tag(choice, kind, names, first_only):
    tag = Tools([WEATHER, ADD], choice, None).structural_tag()["format"]
    assert tag["type"] == kind and tag["stop_after_first"] is first_only
    assert [json.loads(t["begin"].split("\n", 1)[1] + "0}")["name"] for t in tag["tags"]] == names
    assert tag["tags"][-1]["content"]["json_schema"] == ADD["function"]["parameters"]
    assert Tools([WEATHER, ADD], choice, False).structural_tag()["format"]["stop_after_first"] is True


def test_names_openai_allows_are_accepted():
    tools = [{"type": "function", "function": {"name": name}} for name in ("get_weather", "a-b_9", "x" * 64)]
    assert list(Tools.of(chat(tools=tools, tool_choice="auto")).functions) == ["get_weather", "a-b_9", "x" * 64]


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("message, words", [
    ({"role": "assistant", "tool_calls": "oops"}, ["messages[1].tool_calls must be a list", "str"]),
    ({"role": "assistant", "tool_calls": [1, 2]}, ["messages[1].tool_calls[0] must be an object"]),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}, ["function.name"]),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]},
     ["function.arguments must be a string"]),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "retrieval"}]}, ["type must be function"]),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, ["only an assistant message has tool calls"]),
])
def test_malformed_assistant_tool_calls_are_a_400_naming_their_place(message, words):
    messages = [{"role": "user", "content": "Weather?"}, message]
    with pytest.raises(OpenAIError) as refused:
        messages_with_tools([m.for_template(i) for i, m in enumerate(chat(messages=messages).messages)], None, True)
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert all(w in refused.value.message for w in words), refused.value.message


def test_well_formed_tool_calls_reach_the_conversation():
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    out = messages_with_tools([m.for_template(i) for i, m in enumerate(chat(messages=messages).messages)],
                              None, False)
    assert '"name": "get_weather"' in out[1]["content"] and '"city": "Paris"' in out[1]["content"]


def test_tools_are_described_in_a_system_message_when_the_template_cannot():
    tools = Tools([WEATHER], "auto", None)
    history = [{"role": "system", "content": "Be brief."}, *USER,
               {"role": "assistant", "content": "",
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "4 C"}]
    out = messages_with_tools(history, tools, knows_tools=False)
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == TOOL_CALL_BEGIN + '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert "tool_calls" not in out[2]
    assert out[3] == {"role": "tool", "tool_call_id": "c1", "content": "<tool_response>\n4 C\n</tool_response>"}
    assert messages_with_tools(history, tools, knows_tools=True) == history


TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_tool_calls_are_parsed_out_of_the_text():
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("no calls <tool_ here") == ("no calls <tool_ here", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_pieces_give_the_same_content_and_calls_as_the_whole_text(size):
    stream = ToolCallStream()
    deltas = []
    for i in range(0, len(TEXT), size):
        deltas += stream.feed(TEXT[i:i + size])
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == "Let me look." and TOOL_CALL_BEGIN[:2] not in content
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]


def test_an_unfinished_call_block_ends_as_text():
    stream = ToolCallStream()
    deltas = stream.feed('<tool_call>\n{"name": "add", "argu') + stream.finish()
    assert "".join(d.get("content", "") for d in deltas) == '<tool_call>\n{"name": "add", "argu'
    assert not stream.calls
