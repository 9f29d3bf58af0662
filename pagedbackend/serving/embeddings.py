"""The one mapping of an embedding request, on every front end: vllm_backend's
``embedding_request`` JSON (``{"input": ..., "pooling_params": {...}}``, also
what the OpenAI server sends to the Triton model) to the engine's prompts and
``PoolingParams``, checked against ``RequestLimits`` before any work is queued.

``input`` is a string, a list of token ids, a list of strings or a list of
token-id lists (OpenAI's four shapes), or a list of text pairs
``{"text": query, "text_pair": document}`` (a cross-encoder's scores:
``/rerank``, ``/score``); ``pooling_params`` takes
``dimensions`` (a number, or vllm_backend's one-element list), ``normalize``
and ``pooling_type``. Pure data: no network, no Triton, no tokenizer.
"""
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from pagedbackend.errors import InvalidRequestError
from pagedbackend.pooling_params import PoolingParams
from pagedbackend.serving.requests import Prompt, RequestLimits


@dataclass
class EmbeddingRequest:
    """The checked request: its prompts in order and their pooling."""
    inputs: List[Prompt]
    pooling: PoolingParams

    def wire(self) -> Dict[str, Any]:
        """As the ``embedding_request`` input carries it to the Triton model."""
        params = {k: v for k, v in vars(self.pooling).items() if v is not None}
        return {"input": self.inputs, "pooling_params": params}


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _is_pair(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"text", "text_pair"}
            and all(isinstance(v, str) for v in value.values()))


def embedding_inputs(value) -> List[Prompt]:
    """OpenAI's ``input`` as a list of prompts; a shape it does not take is
    refused, naming ``input``."""
    def refuse(message: str):
        raise InvalidRequestError(f"input: {message}", param="input")
    if isinstance(value, str):
        inputs = [value]
    elif isinstance(value, list) and value and _is_ids(value):
        inputs = [value]
    elif isinstance(value, list):
        if not value:
            refuse("an empty list; give at least one string or token id list")
        inputs = value
        for i, item in enumerate(inputs):
            if not (isinstance(item, str) or _is_ids(item) or _is_pair(item)):
                refuse(f"item {i} is neither a string, a list of token ids nor a text pair")
    else:
        refuse("must be a string, a list of strings, a list of token ids or a list of token id lists")
    for i, item in enumerate(inputs):
        if not item or (isinstance(item, dict) and not all(item.values())):
            refuse(f"item {i} is empty" if len(inputs) > 1 else "it is empty")
    return inputs


def pooling_params(values: Optional[Mapping[str, Any]]) -> PoolingParams:
    """``pooling_params`` as ``PoolingParams``; vllm_backend sends ``dimensions`` as a one-element list."""
    values = dict(values or {})
    dims = values.get("dimensions")
    if isinstance(dims, list):
        if len(dims) != 1:
            raise InvalidRequestError(f"dimensions: one number, got {dims!r}", param="dimensions")
        values["dimensions"] = dims[0]
    try:
        return PoolingParams.from_dict(values)
    except InvalidRequestError as exc:
        name = next((k for k in ("dimensions", "normalize", "pooling_type") if str(exc).startswith(k)),
                    "pooling_params")
        raise InvalidRequestError(str(exc), param=name) from None


def map_embedding_request(body: Mapping[str, Any], limits: RequestLimits) -> EmbeddingRequest:
    """The checked request of an ``embedding_request`` object: its inputs' shape,
    their count (``max_embedding_inputs``), each one's length (``max_model_len``
    for token ids, ``max_prompt_chars`` for text) and the pooling parameters."""
    if not isinstance(body, Mapping) or "input" not in body:
        raise InvalidRequestError("input is required", param="input")
    unknown = sorted(set(body) - {"input", "pooling_params"})
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {', '.join(map(repr, unknown))} in the embedding request; "
                                  "known: input, pooling_params", param=unknown[0])
    inputs = embedding_inputs(body["input"])
    if len(inputs) > limits.max_embedding_inputs:
        raise InvalidRequestError(f"input: {len(inputs)} inputs; the limit is {limits.max_embedding_inputs} "
                                  "(request limit max_embedding_inputs)", param="input")
    for i, item in enumerate(inputs):
        try:
            for text in (item.values() if isinstance(item, dict) else (item,)):
                limits.check_prompt(text)
        except InvalidRequestError as exc:
            where = f"item {i}: " if len(inputs) > 1 else ""
            raise InvalidRequestError(f"input: {where}{str(exc).replace('prompt', 'input', 1)}",
                                      param="input") from None
    return EmbeddingRequest(inputs, pooling_params(body.get("pooling_params")))


def parse_embedding_request(text: str, limits: RequestLimits) -> EmbeddingRequest:
    """``map_embedding_request`` of the ``embedding_request`` tensor's JSON text."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"embedding_request is not valid JSON: {exc}", param="input") from None
    return map_embedding_request(body, limits)


def check_runner(runner: str, wanted: str) -> None:
    """Refuse a request of the kind the model does not serve (``EngineConfig.runner``)."""
    if runner == wanted:
        return
    if wanted == "pooling":
        raise InvalidRequestError("this model serves text generation (runner=generate), not embeddings; "
                                  "serve an embedding model with runner=pooling", param="model")
    raise InvalidRequestError("this model serves embeddings (runner=pooling), not text generation; "
                              "use /v1/embeddings or the embedding_request input", param="model")
