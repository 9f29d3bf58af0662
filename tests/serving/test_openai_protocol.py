"""The OpenAI wire format without a server: request checks and their error
objects, the sampling parameters sent to the model, the mapping of the
model's logprobs output (NVIDIA vllm_backend's format) to OpenAI's shapes, and
the reading of Triton's raw responses."""
import json

import pytest

from pagedbackend.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError,
                                                  chat_logprobs, completion_logprobs, parse_logprobs,
                                                  parse_request, sampling_parameters)


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


# ---------------------------------------------------------------- logprobs

# vllm_backend's logprobs output for two generated tokens, top 2 asked: per
# token a JSON object keyed by token id, the sampled token first (as vLLM
# writes it). At the first position the sampled token (" world", rank 3) is
# outside the top 2; at the second it is the most likely.
TWO_TOKENS = json.dumps([
    {"1917": {"logprob": -2.5, "rank": 3, "decoded_token": " world"},
     "1502": {"logprob": -0.5, "rank": 1, "decoded_token": " there"},
     "2000": {"logprob": -1.25, "rank": 2, "decoded_token": " all"}},
    {"30": {"logprob": -0.125, "rank": 1, "decoded_token": "!"},
     "13": {"logprob": -2.0, "rank": 2, "decoded_token": "."}},
]).encode()


def test_completion_logprobs_follow_the_sampled_tokens_and_their_text_offsets():
    positions = parse_logprobs(TWO_TOKENS)

    mapped = completion_logprobs(positions, top=2, text_offset=5)

    assert mapped["tokens"] == [" world", "!"]
    assert mapped["token_logprobs"] == [-2.5, -0.125]
    assert mapped["text_offset"] == [5, 11]  # len(" world") == 6
    assert mapped["top_logprobs"] == [{" there": -0.5, " all": -1.25, " world": -2.5},
                                      {"!": -0.125, ".": -2.0}]


def test_chat_logprobs_give_token_bytes_and_exactly_the_top_tokens_by_rank():
    positions = parse_logprobs(TWO_TOKENS)

    content = chat_logprobs(positions, top=2)

    assert [c["token"] for c in content] == [" world", "!"]
    assert [c["logprob"] for c in content] == [-2.5, -0.125]
    assert content[0]["bytes"] == list(b" world")
    assert [t["token"] for t in content[0]["top_logprobs"]] == [" there", " all"]  # not the sampled one
    assert content[0]["top_logprobs"][0] == {"token": " there", "logprob": -0.5, "bytes": list(b" there")}
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["!", "."]


def test_a_sampled_token_outside_the_top_is_found_by_its_rank_wherever_it_stands():
    # the engine's own order: the top tokens by rank, then the sampled one
    positions = [{"1502": {"logprob": -0.5, "rank": 1, "decoded_token": " there"},
                  "2000": {"logprob": -1.25, "rank": 2, "decoded_token": " all"},
                  "1917": {"logprob": -2.5, "rank": 3, "decoded_token": " world"}}]

    content = chat_logprobs(positions, top=2)
    mapped = completion_logprobs(positions, top=2)

    assert content[0]["token"] == " world" and content[0]["logprob"] == -2.5
    assert [t["token"] for t in content[0]["top_logprobs"]] == [" there", " all"]
    assert mapped["tokens"] == [" world"] and mapped["token_logprobs"] == [-2.5]


def test_chat_logprobs_with_no_top_tokens_still_give_each_sampled_token():
    positions = [{"7": {"logprob": -0.75, "rank": 4, "decoded_token": "é"}}]

    content = chat_logprobs(positions, top=0)

    assert content == [{"token": "é", "logprob": -0.75, "bytes": [0xC3, 0xA9], "top_logprobs": []}]


def test_an_output_without_logprobs_reads_as_none_and_a_malformed_one_is_refused():
    assert parse_logprobs(b"null") is None
    assert parse_logprobs(None) is None
    with pytest.raises(ValueError, match="JSON list"):
        parse_logprobs(b'{"1": {}}')


