"""Dynamo's token request in, our sampling parameters out; our updates back as
Dynamo's response chunks. Pure data: no Dynamo import, so it is tested alone.

Dynamo's frontend tokenises, applies the chat template, detokenises and
matches stop strings itself; a worker gets token ids, ``sampling_options``,
``stop_conditions`` and ``output_options`` and answers with token ids. What
we cannot honour is refused by name (``Unsupported``), never dropped.
"""
from typing import Any, Dict, List, Optional, Tuple

# Dynamo's vLLM worker hands the cache salt to vLLM with this tag, and Dynamo's
# KV-event reader takes the salt back from the tag in a block's extra keys, so
# salted blocks land in the router's namespace of that salt.
CACHE_SALT_TAG = "dynamo-cache-salt:"

# sampling_options that map one to one onto our (vLLM's) sampling parameters.
SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty")
# What we cannot honour, and why (a request setting one is refused).
REFUSED = {
    "n": "n > 1 is not served through the fleet (one output per request)",
    "best_of": "best_of > 1 is not served through the fleet",
    "use_beam_search": "beam search is not served through the fleet",
    "prompt_logprobs": "prompt log-probabilities are not served through the fleet",
    "max_thinking_tokens": "a thinking-token budget is not supported",
    "length_penalty": "length_penalty applies to beam search, which the fleet does not serve",
}
# Values of refused fields that ask for nothing (clients send them anyway).
HARMLESS = {"n": 1, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0}
# Fields read elsewhere or handled by Dynamo's frontend (stop strings, detokenising).
HANDLED = {"stop", "include_stop_str_in_output", "skip_special_tokens", "formatted_prompt",
           "return_tokens_as_token_ids", "guided_decoding", "logprobs", "max_tokens", "min_tokens",
           "ignore_eos", "stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"}


class Unsupported(ValueError):
    """The request asks for something this worker cannot honour (a 400)."""


def _refuse_unknown(group: str, values: Dict[str, Any]) -> None:
    for name, value in values.items():
        if value is None or name in HANDLED or name in SAME_NAME:
            continue
        if name in REFUSED:
            if name not in HARMLESS or value != HARMLESS[name]:
                raise Unsupported(f"{group}.{name}: {REFUSED[name]}")
        elif value not in (False, [], {}):
            raise Unsupported(f"{group}.{name} is not supported by this worker")


def cache_salt(request: Dict[str, Any]) -> Optional[str]:
    """The request's cache salt (``nvext.cache_salt`` or the top-level field)."""
    extra = request.get("extra_args") or {}
    for source in (request.get("nvext"), extra.get("nvext") if isinstance(extra, dict) else None,
                   request.get("routing")):
        if isinstance(source, dict) and source.get("cache_salt"):
            return str(source["cache_salt"])
    return None


def sampling_parameters(request: Dict[str, Any], context_length: int) -> Tuple[List[int], Dict[str, Any]]:
    """The prompt's token ids and vLLM-named sampling parameters (JSON for the
    model's ``sampling_parameters`` input). Raises Unsupported by name."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise Unsupported("token_ids: a non-empty list of token ids is required")
    sampling = request.get("sampling_options") or {}
    stop = request.get("stop_conditions") or {}
    output = request.get("output_options") or {}
    for group, values in (("sampling_options", sampling), ("stop_conditions", stop),
                          ("output_options", output)):
        _refuse_unknown(group, values)
    params: Dict[str, Any] = {name: sampling[name] for name in SAME_NAME if sampling.get(name) is not None}
    max_tokens = stop.get("max_tokens")
    params["max_tokens"] = max(1, context_length - len(token_ids)) if max_tokens is None else max_tokens
    for name in ("min_tokens", "ignore_eos"):
        if stop.get(name) is not None:
            params[name] = stop[name]
    stop_ids = set()
    for name in ("stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"):
        stop_ids.update(stop.get(name) or ())
    if stop_ids:
        params["stop_token_ids"] = sorted(stop_ids)
    if output.get("logprobs") is not None:
        params["logprobs"] = output["logprobs"]
    guided = sampling.get("guided_decoding")
    if guided:
        params["guided_decoding"] = {k: v for k, v in guided.items() if v is not None}
    salt = cache_salt(request)
    if salt:
        params["cache_salt"] = CACHE_SALT_TAG + salt
    return token_ids, params


def chunk(token_ids: List[int], logprobs: Optional[list] = None) -> Dict[str, Any]:
    """One streamed chunk; with log-probabilities (our per-token entries,
    the sampled token first) in Dynamo's ``log_probs`` / ``top_logprobs``."""
    out: Dict[str, Any] = {"token_ids": list(token_ids), "index": 0}
    if logprobs:
        chosen, tops = [], []
        for token, entries in zip(token_ids, logprobs):
            entries = entries or {}
            mine = entries.get(str(token)) or entries.get(token) or {}
            chosen.append(mine.get("logprob", 0.0))
            tops.append([{"rank": e.get("rank"), "token_id": int(t), "token": e.get("decoded_token"),
                          "logprob": e.get("logprob")} for t, e in entries.items()])
        out["log_probs"], out["top_logprobs"] = chosen, tops
    return out


def final_fields(finish_reason: str, prompt_tokens: int, completion_tokens: int,
                 cached_tokens: Optional[int]) -> Dict[str, Any]:
    """What the last chunk adds: why it ended and the usage (cached prompt tokens too)."""
    usage: Dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return {"finish_reason": {"abort": "cancelled"}.get(finish_reason, finish_reason), "completion_usage": usage}
