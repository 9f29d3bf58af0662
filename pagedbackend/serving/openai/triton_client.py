"""The Triton side of the OpenAI server: one gRPC stream per prompt to the
decoupled text model (``tritonclient.grpc.aio``), read as updates that carry
each output's new text, tokens, finish reason and logprobs, and cancelled at
once when the HTTP client goes away.
"""
import asyncio
import json
import struct
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, List, Optional, Sequence, Tuple

import grpc
import numpy as np
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from pagedbackend.errors import GRAMMAR_DEAD_END
from pagedbackend.serving.constants import GRPC_ADMIN_HEADER, IMAGES_BUSY
from pagedbackend.serving.security import GRPC_API_KEY_HEADER, redact
from pagedbackend.serving.openai.protocol import OpenAIError, parse_logprobs

# Messages the model sends when it, not the request, failed (model.py).
SERVER_FAILURES = ("could not start the request", "engine failed")
CONFIG_TTL_S = 30.0


class ClientGone(Exception):
    """The HTTP client disconnected; its Triton requests were cancelled."""


@dataclass
class Update:
    """One Triton response: per output index, the new text and tokens."""
    texts: List[str]
    reasons: List[Optional[str]]
    num_tokens: List[int]
    num_input_tokens: Optional[int]
    logprobs: Optional[List[Optional[list]]]
    num_cached_tokens: Optional[int] = None   # prompt tokens found in the prefix cache
    prompt_logprobs: Optional[list] = None    # per prompt token (None first), once computed
    token_ids: Optional[List[List[int]]] = None   # per output index, its new token ids (output_ids)
    input_token_counts: Optional[List[int]] = None   # every element of num_input_tokens (one per embedding input)


_NUMBERS = {"UINT32": "I", "INT32": "i", "UINT64": "Q", "INT64": "q", "FP32": "f"}


def _elements(datatype: str, raw: bytes) -> list:
    """A tensor's elements from Triton's raw little-endian encoding (BYTES:
    each element as a 4-byte length and its bytes)."""
    if datatype == "BYTES":
        out, at = [], 0
        while at < len(raw):
            (size,) = struct.unpack_from("<I", raw, at)
            out.append(raw[at + 4:at + 4 + size])
            at += 4 + size
        return out
    if datatype not in _NUMBERS:
        raise ValueError(f"unexpected output datatype {datatype}")
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(_NUMBERS[datatype])}{_NUMBERS[datatype]}", raw))