# ---------------------------------------------------------------- sampling parameters

def test_sampling_parameters_use_vllm_names_and_drop_neutral_penalties():
    request = parse_request(CompletionRequest, body(
        prompt="Hi", n=2, temperature=0.5, top_p=0.9, seed=7, stop="\n", max_tokens=12,
        presence_penalty=0.0, frequency_penalty=0.0, top_k=20, ignore_eos=True, user="someone"))

    params = sampling_parameters(request, request.max_tokens, top_logprobs=None)

    assert params == {"n": 2, "max_tokens": 12, "temperature": 0.5, "top_p": 0.9, "seed": 7,
                      "top_k": 20, "ignore_eos": True, "stop": ["\n"]}


def test_penalties_that_do_something_are_forwarded_to_the_model():
    request = parse_request(ChatCompletionRequest, body(
        messages=[{"role": "user", "content": "Hi"}], presence_penalty=0.5, frequency_penalty=-0.25,
        repetition_penalty=1.1, logprobs=True, top_logprobs=3))

    params = sampling_parameters(request, None, top_logprobs=3)

    assert params["presence_penalty"] == 0.5 and params["frequency_penalty"] == -0.25
    assert params["repetition_penalty"] == 1.1 and params["logprobs"] == 3
    assert params["max_tokens"] is None  # chat: up to the context length


def test_logit_bias_and_vllms_token_controls_are_forwarded_as_given():
    request = parse_request(CompletionRequest, body(
        prompt="Hi", logit_bias={"50256": -100, "7": 2.5}, allowed_token_ids=[5, 6], bad_words=["no"],
        truncate_prompt_tokens=8))

    params = sampling_parameters(request, request.max_tokens, top_logprobs=None)

    assert params["logit_bias"] == {"50256": -100.0, "7": 2.5}
    assert params["allowed_token_ids"] == [5, 6] and params["bad_words"] == ["no"]
    assert params["truncate_prompt_tokens"] == 8
    no_bias = parse_request(CompletionRequest, body(prompt="Hi", logit_bias={}))
    assert "logit_bias" not in sampling_parameters(no_bias, 16, None)


def test_completions_default_to_16_tokens_as_openai_does():
    request = parse_request(CompletionRequest, body(prompt="Hi"))

    assert request.max_tokens == 16 and request.prompts() == ["Hi"]


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("cls, fields, param, words", [
    (CompletionRequest, {"prompt": "x", "temperature": -1}, "temperature", ["temperature", "greater than"]),
    (CompletionRequest, {"prompt": "x", "top_p": 0}, "top_p", ["top_p"]),
    (CompletionRequest, {"prompt": "x", "max_tokens": "lots"}, "max_tokens", ["max_tokens", "integer"]),
    (CompletionRequest, {"prompt": "x", "colour": "blue"}, "colour", ["unrecognized", "colour"]),
    (CompletionRequest, {}, "prompt", ["prompt is required"]),
    (CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs", ["logprobs"]),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens", ["needs echo"]),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     ["stream is true"]),
    (ChatCompletionRequest, {"messages": []}, "messages", ["messages", "at least 1"]),
    (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, "messages", ["role"]),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", ["needs logprobs"]),
    (CompletionRequest, {"prompt": "x", "cache_salt": ""}, "cache_salt", ["cache_salt", "at least 1"]),
    (CompletionRequest, {"prompt": "x", "cache_salt": 7}, "cache_salt", ["cache_salt", "string"]),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "priority": True}, "priority",
     ["priority", "integer"]),
    (CompletionRequest, {"prompt": "x", "priority": 1.5}, "priority", ["priority", "integer"]),
], ids=["temperature", "top_p", "max_tokens-type", "unknown-field", "no-prompt", "too-many-logprobs",
        "max_tokens-0-without-echo", "stream_options-without-stream", "no-messages", "bad-role",
        "top_logprobs-alone", "empty-cache_salt", "cache_salt-not-text", "priority-bool", "priority-float"])
