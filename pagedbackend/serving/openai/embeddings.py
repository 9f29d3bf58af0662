"""``POST /v1/embeddings``, OpenAI's shape: ``input`` as a string, a list of
strings, a list of token ids or a list of token-id lists; ``dimensions``
(Matryoshka truncation, then normalisation); ``encoding_format`` ``float`` or
``base64`` (little-endian float32, as OpenAI's); ``usage``. The request is
checked here (``serving.embeddings``: shapes, the number of inputs, token-id
lengths, ``dimensions``) and sent to the Triton model as one
``embedding_request``; a model that serves generation refuses it (400 naming
``model``)."""
import base64
import json
import struct
from typing import Any, List, Literal, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from pagedbackend.serving.embeddings import EmbeddingRequest, map_embedding_request
from pagedbackend.serving.openai.offload import run_sized
from pagedbackend.serving.openai.protocol import OpenAIError, openai_checked, parse_request
from pagedbackend.serving.openai.triton_client import Triton
from pagedbackend.serving.requests import RequestLimits


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request, with vLLM's ``normalize`` beside it."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    input: Any
    dimensions: Optional[StrictInt] = None
    encoding_format: Literal["float", "base64"] = "float"
    user: Optional[str] = None
    normalize: Optional[StrictBool] = None

    def check(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise OpenAIError(400, f"dimensions must be at least 1, got {self.dimensions}", "dimensions")


def mapped(req: EmbeddingsRequest, limits: RequestLimits) -> EmbeddingRequest:
    """The checked engine request of an OpenAI body."""
    pooling = {k: v for k, v in (("dimensions", req.dimensions), ("normalize", req.normalize)) if v is not None}
    return openai_checked(map_embedding_request, {"input": req.input, "pooling_params": pooling}, limits)


def encode(vector: List[float], encoding_format: str):
    """One embedding as OpenAI writes it: floats, or base64 of little-endian float32."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def answer_body(texts: List[bytes], counts: List[int], model: str, encoding_format: str) -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": encode(json.loads(text), encoding_format)}
            for i, text in enumerate(texts)]
    tokens = sum(counts)
    return json.dumps({"object": "list", "data": data, "model": model,
                       "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                      allow_nan=False, separators=(",", ":")).encode("utf-8")


async def call_model(triton: Triton, model: str, request: EmbeddingRequest) -> Tuple[List[bytes], List[int]]:
    """Send ``request`` to ``model`` as one ``embedding_request``: one JSON
    vector per input and each input's token count; the model's refusal as a
    400 naming ``model``, ``dimensions`` or ``input``."""
    config = await triton.config(model)
    if "embedding_request" not in {i["name"] for i in config.get("input", [])}:
        raise OpenAIError(400, f"model {model} takes no embedding requests (no embedding_request input)",
                          "model")
    try:
        update = await triton.embed(model, request.wire())
    except OpenAIError as exc:
        if exc.status == 400 and exc.param is None:   # the model's refusal: its runner, dimensions, an input
            exc.param = ("model" if "runner=" in exc.message or "cross-encoder" in exc.message else
                         "dimensions" if exc.message.startswith("dimensions") else "input")
        raise
    texts = [t.encode("utf-8") for t in update.texts]
    counts = update.input_token_counts or [0] * len(texts)
    if len(texts) != len(request.inputs):
        raise OpenAIError(500, f"model {model} answered {len(texts)} embeddings for "
                               f"{len(request.inputs)} inputs")
    return texts, counts


def add_routes(app: FastAPI, triton: Triton, default_model: str, limits: RequestLimits) -> None:
    """``/v1/embeddings`` on ``app`` (behind its API key, as every /v1 route)."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await request.body()
        req = await run_sized(len(body), parse_request, EmbeddingsRequest, body)
        model = req.model or default_model
        engine_request = await run_sized(len(body), mapped, req, limits)
        texts, counts = await call_model(triton, model, engine_request)
        size = sum(len(t) for t in texts)
        return Response(await run_sized(size, answer_body, texts, counts, model, req.encoding_format),
                        media_type="application/json")
