"""Structured outputs and tool calls through the OpenAI API with the official
``openai`` client, against a real tritonserver serving the default model
(real weights: a random model wanders in JSON's optional whitespace):
response_format JSON that validates, tool_calls whose arguments validate
against the tool's schema, streamed and not, tool results accepted back in the
conversation, and a bad schema refused with a 400 naming it. Log-probabilities
of the tokens a constraint rules out come back as vLLM's -9999.0 on every
path (the module's responses are parsed as standard JSON, tests/serving/conftest.py)."""
import json

import httpx
import jsonschema
import openai
import pytest

from loadtest.harness.triton import TritonServer
from pagedbackend.serving.repository import make_model_repository
from loadtest.harness.openai import OpenAIServer
from strict_json import strict_loads

pytestmark = pytest.mark.slow

SETTINGS = dict(num_kv_blocks=256, max_num_seqs=16, compile=False)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, default_model_dir):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": str(default_model_dir), **SETTINGS})
    with TritonServer(repo, ready_timeout_s=300) as triton:
        with OpenAIServer(triton.grpc_url, tokenizer=str(default_model_dir)) as api:
            with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=180) as c:
                yield triton, c


@pytest.fixture
def client(servers):
    return servers[1]


def whole_or_streamed(client, stream, **kwargs):
    """(message content, tool calls as (name, arguments dict), finish reason)."""
    if not stream:
        choice = client.chat.completions.create(model="paged_llm", **kwargs).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model="paged_llm", stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        reason = chunk.choices[0].finish_reason or reason
    return (content or None, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], reason)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_gives_json_that_validates(client, stream):
    for temperature in (0.0, 0.9):
        content, calls, reason = whole_or_streamed(
            client, stream, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            max_tokens=80, temperature=temperature, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert reason == "stop" and not calls
        jsonschema.validate(json.loads(content), PERSON)


def test_response_format_json_object_gives_an_object(client):
    content, _, reason = whole_or_streamed(client, False, messages=[{"role": "user", "content":
                                                      "Give a cat's name and age as a JSON object with the keys name and age."}],
                                           max_tokens=120, temperature=0,
                                           response_format={"type": "json_object"})
    assert reason == "stop" and isinstance(json.loads(content), dict)


def test_vllm_fields_through_extra_body(client):
    out = client.completions.create(model="paged_llm", prompt="The answer is", max_tokens=5, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no")
    out = client.completions.create(model="paged_llm", prompt="A year:", max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "(19|20)[0-9]{2}"})
    assert len(out.choices[0].text) == 4 and out.choices[0].text[:2] in ("19", "20")


def _check_calls(calls, names):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls and all(name in names for name, _ in calls)
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_choice_give_calls_that_validate(client, stream, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    content, calls, reason = whole_or_streamed(client, stream, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                               max_tokens=120, temperature=0)
    assert reason == "tool_calls" and content is None
    _check_calls(calls, ["get_weather", "get_time"] if choice == "required" else ["get_time"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_gives_text_or_calls_that_validate(client, stream):
    messages = [{"role": "system", "content": "Always answer by calling a function."}, *ASK]
    content, calls, reason = whole_or_streamed(client, stream, messages=messages, tools=TOOLS, max_tokens=120,
                                               temperature=0, parallel_tool_calls=False)
    if calls:
        assert reason == "tool_calls" and len(calls) == 1
        _check_calls(calls, ["get_weather", "get_time"])
    else:
        assert reason in ("stop", "length") and content


def test_a_tool_result_in_the_conversation_is_accepted(client):
    first = client.chat.completions.create(model="paged_llm", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0).choices[0].message
    assert first.tool_calls
    call = first.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = client.chat.completions.create(model="paged_llm", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=30, temperature=0).choices[0]
    assert reply.message.content and not reply.message.tool_calls and reply.finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     ["structured_outputs.json", "objectx"]),
    ({"extra_body": {"guided_regex": "a(b"}}, ["structured_outputs.regex"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, ["nope"]),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, ["do not combine with tools"]),
    # U+B416E's first UTF-8 byte begins no token of this vocabulary: the grammar cannot go on after "T".
    ({"extra_body": {"guided_choice": ["T\U000b416e"]}}, ["no token of the model's vocabulary continues"]),
])
def test_a_bad_constraint_is_a_400_naming_it(client, kwargs, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="paged_llm", messages=ASK, max_tokens=8, **kwargs)
    message = refused.value.body["message"] if isinstance(refused.value.body, dict) else str(refused.value)
    assert all(w in message for w in words), message


def test_grammar_compiles_and_constrained_requests_are_counted_in_the_metrics(servers):
    triton, client = servers
    before = _metrics(triton)
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"]}
    for _ in range(2):   # the second request finds the grammar in the cache
        client.chat.completions.create(model="paged_llm", messages=ASK, max_tokens=20, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "w", "schema": schema}})
    after = _metrics(triton)
    grew = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    assert grew["pagedbackend:structured_requests_total"] == 2
    assert grew["pagedbackend:grammar_compiles_total"] == 1
    assert grew["pagedbackend:grammar_compile_seconds_count"] == 1
    assert grew["pagedbackend:grammar_compile_seconds_sum"] > 0
    assert grew["pagedbackend:structured_mask_seconds_total"] > 0


