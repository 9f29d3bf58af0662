"""The Dynamo worker's mapping of Dynamo's token requests (as the 1.6.1
frontend sends them) to our sampling parameters, and of our updates back to
Dynamo's chunks; what it cannot honour is refused by name."""
import pytest

from pagedbackend.sampling_params import SamplingParams
from pagedbackend.serving.dynamo.replica import parse_load
from pagedbackend.serving.dynamo.requests import (Unsupported, chunk, final_fields, sampling_parameters)

# A completions request as Dynamo 1.6.1's frontend hands it to a worker.
REQUEST = {
    "token_ids": [5, 6, 7],
    "stop_conditions": {"max_tokens": 5, "stop": None, "stop_token_ids": None, "stop_token_ids_visible": None,
                        "stop_token_ids_hidden": [2], "min_tokens": 2, "ignore_eos": True,
                        "max_thinking_tokens": None},
    "sampling_options": {"n": 1, "best_of": None, "presence_penalty": 0.5, "frequency_penalty": None,
                         "repetition_penalty": None, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": None,
                         "use_beam_search": None, "length_penalty": None, "seed": 3,
                         "include_stop_str_in_output": None, "guided_decoding": None},
    "output_options": {"logprobs": 2, "prompt_logprobs": None, "skip_special_tokens": None,
                       "formatted_prompt": None, "return_tokens_as_token_ids": None},
    "eos_token_ids": [2], "routing": {"dp_rank": 0, "cache_salt": "tenant"},
    "extra_args": {"nvext": {"cache_salt": "tenant"}},
}


def test_dynamo_options_become_our_sampling_parameters():
    ids, params = sampling_parameters(REQUEST, context_length=512)
    assert ids == [5, 6, 7]
    assert params == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "presence_penalty": 0.5,
                      "max_tokens": 5, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [2],
                      "logprobs": 2, "cache_salt": "dynamo-cache-salt:tenant"}
    SamplingParams.from_dict(params)   # what the replica will accept


def test_no_max_tokens_means_up_to_the_context_length():
    request = {**REQUEST, "stop_conditions": {"max_tokens": None}}
    assert sampling_parameters(request, context_length=512)[1]["max_tokens"] == 509


def test_guided_decoding_passes_as_vllms_object():
    request = {**REQUEST, "stop_conditions": {"max_tokens": 5},
               "sampling_options": {"guided_decoding": {"json": {"type": "object"}, "regex": None}}}
    params = sampling_parameters(request, 512)[1]
    assert params["guided_decoding"] == {"json": {"type": "object"}}
    assert SamplingParams.from_dict(params).structured_outputs.json == {"type": "object"}


@pytest.mark.parametrize("group,name,value,message", [
    ("sampling_options", "n", 2, "sampling_options.n: n > 1"),
    ("sampling_options", "best_of", 3, "sampling_options.best_of"),
    ("sampling_options", "use_beam_search", True, "beam search"),
    ("sampling_options", "length_penalty", 0.5, "length_penalty"),
    ("output_options", "prompt_logprobs", 1, "prompt log-probabilities"),
    ("stop_conditions", "max_thinking_tokens", 64, "thinking-token budget"),
    ("sampling_options", "mirostat", 1, "sampling_options.mirostat is not supported"),
])
def test_what_cannot_be_honoured_is_refused_by_name(group, name, value, message):
    request = {**REQUEST, group: {**REQUEST[group], name: value}}
    with pytest.raises(Unsupported, match=message):
        sampling_parameters(request, 512)


def test_harmless_defaults_of_refused_fields_pass():
    request = {**REQUEST, "sampling_options": {"n": 1, "best_of": 1, "use_beam_search": False,
                                               "length_penalty": 1.0}}
    assert sampling_parameters(request, 512)[1]["max_tokens"] == 5


def test_chunks_carry_tokens_logprobs_and_the_usage():
    entries = [{"7": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
                "9": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}}]
    out = chunk([7], entries)
    assert out["token_ids"] == [7] and out["index"] == 0 and out["log_probs"] == [-0.5]
    assert out["top_logprobs"][0][1] == {"rank": 2, "token_id": 9, "token": "b", "logprob": -1.5}
    assert final_fields("abort", 10, 3, 8) == {
        "finish_reason": "cancelled",
        "completion_usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 8}}}


def test_load_is_read_from_the_replicas_metrics():
    page = "\n".join([
        '# HELP pagedbackend:kv_blocks_used KV blocks in use.',
        'pagedbackend:kv_blocks_used{model="paged_llm",version="1"} 30',
        'pagedbackend:kv_blocks_total{model="paged_llm",version="1"} 120',
        'pagedbackend:num_requests_running{model="paged_llm",version="1"} 4',
        'pagedbackend:num_requests_waiting{model="other",version="1"} 9',
        'pagedbackend:prefix_cache_hits_total{model="paged_llm",version="1"} 48',
        'pagedbackend:prefix_cache_queries_total{model="paged_llm",version="1"} 64'])
    load = parse_load(page, "paged_llm")
    assert (load.kv_blocks_used, load.kv_blocks_total, load.num_requests_running, load.num_requests_waiting) \
        == (30, 120, 4, 0)
    assert load.kv_usage == 0.25 and load.hit_rate == 0.75
