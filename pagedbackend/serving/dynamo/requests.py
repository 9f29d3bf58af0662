"""Dynamo's token request in, our sampling parameters out; our updates back as
Dynamo's response chunks. Pure data: no Dynamo import, so it is tested alone.

Dynamo's frontend tokenises, applies the chat template, detokenises and
matches stop strings itself; a worker gets token ids, ``sampling_options``,
``stop_conditions`` and ``output_options`` and answers with token ids. The
options become sampling parameters in ``pagedbackend.serving.requests`` (the
one mapping of every front end); what we cannot honour is refused by name
(``Unsupported``), never dropped.
"""
from typing import Any, Dict, List, Optional, Tuple

from pagedbackend.errors import InvalidRequestError
from pagedbackend.serving.requests import RequestLimits, dynamo_fields, map_request


class Unsupported(ValueError):
    """The request asks for something this worker cannot honour (a 400)."""


def sampling_parameters(request: Dict[str, Any], context_length: int,
                        limits: Optional[RequestLimits] = None) -> Tuple[List[int], Dict[str, Any]]:
    """The prompt's token ids and vLLM-named sampling parameters (JSON for the
    model's ``sampling_parameters`` input), checked by ``map_request`` (the
    request limits, the context length); raises Unsupported by name."""
    limits = limits or RequestLimits(max_model_len=context_length)
    try:
        token_ids, fields = dynamo_fields(request, context_length)
        return token_ids, map_request(fields, [token_ids], limits).wire()
    except InvalidRequestError as exc:
        raise Unsupported(str(exc)) from None


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