def _metrics(triton) -> dict:
    """Our structured-output metrics, read once two scrapes agree (a request's
    final metrics land just after its response)."""
    import time
    previous = None
    for _ in range(50):
        values = {}
        for line in triton.metrics().splitlines():
            if line.startswith(("pagedbackend:structured", "pagedbackend:grammar")):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        if values == previous:
            return values
        previous = values
        time.sleep(0.2)
    return previous


FLOOR = -9999.0
YES_NO = {"structured_outputs": {"choice": ["yes", "no"]}}


def _floors(values) -> int:
    return sum(1 for v in values if v == FLOOR)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_constrained_logprobs_are_finite_on_every_openai_path(client, stream):
    """Top log-probabilities beyond the two tokens a choice allows: chat and
    completions, n 3, best_of 3, a named tool."""
    chat = dict(messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=4, temperature=0.7,
                seed=1, logprobs=True, top_logprobs=5, stream=stream)
    completion = dict(prompt="Is the sky blue? Answer:", max_tokens=4, temperature=0.7, seed=1, logprobs=5,
                      stream=stream)
    runs = [client.chat.completions.create(model="paged_llm", extra_body=YES_NO, n=3, **chat),
            client.chat.completions.create(model="paged_llm", tools=TOOLS, max_completion_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           **{**chat, "max_tokens": None}),
            client.completions.create(model="paged_llm", extra_body=YES_NO, n=3, **completion)]
    if not stream:   # best_of > n decides at the end: no stream
        runs.append(client.completions.create(model="paged_llm", extra_body=YES_NO, best_of=3, **completion))
    values = []
    for run in runs:
        for answer in (run if stream else [run]):
            for choice in answer.choices:
                if choice.logprobs is None:
                    continue
                if hasattr(choice.logprobs, "content"):   # chat
                    values += [t.logprob for p in choice.logprobs.content or [] for t in p.top_logprobs]
                else:
                    values += [v for top in choice.logprobs.top_logprobs or [] for v in top.values()]
    assert _floors(values) > 0 and all(FLOOR <= v <= 0 for v in values)


def test_constrained_logprobs_are_finite_in_tritons_logprobs_output(servers):
    triton, _ = servers
    body = {"text_input": "Is the sky blue? Answer:", "stream": True, "return_logprobs": True,
            "return_cumulative_logprob": True,
            "sampling_parameters": json.dumps({"max_tokens": 4, "logprobs": 5, "n": 2, "temperature": 0.7,
                                               "seed": 1, **YES_NO})}
    values = []
    with httpx.stream("POST", f"{triton.http_url}/v2/models/paged_llm/generate_stream", json=body,
                      timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                event = strict_loads(line[len("data:"):])
                assert "error" not in event, event
                for element in event["logprobs"] if isinstance(event["logprobs"], list) else [event["logprobs"]]:
                    values += [e["logprob"] for step in strict_loads(element) or [] for e in step.values()]
    assert _floors(values) > 0
