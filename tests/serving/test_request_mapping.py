"""The one request mapping (``pagedbackend.serving.requests``): equivalent
requests from the OpenAI API, Triton's tensors, Triton's generate parameters
and Dynamo give identical ``SamplingParams``; each request limit refuses by
the field's name. No server: the front ends' own parsing, then ``map_request``."""
import json

import pytest

from pagedbackend.errors import InvalidRequestError
from pagedbackend.sampling_params import SamplingParams
from pagedbackend.serving.dynamo.requests import Unsupported
from pagedbackend.serving.dynamo.requests import sampling_parameters as dynamo_parameters
from pagedbackend.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, map_openai,
                                                  parse_request, sampling_parameters)
from pagedbackend.serving.requests import (EngineRequest, RequestLimits, dynamo_fields, map_request,
                                           model_context_length, triton_fields)

LIMITS = RequestLimits(max_model_len=512)
# One request, as each front end's client writes it.
COMMON = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 3, "presence_penalty": 0.5,
          "frequency_penalty": -0.25, "repetition_penalty": 1.1, "max_tokens": 7, "min_tokens": 2,
          "ignore_eos": True, "stop_token_ids": [2, 9], "logprobs": 2}


def from_openai_completion(fields: dict, prompt="Hi") -> EngineRequest:
    req = parse_request(CompletionRequest, json.dumps({"prompt": prompt, **fields}).encode())
    return map_openai(sampling_parameters(req, req.max_tokens, req.logprobs), req.prompts(), LIMITS)


def from_openai_chat(fields: dict) -> EngineRequest:
    fields = dict(fields)
    top = fields.pop("logprobs", None)
    req = parse_request(ChatCompletionRequest, json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}], **fields,
         **({"logprobs": True, "top_logprobs": top} if top is not None else {})}).encode())
    return map_openai(sampling_parameters(req, req.max_completion_tokens or req.max_tokens, req.top_logprobs),
                      ["Hi"], LIMITS)


def from_triton_tensor(fields: dict, prompt="Hi") -> EngineRequest:
    return map_request(triton_fields(json.dumps(fields)), [prompt], LIMITS)


def from_triton_generate(fields: dict, prompt="Hi") -> EngineRequest:
    """The generate endpoint's request parameters: scalars, lists as JSON text, Triton's own fields beside."""
    parameters = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in fields.items()}
    return map_request(triton_fields(None, json.dumps({**parameters, "priority": 0, "timeout": 100})),
                       [prompt], LIMITS)


def from_dynamo(fields: dict, token_ids=(5, 6, 7)) -> EngineRequest:
    sampling = {k: fields[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                       "frequency_penalty", "repetition_penalty")}
    stop = {"max_tokens": fields["max_tokens"], "min_tokens": fields["min_tokens"],
            "ignore_eos": fields["ignore_eos"], "stop_token_ids_hidden": fields["stop_token_ids"]}
    request = {"token_ids": list(token_ids), "sampling_options": sampling, "stop_conditions": stop,
               "output_options": {"logprobs": fields["logprobs"]}}
    ids, wire = dynamo_fields(request, 512)
    return map_request(wire, [ids], LIMITS)


def test_every_front_end_maps_an_equivalent_request_to_the_same_sampling_params():
    mapped = {name: front(COMMON) for name, front in (
        ("openai-completion", from_openai_completion), ("openai-chat", from_openai_chat),
        ("triton-tensor", from_triton_tensor), ("triton-generate", from_triton_generate),
        ("dynamo", from_dynamo))}

    expected = SamplingParams(**COMMON)
    for name, request in mapped.items():
        assert request.params == expected, name
        assert request.lora_name is None and request.multi_modal_data is None, name
    assert mapped["triton-tensor"].prompt == "Hi" and mapped["dynamo"].prompt == [5, 6, 7]


def test_the_openai_wire_object_maps_to_the_same_params_on_the_triton_side():
    """What the OpenAI server sends to the model is mapped again there, to the same parameters."""
    fields = {**COMMON, "stop": ["\n", "END"], "logit_bias": {"7": 2.5}, "priority": -3, "cache_salt": "t",
              "n": 2, "best_of": 3, "bad_words": ["no"]}
    sent = from_openai_completion(fields)
    wire = {**sent.wire(), "lora_name": "adapter"}

    received = from_triton_tensor(wire)

    assert received.params == sent.params and received.lora_name == "adapter"
    assert received.params.priority == -3 and received.params.logit_bias == {7: 2.5}


def test_lora_name_travels_beside_the_parameters_and_must_be_text():
    assert from_triton_tensor({"lora_name": "sql", "max_tokens": 3}).lora_name == "sql"
    assert from_triton_generate({"lora_name": "sql", "max_tokens": 3}).lora_name == "sql"
    with pytest.raises(InvalidRequestError, match="lora_name must be a string") as refused:
        from_triton_tensor({"lora_name": 5})
    assert refused.value.param == "lora_name"


def test_triton_json_that_is_not_an_object_or_not_json_is_refused_by_name():
    with pytest.raises(InvalidRequestError, match="sampling_parameters is not valid JSON"):
        triton_fields("{max_tokens: 3")
    with pytest.raises(InvalidRequestError, match="nests deeper"):
        triton_fields("[" * 100_000)
    with pytest.raises(InvalidRequestError, match="must be a JSON object"):
        map_request(triton_fields("[1, 2]"))


# ---------------------------------------------------------------- limits