def test_a_bad_request_is_a_400_naming_the_field(cls, fields, param, words):
    with pytest.raises(OpenAIError) as refused:
        parse_request(cls, body(**fields))

    error = refused.value.body()["error"]
    assert refused.value.status == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert all(word in error["message"] for word in words), error["message"]


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "x",', ["not valid JSON"]),
    (b"[1, 2]", ["JSON object", "list"]),
    (b"\xff\xfe", ["not valid JSON"]),
])
def test_a_body_that_is_not_a_json_object_is_a_400(raw, words):
    with pytest.raises(OpenAIError) as refused:
        parse_request(CompletionRequest, raw)

    assert refused.value.status == 400
    assert all(word in refused.value.message for word in words)


DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 600 + '{"type": "string"}' + "}}" * 600


@pytest.mark.parametrize("raw", [
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
     '"json_schema": {"name": "deep", "schema": ' + DEEP_SCHEMA + "}}}").encode(),
    b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    b'{"prompt": "[[[[' + b"[" * 5000 + b'", "x": ' + b"{" * 5000,
])
def test_an_over_deep_body_is_a_400_before_it_is_decoded(raw):
    with pytest.raises(OpenAIError) as refused:
        parse_request(ChatCompletionRequest, raw)

    assert refused.value.status == 400 and "deeper than" in refused.value.message


def test_brackets_inside_strings_do_not_count_as_nesting():
    request = parse_request(CompletionRequest, body(prompt="[" * 5000 + "{" * 5000))
    assert request.prompts() == ["[" * 5000 + "{" * 5000]


def test_prompts_are_strings_or_token_id_lists_one_or_many():
    assert parse_request(CompletionRequest, body(prompt=[1, 2, 3])).prompts() == [[1, 2, 3]]
    assert parse_request(CompletionRequest, body(prompt=[[1, 2], [3]])).prompts() == [[1, 2], [3]]
    assert parse_request(CompletionRequest, body(prompt=["a", "b"])).prompts() == ["a", "b"]
    with pytest.raises(OpenAIError, match="must not be empty"):
        parse_request(CompletionRequest, body(prompt=[[1], []])).prompts()


@pytest.mark.parametrize("prompt, where, bad", [
    ([-1], "prompt:", "-1"),
    ([5, 10 ** 9], "prompt:", "1000000000"),
    ([10 ** 30], "prompt:", str(10 ** 30)),
    ([[1, 2], [3, 1000]], "prompt[1]:", "1000"),
    ([[-5], [1]], "prompt[0]:", "-5"),
])
def test_token_id_prompts_outside_the_vocabulary_are_a_400_naming_the_prompt(prompt, where, bad):
    request = parse_request(CompletionRequest, body(prompt=prompt))

    with pytest.raises(OpenAIError) as refused:
        request.prompts(vocab_size=1000)

    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert refused.value.message.startswith(where)
    assert f"token id {bad} is outside the vocabulary (0..999)" in refused.value.message
    assert refused.value.body()["error"]["type"] == "invalid_request_error"


def test_token_id_prompts_inside_the_vocabulary_pass():
    assert parse_request(CompletionRequest, body(prompt=[0, 999])).prompts(vocab_size=1000) == [[0, 999]]
    assert parse_request(CompletionRequest, body(prompt="-1")).prompts(vocab_size=1000) == ["-1"]


def test_an_echoed_prompts_logprobs_start_with_its_first_token_without_one():
    from pagedbackend.serving.openai.protocol import prompt_completion_logprobs
    positions = [None, {"7": {"logprob": -1.5, "rank": 3, "decoded_token": " b"},
                        "2": {"logprob": -0.5, "rank": 1, "decoded_token": " x"}}]
    out = prompt_completion_logprobs("a", positions, 1)
    assert out == {"tokens": ["a", " b"], "token_logprobs": [None, -1.5],
                   "top_logprobs": [None, {" x": -0.5, " b": -1.5}], "text_offset": [0, 1]}