def read_update(response) -> Update:
    """A ModelInferResponse as an Update, read straight from its raw outputs
    (a few times faster than through numpy, and this runs once per token)."""
    if len(response.raw_output_contents) != len(response.outputs):
        raise ValueError("the response has no raw output contents")
    outputs = {o.name: _elements(o.datatype, raw)
               for o, raw in zip(response.outputs, response.raw_output_contents)}
    texts = [t.decode("utf-8", "replace") for t in outputs.get("text_output", [])]
    reasons = [r.decode("utf-8", "replace") for r in outputs.get("finish_reason", [])] or [None] * len(texts)
    prompt_tokens = outputs.get("num_input_tokens")
    cached = outputs.get("num_cached_tokens")
    logprobs = outputs.get("logprobs")
    prompt_logprobs = outputs.get("prompt_logprobs")
    ids = outputs.get("output_ids")
    if ids is not None:   # [outputs, width], padded with -1
        shape = next(list(o.shape) for o in response.outputs if o.name == "output_ids")
        width = shape[1] if len(shape) == 2 else len(ids)
        ids = [[t for t in ids[r * width:(r + 1) * width] if t >= 0] for r in range(len(ids) // width if width else 0)]
    return Update(texts, [None if r in (None, "", "None") else r for r in reasons],
                  outputs.get("num_output_tokens", [0] * len(texts)),
                  prompt_tokens[0] if prompt_tokens else None,
                  None if logprobs is None else [parse_logprobs(e) for e in logprobs],
                  cached[0] if cached else None,
                  parse_logprobs(prompt_logprobs[0]) if prompt_logprobs else None, ids, prompt_tokens)


def _input(name: str, value) -> "aioclient.InferInput":
    array = np.array([value.encode("utf-8") if isinstance(value, str) else value],
                     dtype=np.object_ if isinstance(value, str) else np.bool_)
    tensor = aioclient.InferInput(name, [1], "BYTES" if array.dtype == np.object_ else "BOOL")
    tensor.set_data_from_numpy(array)
    return tensor


# The BOOL inputs every request sends, built once (tritonclient copies them into each request).
FLAGS = [_input(name, True) for name in ("stream", "exclude_input_in_output", "return_finish_reason",
                                         "return_num_input_tokens", "return_num_output_tokens")]
RETURN_LOGPROBS = _input("return_logprobs", True)
RETURN_CACHED = _input("return_num_cached_tokens", True)
RETURN_PROMPT_LOGPROBS = _input("return_prompt_logprobs", True)
RETURN_OUTPUT_IDS = _input("return_output_ids", True)


def _ids_input(ids: List[int]) -> "aioclient.InferInput":
    tensor = aioclient.InferInput("input_ids", [len(ids)], "INT64")
    tensor.set_data_from_numpy(np.array(ids, dtype=np.int64))
    return tensor


class TritonStream:
    """The responses of one streamed Triton request; ``cancel`` ends it on the server.

    An error before the first response is the model refusing the request (400
    unless the model says it failed); after it, the request failed (500),
    unless it is a refusal of a request that has run (``GRAMMAR_DEAD_END``)."""

    def __init__(self, call, model: str):
        self.call, self.model = call, model
        self.started = self.done = self.cancelled = False
        self.cancel_reason: Optional[str] = None   # set when the server, not the client, ended it

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self.done:
            if self.cancel_reason is not None:
                raise OpenAIError(503, self.cancel_reason)
            raise StopAsyncIteration
        try:
            result, error = await self.call.__anext__()
        except (StopAsyncIteration, asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
            self.done = True
            if self.cancel_reason is not None:
                raise OpenAIError(503, self.cancel_reason) from None
            if self.cancelled:
                raise ClientGone() from None
            if isinstance(exc, StopAsyncIteration):
                raise OpenAIError(500, f"model {self.model} ended the stream without a final response") from None
            if isinstance(exc, grpc.aio.AioRpcError):
                status = 503 if exc.code() == grpc.StatusCode.UNAVAILABLE else 500
                raise OpenAIError(status, f"Triton failed the request: {redact(exc.details() or '')}") from None
            raise
        if error is not None:
            self.done = True
            message = redact(error.message() or str(error))
            if "unknown model" in message.lower():
                raise OpenAIError(404, f"model {self.model} is not ready on Triton: {message}",
                                  "model", "model_not_found")
            if message.startswith(IMAGES_BUSY):
                raise OpenAIError(503, message)
            failed = (self.started and not message.startswith(GRAMMAR_DEAD_END)) or message.startswith(SERVER_FAILURES)
            raise OpenAIError(500 if failed else 400, message)
        self.started = True
        final = result.get_response().parameters.get("triton_final_response")
        self.done = final is not None and final.bool_param
        try:
            return read_update(result.get_response())
        except ValueError as exc:  # includes malformed logprobs JSON
            self.cancel()
            raise OpenAIError(500, f"model {self.model} sent a response that cannot be read: {exc}") from None

    def cancel(self, reason: Optional[str] = None) -> None:
        """Cancel the request unless it completed (cancelling a completed
        request makes tritonserver 2.51 hold the model). With ``reason``, its
        reader ends with that error (503) instead of ClientGone."""
        if not self.done:
            self.done = self.cancelled = True
            self.cancel_reason = reason
            self.call.cancel()


# The prompts of one request enter the model a few at a time, so that a request
# of many prompts is one tenant among the others (as one request's n samples
# are in the scheduler): at least one prompt in flight, more while those hold
# fewer than this many prompt tokens, about what the engine computes of one
# prompt per step (long_prefill_token_threshold). A request sent meanwhile
# arrives before its later prompts and is admitted beside it within a step.
PROMPT_TOKENS_IN_FLIGHT = 256


def prompt_size(prompt) -> int:
    """Tokens of a prompt: its ids, or about four characters a token of text."""
    return len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)


class Generation:
    """The Triton streams of one API request (one per prompt, each started by
    its function in ``starts``), read as one sequence of ``(prompt index,
    Update)``; prompts start in order as earlier ones finish, with about
    PROMPT_TOKENS_IN_FLIGHT prompt tokens (``sizes``) in flight."""

    def __init__(self, starts: List[Callable[[], TritonStream]], sizes: Optional[List[int]] = None):
        self._starts, self._sizes = starts, sizes or [1] * len(starts)
        self.streams: List[TritonStream] = []   # started so far, in prompt order
        self._tasks: List[asyncio.Task] = []
        self._cancelled = False

    async def updates(self) -> AsyncIterator[Tuple[int, Update]]:
        if len(self._starts) == 1:
            self.streams.append(self._starts[0]())
            async for update in self.streams[0]:
                yield 0, update
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: TritonStream):
            try:
                async for update in stream:
                    queue.put_nowait((i, update, None))
                queue.put_nowait((i, None, None))
            except BaseException as exc:  # ClientGone and OpenAIError included: the reader raises it
                queue.put_nowait((i, None, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise
        in_flight = 0   # prompt tokens of the streams running

        def start_more() -> int:
            nonlocal in_flight
            started = 0
            while len(self.streams) < len(self._starts) and not self._cancelled and (
                    in_flight == 0 or in_flight + self._sizes[len(self.streams)] <= PROMPT_TOKENS_IN_FLIGHT):
                i = len(self.streams)
                self.streams.append(self._starts[i]())
                self._tasks.append(asyncio.ensure_future(pump(i, self.streams[i])))
                in_flight += self._sizes[i]
                started += 1
            return started
        running = start_more()
        while running:
            i, update, error = await queue.get()
            if error is not None:
                raise error
            if update is None:
                in_flight -= self._sizes[i]
                running += start_more() - 1
            else:
                yield i, update

    def cancel(self, reason: Optional[str] = None) -> None:
        """Cancel every stream still running (none starts after this); their
        readers end with ClientGone, or with ``reason`` as a 503 error (the
        server is stopping)."""
        self._cancelled = True
        for stream in self.streams:
            stream.cancel(reason)


class Triton:
    """The gRPC client of the tritonserver (one channel, shared by all requests)."""

    def __init__(self, url: str, admin_key: Optional[str] = None, api_key: Optional[str] = None):
        self.url = url
        # tritonserver's inference, metadata and configuration need this key
        # when it was started with one (python -m pagedbackend.serve --api-key).
        self.headers = {GRPC_API_KEY_HEADER: api_key} if api_key else None
        # tritonserver started by pagedbackend.serve serves its model repository
        # API (the list of models) only to requests carrying this key.
        self.admin_key = admin_key
        self.client: Optional[aioclient.InferenceServerClient] = None
        self._configs = {}   # model name -> (time read, config)

    async def open(self) -> None:
        keepalive = aioclient.KeepAliveOptions()
        self.client = aioclient.InferenceServerClient(self.url, channel_args=[
            ("grpc.max_send_message_length", aioclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", aioclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            # Started before tritonserver is up (make serve): retry the connection
            # every second at most, rather than backing off to gRPC's two minutes.
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 1000)])

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def ready(self, model: Optional[str] = None) -> bool:
        """Triton is ready, and so is ``model`` where one is named (with
        explicit model control the server is ready before any model loads)."""
        try:
            if not await self.client.is_server_ready(client_timeout=2.0):
                return False
            return model is None or await self.client.is_model_ready(model, client_timeout=2.0)
        except InferenceServerException:
            return False

    async def config(self, model: str) -> dict:
        """The model's configuration, read again after CONFIG_TTL_S (a reloaded
        model may have gained or lost outputs)."""
        read_at, config = self._configs.get(model, (None, None))
        if read_at is None or time.monotonic() - read_at > CONFIG_TTL_S:
            try:
                reply = await self.client.get_model_config(model, headers=self.headers, as_json=True,
                                                           client_timeout=10.0)
            except InferenceServerException as exc:
                if "NOT_FOUND" in str(exc.status()) or "unknown model" in str(exc.message()).lower():
                    raise OpenAIError(404, f"the model {model!r} does not exist", "model",
                                      "model_not_found") from None
                raise OpenAIError(503, f"Triton did not answer: {redact(exc.message() or '')}") from None
            config = reply["config"]
            self._configs[model] = (time.monotonic(), config)
        return config

    async def text_models(self, known: List[str]) -> List[str]:
        """Ready models that take ``text_input`` and give ``text_output``: every
        such model of the repository when the admin key opens its index, else
        those of ``known`` that are ready."""
        names = list(known)
        if self.admin_key:
            try:
                index = await self.client.get_model_repository_index(
                    headers={GRPC_ADMIN_HEADER: self.admin_key, **(self.headers or {})}, as_json=True,
                    client_timeout=10.0)
                names = sorted({m["name"] for m in index.get("models", []) if m.get("state") == "READY"})
            except InferenceServerException as exc:
                raise OpenAIError(503, f"Triton did not answer: {redact(exc.message() or '')}") from None
        ready = []
        for name in names:
            try:
                if not await self.client.is_model_ready(name, client_timeout=10.0):
                    continue
            except InferenceServerException as exc:
                raise OpenAIError(503, f"Triton did not answer: {redact(exc.message() or '')}") from None
            if is_text_model(await self.config(name)):
                ready.append(name)
        return ready

    def stream(self, model: str, prompt, params: dict, logprobs: bool, cached_tokens: bool = False,
               prompt_logprobs: bool = False, output_ids: bool = False, images: Sequence[str] = ()) -> TritonStream:
        """``prompt``: text, or a list of token ids (the model's ``input_ids``);
        ``cached_tokens``, ``prompt_logprobs``, ``output_ids``: ask for those
        outputs (a model that declares them); ``images``: the model's ``image``
        input, one element per image (base64 or a URL, as sent)."""
        first = _input("text_input", prompt) if isinstance(prompt, str) else _ids_input(prompt)
        inputs = [first, _input("sampling_parameters", json.dumps(params)), *FLAGS]
        if images:
            tensor = aioclient.InferInput("image", [len(images)], "BYTES")
            tensor.set_data_from_numpy(np.array([i.encode("utf-8") for i in images], dtype=np.object_))
            inputs.append(tensor)
        if prompt_logprobs:
            inputs.append(RETURN_PROMPT_LOGPROBS)
        if logprobs:
            inputs.append(RETURN_LOGPROBS)
        if cached_tokens:
            inputs.append(RETURN_CACHED)
        if output_ids:
            inputs.append(RETURN_OUTPUT_IDS)
        request = {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        async def one_request():
            yield request
        return TritonStream(self.client.stream_infer(one_request(), headers=self.headers), model)


    async def embed(self, model: str, request: dict) -> Update:
        """One ``embedding_request`` (``serving.embeddings``) to ``model``: its
        response, one JSON embedding per input in ``texts`` and their token
        counts; the model's refusal is raised as OpenAIError (400)."""
        inputs = [_input("embedding_request", json.dumps(request)), _input("return_num_input_tokens", True)]
        call = {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        async def one_request():
            yield call
        stream = TritonStream(self.client.stream_infer(one_request(), headers=self.headers), model)
        try:
            return await stream.__anext__()
        finally:
            stream.cancel()

    async def control(self, model: str, order: dict) -> dict:
        """One ``lora_control`` request to ``model`` (adapters listed, loaded or
        unloaded; serving/triton/lora.py) and its JSON answer; the model's
        refusal is raised as OpenAIError (400)."""
        request = {"model_name": model, "inputs": [_input("lora_control", json.dumps(order))],
                   "request_id": uuid.uuid4().hex}

        async def one_request():
            yield request
        texts = []
        async for update in TritonStream(self.client.stream_infer(one_request(), headers=self.headers), model):
            texts += update.texts
        return json.loads("".join(texts))


def is_text_model(config: dict) -> bool:
    return ("text_input" in {i["name"] for i in config.get("input", [])}
            and "text_output" in {o["name"] for o in config.get("output", [])})
