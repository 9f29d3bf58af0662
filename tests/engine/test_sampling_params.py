"""Sampling parameters: every field checked at construction, with errors that
name the parameter and what it accepts; vLLM's names and JSON forms accepted."""
import json
import math

import pytest

from pagedbackend import InvalidRequestError, SamplingParams
from pagedbackend.sampling_params import MAX_LOGPROBS


@pytest.mark.parametrize("fields, message", [
    ({"logprobs": 1_000_000}, f"logprobs must be an integer in \\[0, {MAX_LOGPROBS}\\]"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs must be an integer in"),
    ({"logprobs": -1}, "logprobs must be an integer in"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": -0.5}, "temperature must be in \\[0, inf\\]"),
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"min_p": 1.5}, "min_p must be in \\[0, 1\\]"),
    ({"top_k": -2}, "top_k must be -1"),
    ({"top_k": True}, "top_k must be -1"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in \\[-2, 2\\]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in \\[-2, 2\\]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in \\(0, inf\\]"),
    ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
    ({"n": 0}, "n must be an integer >= 1"),
    ({"n": True}, "n must be an integer >= 1"),
    ({"n": 2, "best_of": 1, "temperature": 1.0}, "best_of must be an integer >= n"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens \\(5\\) must not exceed max_tokens \\(4\\)"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"stop": [""]}, "stop must be a non-empty string"),
    ({"stop": ["ok", 3]}, "stop must be a non-empty string"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of non-negative integers"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of non-negative integers"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"logit_bias": {"x": 1}}, "logit_bias: 'x' is not a token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias: the bias of token 5 must be a number in \\[-100, 100\\]"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias: the bias of token 5"),
    ({"bad_words": "no"}, "bad_words must be a list of non-empty strings"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"ignore_eos": 3}, "ignore_eos must be true or false"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "repetition_penalty": 1.2},
     "beam search does not combine with penalties"),
    ({"temperature": 0.0, "best_of": 2}, "best_of \\(2\\) > n \\(1\\) needs temperature > 0"),
    ({"length_penalty": 0.8}, "length_penalty \\(0.8\\) applies to beam search only"),
    ({"early_stopping": True}, "early_stopping applies to beam search only"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "early_stopping": "always"},
     'early_stopping must be true, false or "never"'),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "logprobs": 1},
     "logprobs are not returned with beam search"),
])
def test_invalid_values_are_refused_naming_the_parameter(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize("payload, message", [
    ({"temperature": "NaN"}, "temperature must be a finite number"),
    ({"max_tokens": "many"}, "sampling parameter max_tokens: expected int, got 'many'"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"lora_name": "adapter-1"}, "sampling parameter lora_name: an adapter is chosen per request"),
    ({"guided_json": {"type": "object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs and the older guided_\\* fields must not both be set"),
    ({"response_format": {"type": "json_object"}}, "response_format is an OpenAI API field"),
    ({"detokenize": False}, "detokenize is only supported at its default \\(true\\)"),
    ({"colour": "blue"}, "unknown sampling parameter\\(s\\): colour"),
    ([1, 2], "sampling parameters must be a JSON object, got list"),
])
def test_json_payloads_are_refused_with_a_clear_message(payload, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams.from_dict(payload)


def test_json_forms_of_vllm_parameters_are_accepted():
    params = SamplingParams.from_dict({
        "temperature": "0.5", "max_tokens": "7", "ignore_eos": "true", "logit_bias": {"12": -3, "40": 2.5},
        "presence_penalty": 0.5, "frequency_penalty": 1, "repetition_penalty": 1.2,
        "bad_words": ["foo"], "allowed_token_ids": [1, 2, 3], "truncate_prompt_tokens": 8,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "seed": 3.0,
        # vLLM defaults that clients send along are accepted as they are.
        "detokenize": True, "spaces_between_special_tokens": True, "lora_name": None,
    })
    assert params.temperature == 0.5 and params.max_tokens == 7 and params.ignore_eos is True
    assert params.logit_bias == {12: -3.0, 40: 2.5} and params.seed == 3
    assert params.has_penalties and params.has_logits_processing


def test_sampling_parameters_json_that_is_not_json_names_the_input():
    with pytest.raises(InvalidRequestError, match="sampling_parameters is not valid JSON"):
        SamplingParams.from_json("{max_tokens: 3")
    with pytest.raises(InvalidRequestError, match="sampling_parameters nests deeper than"):
        SamplingParams.from_json("[" * 100_000)


def test_token_ids_are_checked_against_the_vocabulary():
    params = SamplingParams(stop_token_ids=[3, 1_000_000_000])
    with pytest.raises(InvalidRequestError, match="stop_token_ids: token id 1000000000 is outside the vocabulary"):
        params.check_token_ids(49152)
    with pytest.raises(InvalidRequestError, match="logit_bias: token id 49152 is outside"):
        SamplingParams(logit_bias={49152: 1.0}).check_token_ids(49152)
    SamplingParams(allowed_token_ids=[0, 49151]).check_token_ids(49152)   # the edges are inside


def test_defaults_need_no_logits_processing():
    params = SamplingParams()
    assert not params.has_penalties and not params.has_logits_processing
    assert params.top_k == -1 and SamplingParams(top_k=0).top_k == -1
    assert math.isclose(params.temperature, 1.0)


def test_greedy_with_several_outputs_is_accepted_as_openai_does():
    params = SamplingParams(n=3, temperature=0.0)
    assert params.best_of == 3 and params.is_greedy


def test_beam_search_takes_every_early_stopping_value_of_hugging_face():
    for value, expected in ((True, True), (False, False), ("never", "never"), ("false", False)):
        params = SamplingParams.from_dict({"use_beam_search": True, "best_of": 2, "temperature": 0,
                                           "early_stopping": value})
        assert params.early_stopping == expected


@pytest.mark.parametrize("fields, words", [
    ({"cache_salt": ""}, "cache_salt must be a non-empty string"),
    ({"cache_salt": 5}, "cache_salt must be a non-empty string"),
    ({"priority": True}, "priority: expected int, got True"),
    ({"priority": 1.5}, "priority must be an integer"),
])
def test_a_salt_must_be_non_empty_text_and_a_priority_an_integer_as_sent_to_triton(fields, words):
    with pytest.raises(InvalidRequestError, match=words):
        SamplingParams.from_json(json.dumps(fields))


def test_a_salt_is_taken_as_sent_never_read_as_no_salt():
    assert SamplingParams.from_dict({"cache_salt": "none"}).cache_salt == "none"
    assert SamplingParams.from_dict({"cache_salt": " a "}).cache_salt == " a "
    assert SamplingParams.from_dict({"priority": "-3"}).priority == -3