@pytest.mark.parametrize("fields, param, words", [
    ({"n": 1_000_000}, "n", ["1000000", "limit is 128"]),
    ({"n": 2, "best_of": 1_000_000, "temperature": 1.0}, "best_of", ["limit is 128"]),
    ({"use_beam_search": True, "best_of": 1000, "temperature": 0.0}, "best_of", ["limit is 128"]),
    ({"stop": ["x%d" % i for i in range(100_000)]}, "stop", ["100000 stop strings"]),
    ({"stop": ["x" * 5000]}, "stop", ["5000 characters"]),
    ({"bad_words": ["w%d" % i for i in range(500)]}, "bad_words", ["500 bad words"]),
    ({"stop_token_ids": list(range(5000))}, "stop_token_ids", ["5000"]),
    ({"logit_bias": {str(i): 1.0 for i in range(5000)}}, "logit_bias", ["5000 entries"]),
    ({"max_tokens": 10 ** 12}, "max_tokens", ["context length (512"]),
    ({"seed": 1 << 70}, "seed", ["64-bit"]),
    ({"priority": -(1 << 64)}, "priority", ["64-bit"]),
    ({"top_k": 1 << 64}, "top_k", ["64-bit"]),
    ({"cache_salt": "s" * 5000}, "cache_salt", ["5000 characters"]),
    ({"structured_outputs": {"regex": "a" * 60_000}}, "structured_outputs", ["bytes of JSON"]),
], ids=["n", "best_of", "beam-width", "stop-count", "stop-length", "bad-words", "stop-token-ids",
        "logit-bias", "max-tokens", "seed-overflow", "priority-overflow", "top-k-overflow", "cache-salt",
        "structured-size"])
def test_each_limit_is_refused_naming_its_field(fields, param, words):
    with pytest.raises(InvalidRequestError) as refused:
        map_request(fields, ["Hi"], LIMITS)

    assert refused.value.param == param
    assert str(refused.value).startswith(param) and all(w in str(refused.value) for w in words), refused.value


def test_a_prompt_beyond_the_context_or_the_character_limit_is_refused_before_tokenising():
    limits = LIMITS.replace(max_prompt_chars=100)
    with pytest.raises(InvalidRequestError, match="prompt has 600 tokens") as refused:
        map_request({}, [list(range(600))], limits)
    assert refused.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="prompt has 101 characters"):
        map_request({}, ["x" * 101], limits)
    assert map_request({}, [list(range(512)), "x" * 100], limits).prompts[0] == list(range(512))


def test_tools_are_bounded_in_count_and_size():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(InvalidRequestError, match="129 tools; the limit is 128") as refused:
        LIMITS.check_tools([tool] * 129)
    assert refused.value.param == "tools"
    big = {"type": "function", "function": {"name": "f", "description": "d" * 40_000}}
    with pytest.raises(InvalidRequestError, match="bytes of JSON"):
        LIMITS.check_tools([big])
    LIMITS.check_tools([tool] * 128)


def test_the_openai_api_gives_a_limit_as_a_400_naming_the_field():
    with pytest.raises(OpenAIError) as refused:
        from_openai_completion({"stop": ["s"] * 65})
    assert refused.value.status == 400 and refused.value.param == "stop"
    with pytest.raises(OpenAIError) as refused:   # a SamplingParams refusal, named from its message
        from_openai_completion({"stop": [""]})
    assert refused.value.param == "stop"


def test_limits_are_settings_refusing_unknown_names_and_non_positive_values():
    assert RequestLimits.from_settings({"MAX_N": "4", "max_stop_strings": 2}).max_n == 4
    with pytest.raises(ValueError, match="unknown request limit 'max_colour'"):
        RequestLimits.from_settings({"max_colour": "1"})
    with pytest.raises(ValueError, match="max_n must be a positive integer"):
        RequestLimits(max_n=0)
    with pytest.raises(InvalidRequestError, match="n: 5 outputs; the limit is 4"):
        map_request({"n": 5, "temperature": 1.0}, ["Hi"], RequestLimits(max_n=4))


def test_dynamo_requests_go_through_the_same_limits():
    request = {"token_ids": [1, 2], "stop_conditions": {"max_tokens": 10 ** 12}}
    with pytest.raises(Unsupported, match="max_tokens: .* context length"):
        dynamo_parameters(request, context_length=512)


def test_the_context_length_of_a_model_folder_includes_its_rope_scaling(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 4096}}))
    assert model_context_length(tmp_path) == 16384
    assert model_context_length(tmp_path / "missing") is None


def test_images_ride_with_a_text_prompt_as_vllms_prompt_dict_within_the_images_per_prompt_limit():
    limits = LIMITS.replace(max_images=2)

    mapped = map_request({"max_tokens": 4}, ["<image> Hi"], limits, ["aGk=", "aGk="])
    plain = map_request({"max_tokens": 4}, ["Hi"], limits)

    assert mapped.engine_prompt() == {"prompt": "<image> Hi", "multi_modal_data": {"image": ["aGk=", "aGk="]}}
    assert plain.engine_prompt() == "Hi" and plain.multi_modal_data is None
    with pytest.raises(InvalidRequestError, match="3 images; the limit is 2 per prompt") as refused:
        map_request({}, ["Hi"], limits, ["aGk="] * 3)
    assert refused.value.param == "image"
    with pytest.raises(InvalidRequestError, match="a prompt of token ids takes none"):
        map_request({}, [[1, 2, 3]], limits, ["aGk="])