def test_chat_messages_reach_the_template_as_text_with_developer_as_system():
    request = parse_request(ChatCompletionRequest, body(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]))

    messages = [m.for_template(i) for i, m in enumerate(request.messages)]

    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]


def test_image_parts_reach_the_template_as_image_parts_and_their_urls_come_in_order():
    request = parse_request(ChatCompletionRequest, body(messages=[
        {"role": "system", "content": "Look."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA",
                                                                        "detail": "high"}},
                                     {"type": "image_url", "image_url": "QkJC"}]}]))

    messages = [m.for_template(i) for i, m in enumerate(request.messages)]
    urls = [url for i, m in enumerate(request.messages) for url in m.image_urls(i)]

    assert messages[1]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]
    assert messages[0]["content"] == "Look."
    assert urls == ["data:image/png;base64,AAA", "QkJC"]


@pytest.mark.parametrize("part, words", [
    ({"type": "input_audio", "input_audio": {"data": "x"}}, ["content parts are text and image_url", "input_audio"]),
    ({"type": "image_url"}, ["image_url part", "image_url"]),
    ({"type": "image_url", "image_url": {"detail": "low"}}, ["image_url part", "url"]),
    ({"type": "text"}, ["text part", "text"]),
], ids=["audio", "no-image_url", "no-url", "no-text"])
def test_a_bad_content_part_is_refused_naming_its_place(part, words):
    request = parse_request(ChatCompletionRequest, body(messages=[{"role": "user", "content": [part]}]))

    with pytest.raises(OpenAIError) as refused:
        request.messages[0].for_template(0)

    assert refused.value.status == 400 and refused.value.param == "messages"
    assert refused.value.message.startswith("messages[0].content[0]: ")
    assert all(w in refused.value.message for w in words), refused.value.message


# ---------------------------------------------------------------- Triton responses

def triton_response(outputs: dict):
    """A ModelInferResponse as tritonserver sends it: raw little-endian contents."""
    import numpy as np
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor
    response = service_pb2.ModelInferResponse(model_name="paged_llm")
    for name, array in outputs.items():
        tensor = response.outputs.add(name=name, datatype=np_to_triton_dtype(array.dtype))
        tensor.shape.extend(array.shape)
        raw = serialize_byte_tensor(array).item() if array.dtype == np.object_ else array.tobytes()
        response.raw_output_contents.append(raw)
    return response


def test_a_triton_response_reads_as_per_output_text_tokens_reasons_and_logprobs():
    import numpy as np
    from tritonclient.grpc import InferResult

    from pagedbackend.serving.openai.triton_client import read_update
    response = triton_response({
        "text_output": np.array(["héllo".encode(), b""], dtype=np.object_),
        "finish_reason": np.array([b"None", b"length"], dtype=np.object_),
        "num_input_tokens": np.array([7], dtype=np.uint32),
        "num_output_tokens": np.array([2, 0], dtype=np.uint32),
        "cumulative_logprob": np.array([-1.5, -3.25], dtype=np.float32),
        "logprobs": np.array([TWO_TOKENS, b"null"], dtype=np.object_)})

    update = read_update(response)

    assert update.texts == ["héllo", ""] and update.reasons == [None, "length"]
    assert update.num_tokens == [2, 0] and update.num_input_tokens == 7
    assert update.logprobs == [json.loads(TWO_TOKENS), None]
    library = InferResult(response)  # tritonclient's own decoding agrees
    assert update.texts == [t.decode() for t in library.as_numpy("text_output")]
    assert update.num_tokens == library.as_numpy("num_output_tokens").tolist()


def test_a_response_with_only_text_has_no_counts_or_logprobs():
    import numpy as np

    from pagedbackend.serving.openai.triton_client import read_update
    update = read_update(triton_response({"text_output": np.array([b"a", b"b", b"c"], dtype=np.object_)}))

    assert update.texts == ["a", "b", "c"] and update.reasons == [None, None, None]
    assert update.num_tokens == [0, 0, 0] and update.num_input_tokens is None and update.logprobs is None
