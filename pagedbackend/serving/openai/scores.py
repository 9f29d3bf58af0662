"""A cross-encoder's scores on the OpenAI server: ``POST /rerank`` (Cohere's
and Jina's shape: ``query``, ``documents`` as strings, ``top_n``,
``return_documents``; answered with ``results`` best first) and ``POST
/score`` (vLLM's: ``text_1`` and ``text_2``, each a string or a list; one
``data`` entry per pair), also under ``/v1``. Each (query, document) pair is
one input of an ``embedding_request`` to the Triton model, which tokenises
it as a pair and answers its score (``engine.scoring``). Behind the API key
as every route; refused with a 400 naming the field: no documents, an empty
one, more pairs than ``max_embedding_inputs``, a text over
``max_prompt_chars`` or a pair over the context, a model that is no cross-encoder."""
import json
import uuid
from typing import Any, List, Optional, Tuple, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from pagedbackend.errors import InvalidRequestError
from pagedbackend.serving.embeddings import EmbeddingRequest, map_embedding_request
from pagedbackend.serving.openai.embeddings import call_model
from pagedbackend.serving.openai.offload import run_sized
from pagedbackend.serving.openai.protocol import OpenAIError, parse_request
from pagedbackend.serving.openai.triton_client import Triton
from pagedbackend.serving.requests import RequestLimits


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    query: StrictStr
    documents: List[StrictStr]
    top_n: Optional[StrictInt] = None
    return_documents: StrictBool = False

    def check(self) -> None:
        if self.top_n is not None and self.top_n < 1:
            raise OpenAIError(400, f"top_n must be at least 1, got {self.top_n}", "top_n")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    text_1: Union[StrictStr, List[StrictStr]]
    text_2: Union[StrictStr, List[StrictStr]]

    def check(self) -> None:
        """The pairs' checks need the lists as pairs (``_pairs``)."""


def _pairs(queries: List[str], documents: List[str], field: str, limits: RequestLimits) -> EmbeddingRequest:
    """The checked engine request of the pairs; a refusal names ``field`` (the documents' field)."""
    if not documents:
        raise OpenAIError(400, f"{field}: an empty list; give at least one document", field)
    for name, texts in (("query" if field == "documents" else "text_1", queries), (field, documents)):
        empty = next((i for i, t in enumerate(texts) if not t), None)
        if empty is not None:
            raise OpenAIError(400, f"{name}: item {empty} is empty" if len(texts) > 1 else f"{name} is empty", name)
    pairs = [{"text": q, "text_pair": d} for q, d in zip(queries, documents)]
    try:
        return map_embedding_request({"input": pairs}, limits)
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc).replace("input", field, 1).replace("prompt", "text", 1), field) from None


async def _scores(triton: Triton, model: str, request: EmbeddingRequest, field: str) -> Tuple[List[float], int]:
    try:
        texts, counts = await call_model(triton, model, request)
    except OpenAIError as exc:
        if exc.param == "input":
            exc.param, exc.message = field, exc.message.replace("input", field, 1)
        raise
    return [float(json.loads(t)[0]) for t in texts], sum(counts)


def _body(value: Any) -> bytes:
    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode("utf-8")


def add_routes(app: FastAPI, triton: Triton, default_model: str, limits: RequestLimits) -> None:
    """``/rerank`` and ``/score`` (and their ``/v1`` twins) on ``app``."""

    async def rerank(request: Request):
        body = await request.body()
        req = await run_sized(len(body), parse_request, RerankRequest, body)
        model = req.model or default_model
        engine_request = _pairs([req.query] * len(req.documents), req.documents, "documents", limits)
        scores, tokens = await _scores(triton, model, engine_request, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or len(scores)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
        return Response(_body({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                               "usage": {"total_tokens": tokens}}), media_type="application/json")

    async def score(request: Request):
        body = await request.body()
        req = await run_sized(len(body), parse_request, ScoreRequest, body)
        model = req.model or default_model
        first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise OpenAIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}; give one text_1 "
                                   "or as many as text_2", "text_1")
        scores, tokens = await _scores(triton, model, _pairs(first, second, "text_2", limits), "text_2")
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return Response(_body({"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
                               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                        media_type="application/json")

    for path in ("/rerank", "/v1/rerank"):
        app.post(path)(rerank)
    for path in ("/score", "/v1/score"):
        app.post(path)(score)
