"""An OpenAI-compatible HTTP API in front of a running tritonserver.

    python -m pagedbackend.serving.openai_server --triton-url 127.0.0.1:8001 --port 9000

``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events
with ``stream``, else one JSON answer), ``GET /v1/models`` (Triton's ready text
models), ``GET /health``. Chat messages become a prompt through the chat
template of the served model's tokenizer. Each prompt is one gRPC stream to the
Triton model (``openai_triton``); a client that hangs up cancels its streams at
once. Request schemas, errors and logprobs mapping: ``openai_protocol``.
"""
import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedbackend.serving.constants import ADMIN_KEY_ENV
from pagedbackend.serving.harness import free_port
from pagedbackend.serving.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  OpenAIError, TokenizeChatRequest, TokenizeRequest,
                                                  chat_logprobs, completion_logprobs, join_logprobs,
                                                  parse_request, prompt_completion_logprobs,
                                                  sampling_parameters)
from pagedbackend.serving.openai_structured import (ToolCallStream, Tools, messages_with_tools, parse_tool_calls,
                                                     structured_outputs, template_knows_tools)
from pagedbackend.serving.openai_triton import ClientGone, Generation, Triton, Update, is_text_model

DEFAULT_MODEL_NAME = "paged_llm"
DEFAULT_MAX_BODY_BYTES = 1 << 20
SSE_DONE = b"data: [DONE]\n\n"
logger = logging.getLogger("pagedbackend.openai")


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


# ---------------------------------------------------------------- choices

@dataclass
class Choice:
    """What one returned choice has produced so far."""
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: Optional[str] = None
    positions: list = field(default_factory=list)   # logprobs entries, one per token
    sent: bool = False                              # a chunk of it has been streamed

    def add(self, update: Update, i: int) -> Tuple[str, list, Optional[str]]:
        """Fold output ``i`` of ``update`` in; returns its new text, its new
        logprobs positions and, if it just finished, the finish reason."""
        text = update.texts[i]
        self.text += text
        self.num_tokens += update.num_tokens[i]
        positions = (update.logprobs[i] if update.logprobs is not None else None) or []
        self.positions.extend(positions)
        finished = None
        if update.reasons[i] is not None and self.finish_reason is None:
            self.finish_reason = finished = update.reasons[i]
        return text, positions, finished


class Run:
    """One API request's choices (``n`` per prompt, choice ``p * n + i`` is
    output ``i`` of prompt ``p``) and its token usage."""

    def __init__(self, num_prompts: int, n: int):
        self.n = n
        self.choices = [Choice(p * n + i) for p in range(num_prompts) for i in range(n)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens: List[Optional[int]] = [None] * num_prompts
        self.prompt_logprobs: List[Optional[list]] = [None] * num_prompts
        self.score_only = False   # echo with max_tokens 0: what was generated is not returned

    def count_prompt(self, prompt: int, update: Update) -> None:
        if update.num_input_tokens is not None:
            self.prompt_tokens[prompt] = update.num_input_tokens
        if update.num_cached_tokens is not None:
            self.cached_tokens[prompt] = update.num_cached_tokens
        if update.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = update.prompt_logprobs

    def fold(self, prompt: int, update: Update):
        """Per output of ``update``, folded in turn: (choice, new text, new
        positions, finish reason)."""
        self.count_prompt(prompt, update)
        for i in range(len(update.texts)):
            choice = self.choices[prompt * self.n + i]
            yield (choice, *choice.add(update, i))

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = 0 if self.score_only else sum(c.num_tokens for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if any(c is not None for c in self.cached_tokens):   # prefix-cache hits, as OpenAI reports them
            usage["prompt_tokens_details"] = {"cached_tokens": sum(c or 0 for c in self.cached_tokens)}
        return usage


class _Answer:
    """How one endpoint shapes its choices: as stream chunks or one object."""

    wants_prompt_logprobs = False

    def __init__(self, req, model: str, prefix: str, top: Optional[int]):
        self.req, self.model, self.top = req, model, top
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        options = req.stream_options
        self.usage_chunks = options is not None and options.include_usage
        self.running_usage = options is not None and options.continuous_usage_stats

    def chunk(self, run: Run, choices: list, final_usage: bool = False) -> bytes:
        payload = {"id": self.id, "object": self.chunk_object, "created": self.created,
                   "model": self.model, "choices": choices}
        if self.usage_chunks or self.running_usage:
            payload["usage"] = run.usage() if final_usage or self.running_usage else None
        return sse(payload)

    async def chunks(self, run: Run, updates) -> AsyncIterator[bytes]:
        """The events of each update, joined into one write (the first one
        after the opening events)."""
        opened = False
        async for prompt, update in updates:
            pieces = []
            if not opened:
                run.count_prompt(prompt, update)
                pieces, opened = self.opening(run), True
            for choice, text, positions, finished in run.fold(prompt, update):
                piece = self.delta(run, choice, text, positions, finished)
                if piece is not None:
                    choice.sent = True
                    pieces.append(piece)
            if pieces:
                yield b"".join(pieces)
        if self.usage_chunks:
            yield self.chunk(run, [], final_usage=True)

    def opening(self, run: Run) -> List[bytes]:
        return []

    def whole(self, run: Run) -> dict:
        return {"id": self.id, "object": self.whole_object, "created": self.created, "model": self.model,
                "choices": [self.whole_choice(c, run) for c in run.choices], "usage": run.usage()}


class CompletionAnswer(_Answer):
    chunk_object = whole_object = "text_completion"

    def __init__(self, req: CompletionRequest, model: str, prompts: list, tokenizer):
        super().__init__(req, model, "cmpl", req.logprobs)
        # Echoed text: the prompt, or the text of its token ids.
        self.texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        self.wants_prompt_logprobs = req.echo and req.logprobs is not None
        self.first_tokens = []   # the text of each prompt's first token (it has no log-probability)
        if self.wants_prompt_logprobs:
            for p in prompts:
                ids = p if not isinstance(p, str) else tokenizer.encode(p)
                self.first_tokens.append(tokenizer.decode(ids[:1]))

    def _echo(self, choice: Choice) -> str:
        return self.texts[choice.index // self.req.n] if self.req.echo else ""

    def _prompt_logprobs(self, run: Run, choice: Choice) -> Optional[dict]:
        prompt = choice.index // self.req.n
        if not self.wants_prompt_logprobs or run.prompt_logprobs[prompt] is None:
            return None
        return prompt_completion_logprobs(self.first_tokens[prompt], run.prompt_logprobs[prompt], self.top)

    def delta(self, run, choice, text, positions, finished) -> Optional[bytes]:
        if run.score_only:
            text, positions = "", []
        echo = "" if choice.sent else self._echo(choice)
        if not (echo or text or positions or finished):
            return None
        logprobs = None
        if self.top is not None:  # offsets continue the choice's text, echoed prompt included
            sent = len(echo) if echo else len(self._echo(choice)) + len(choice.text) - len(text)
            logprobs = completion_logprobs(positions, self.top, sent)
            prompt = self._prompt_logprobs(run, choice) if echo else None
            if prompt is not None:
                logprobs = join_logprobs(prompt, logprobs)
        return self.chunk(run, [{"index": choice.index, "text": echo + text, "logprobs": logprobs,
                                 "finish_reason": finished}])

    def whole_choice(self, choice: Choice, run: Run) -> dict:
        text, positions = ("", []) if run.score_only else (choice.text, choice.positions)
        logprobs = None
        if self.top is not None:
            echo = self._echo(choice)
            logprobs = completion_logprobs(positions, self.top, len(echo))
            prompt = self._prompt_logprobs(run, choice)
            if prompt is not None:
                logprobs = join_logprobs(prompt, logprobs)
        return {"index": choice.index, "text": self._echo(choice) + text,
                "finish_reason": choice.finish_reason, "logprobs": logprobs}


class ChatAnswer(_Answer):
    chunk_object, whole_object = "chat.completion.chunk", "chat.completion"

    def __init__(self, req: ChatCompletionRequest, model: str, tools: Optional[Tools] = None):
        super().__init__(req, model, "chatcmpl", (req.top_logprobs or 0) if req.logprobs else None)
        self.tools = tools if tools is not None and tools.calls else None
        self.tool_streams: Dict[int, ToolCallStream] = {}

    def opening(self, run: Run) -> List[bytes]:
        return [self.chunk(run, [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]) for c in run.choices]

    def delta(self, run, choice, text, positions, finished) -> Optional[bytes]:
        if not (text or positions or finished):
            return None
        logprobs = None if self.top is None else {"content": chat_logprobs(positions, self.top)}
        if self.tools is None:
            return self.chunk(run, [{"index": choice.index, "delta": {"content": text} if text else {},
                                     "logprobs": logprobs, "finish_reason": finished}])
        stream = self.tool_streams.setdefault(choice.index, ToolCallStream())
        items = [(d, None) for d in stream.feed(text) + (stream.finish() if finished else [])]
        if finished:
            items.append(({}, "tool_calls" if stream.calls and finished == "stop" else finished))
        if not items and positions:
            items = [({}, None)]
        return b"".join(self.chunk(run, [{"index": choice.index, "delta": d, "finish_reason": reason,
                                          "logprobs": logprobs if i == 0 else None}])
                        for i, (d, reason) in enumerate(items)) or None

    def whole_choice(self, choice: Choice, run: Run) -> dict:
        message = {"role": "assistant", "content": choice.text}
        reason = choice.finish_reason
        if self.tools is not None:
            content, calls = parse_tool_calls(choice.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": choice.index, "message": message,
                "logprobs": None if self.top is None else {"content": chat_logprobs(choice.positions, self.top)},
                "finish_reason": reason}


# ---------------------------------------------------------------- HTTP plumbing

class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before the
    app sees it (the body is read here once and handed on).

    An oversized body is still read to its end (up to ``DRAIN_LIMIT_BYTES``) and
    dropped, so that a client still sending it reads the 413 instead of a reset."""

    DRAIN_LIMIT_BYTES = 64 << 20

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else 0
        chunks, size, more = [], 0, declared <= self.DRAIN_LIMIT_BYTES
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            more = message.get("more_body", False) and size <= self.DRAIN_LIMIT_BYTES
        if max(size, declared) > self.max_bytes:
            error = OpenAIError(413, f"the request body is larger than the limit of {self.max_bytes} bytes")
            response = JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})
            return await response(scope, receive, send)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()
        await self.app(scope, replay, send)


class CatchAll:
    """ASGI middleware: an exception that no handler answered becomes a 500
    OpenAI error object (or, once a streamed answer has begun, the end of its
    body) instead of Starlette's re-raise, which makes uvicorn drop the
    keep-alive connection under the client's next request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False}

        async def tracked(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)
        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            logger.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            if state["ended"]:
                return
            if state["started"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            error = OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}")
            await JSONResponse(error.body(), status_code=500)(scope, receive, send)


class EventStream(Response):
    """A ``text/event-stream`` response sent straight from an async iterator of
    bytes. Unlike StreamingResponse it starts no task of its own to listen for
    a disconnect: ``answer``'s watcher already does, and cancels the source."""

    media_type = "text/event-stream"

    def __init__(self, pieces: AsyncIterator[bytes]):
        self.pieces, self.status_code, self.background = pieces, 200, None
        self.init_headers({"Cache-Control": "no-cache"})  # no body, so no content-length

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for piece in self.pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _watch_disconnect(receive, on_disconnect: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


async def _prepend(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


SHUTTING_DOWN = "the server is shutting down"


class OpenGenerations:
    """Every Generation still running, so that a stopping server ends each one
    with an explicit error (an SSE error event, or a 503) rather than cutting it."""

    def __init__(self):
        self.running: set = set()
        self.closing: Optional[str] = None

    def end_all(self, reason: str = SHUTTING_DOWN) -> None:
        self.closing = reason
        for generation in list(self.running):
            generation.cancel(reason)


async def answer(request: Request, triton: Triton, model: str, prompts: List[str], params: dict,
                 logprobs: bool, shape: _Answer, stream: bool, open_generations: OpenGenerations) -> Response:
    """Run the prompts on Triton and answer as ``shape`` says.

    The first update is awaited before answering, so that a request the model
    refuses gets an HTTP error status even when streaming. The client hanging
    up, at any point, cancels the Triton requests still running."""
    if open_generations.closing:
        raise OpenAIError(503, open_generations.closing)
    outputs = {o["name"] for o in (await triton.config(model)).get("output", [])}
    if shape.wants_prompt_logprobs and "prompt_logprobs" not in outputs:
        raise OpenAIError(400, f"echo with logprobs needs prompt log-probabilities, which model {model} "
                          "does not return (no prompt_logprobs output)", "echo")
    generation = Generation([triton.stream(model, p, params, logprobs, "num_cached_tokens" in outputs,
                                           shape.wants_prompt_logprobs) for p in prompts])
    open_generations.running.add(generation)
    watcher = asyncio.ensure_future(_watch_disconnect(request.receive, generation.cancel))
    updates = generation.updates()
    run = Run(len(prompts), shape.req.n)
    run.score_only = getattr(shape.req, "score_only", False)

    def stop():
        open_generations.running.discard(generation)
        generation.cancel()
        watcher.cancel()
    try:
        first = await updates.__anext__()
    except ClientGone:
        stop()
        return Response(status_code=499)  # nobody reads it
    except BaseException:
        stop()
        raise
    if stream:
        async def events():
            try:
                async for piece in shape.chunks(run, _prepend(first, updates)):
                    yield piece
                yield SSE_DONE
            except ClientGone:
                pass
            except OpenAIError as exc:  # after the headers: an error event, then the end
                yield sse(exc.body())
                yield SSE_DONE
            finally:
                stop()
        return EventStream(events())
    try:
        async for prompt, update in _prepend(first, updates):
            for _ in run.fold(prompt, update):
                pass
    except ClientGone:
        return Response(status_code=499)
    finally:
        stop()
    return JSONResponse(shape.whole(run))


# ---------------------------------------------------------------- the app

@dataclass
class Settings:
    triton_url: str = "127.0.0.1:8001"
    model_name: str = DEFAULT_MODEL_NAME       # used when a request names no model
    tokenizer: str = "default"                 # folder of the served model's tokenizer
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_key: Optional[str] = None            # opens Triton's model index for /v1/models


def load_tokenizer(path: str):
    """The model's tokenizer, from local files only ("default": the engine's default model)."""
    from transformers import AutoTokenizer

    from pagedbackend.models.default_model import resolve_model_path
    return AutoTokenizer.from_pretrained(str(resolve_model_path(path)), local_files_only=True)


def chat_prompt(tokenizer, req: ChatCompletionRequest, tools: Optional[Tools] = None) -> str:
    """The messages through the tokenizer's chat template, as text, with the
    tools (``openai_structured.messages_with_tools``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "the model's tokenizer has no chat template; use /v1/completions", "messages")
    knows_tools = template_knows_tools(tokenizer)
    messages = messages_with_tools([m.for_template(i) for i, m in enumerate(req.messages)], tools, knows_tools)
    extra = {"tools": tools.as_openai()} if tools is not None and knows_tools else {}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt, **extra)
    except Exception as exc:  # the template's own checks (raise_exception, unexpected roles)
        raise OpenAIError(400, f"the chat template refused the messages: {exc}", "messages") from None


def create_app(settings: Settings, tokenizer=None) -> FastAPI:
    triton = Triton(settings.triton_url, settings.admin_key)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer)
    started = int(time.time())
    open_generations = OpenGenerations()

    async def lifespan(_app):
        await triton.open()
        yield
        await triton.close()

    app = FastAPI(title="pagedbackend OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CatchAll)   # outermost of ours: it also sees BodySizeLimit's errors

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(OpenAIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


    async def model_for(name: Optional[str], logprobs: bool) -> str:
        name = name or settings.model_name
        config = await triton.config(name)
        if not is_text_model(config):
            raise OpenAIError(400, f"model {name} is not a text generation model "
                              "(it lacks text_input or text_output)", "model")
        if logprobs and "logprobs" not in {o["name"] for o in config.get("output", [])}:
            raise OpenAIError(400, f"logprobs are not supported by model {name}: it has no logprobs output",
                              "logprobs")
        return name

    @app.get("/health")
    async def health():
        if await triton.ready(settings.model_name):
            return {"status": "ok"}
        return JSONResponse(OpenAIError(503, f"Triton at {triton.url} or its model {settings.model_name} "
                                             "is not ready").body(), status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": started,
                                            "owned_by": "pagedbackend"} for name in await triton.text_models([settings.model_name])]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id not in await triton.text_models([model_id]):
            raise OpenAIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return {"id": model_id, "object": "model", "created": started, "owned_by": "pagedbackend"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await request.body())
        prompts = req.prompts()
        model = await model_for(req.model, req.logprobs is not None)
        # max_tokens 0 (score the prompt): one token is generated and not returned.
        params = sampling_parameters(req, max(req.max_tokens or 0, 1) if req.max_tokens is not None else None,
                                     req.logprobs)
        constraint = structured_outputs(req)
        if constraint is not None:
            params["structured_outputs"] = constraint
        if req.echo and req.logprobs is not None:
            params["prompt_logprobs"] = req.logprobs
        return await answer(request, triton, model, prompts, params, req.logprobs is not None,
                            CompletionAnswer(req, model, prompts, tokenizer), req.stream, open_generations)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await request.body())
        model = await model_for(req.model, req.logprobs)
        tools = Tools.of(req)
        prompt = chat_prompt(tokenizer, req, tools)
        shape = ChatAnswer(req, model, tools)
        params = sampling_parameters(req, req.max_completion_tokens or req.max_tokens, shape.top)
        constraint = structured_outputs(req)
        if tools is not None and tools.calls:
            if constraint is not None:
                raise OpenAIError(400, "response_format and structured outputs do not combine with tools "
                                  "unless tool_choice is none", "tool_choice")
            constraint = {"structural_tag": json.dumps(tools.structural_tag())}
        if constraint is not None:
            params["structured_outputs"] = constraint
        return await answer(request, triton, model, [prompt], params, req.logprobs, shape, req.stream,
                            open_generations)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_request(lambda data: TokenizeChatRequest if "messages" in data else TokenizeRequest,
                            await request.body())
        chat = isinstance(req, TokenizeChatRequest)
        await model_for(req.model, False)
        text = chat_prompt(tokenizer, req) if chat else req.prompt
        ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await request.body())
        await model_for(req.model, False)
        bad = next((t for t in req.tokens if not 0 <= t < len(tokenizer)), None)
        if bad is not None:
            raise OpenAIError(400, f"token id {bad} is outside the vocabulary (0..{len(tokenizer) - 1})",
                              "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    app.state.triton = triton
    app.state.open_generations = open_generations
    return app


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    """uvicorn, whose first SIGTERM or SIGINT also ends every open generation
    at once with the error "the server is shutting down" (uvicorn alone would
    wait for them to finish); later signals change nothing."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                loop = getattr(self, "loop", None)
                if loop is not None:
                    loop.call_soon_threadsafe(app.state.open_generations.end_all)
            self.should_exit = True   # never force_exit: the streams end themselves

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    Server(config).run()


# ---------------------------------------------------------------- as a process

class OpenAIServer:
    """``python -m pagedbackend.serving.openai_server`` as a child process on a
    loopback port, started and stopped as a context (tests, benchmarks).

        with OpenAIServer(triton.grpc_url, tokenizer=folder) as api:
            api.base_url  # http://127.0.0.1:PORT/v1
    """

    def __init__(self, triton_url: str, tokenizer: str = "default", port: Optional[int] = None,
                 extra_args=(), ready_timeout_s: float = 120.0):
        self.triton_url, self.tokenizer, self.port = triton_url, str(tokenizer), port
        self.extra_args, self.ready_timeout_s = list(extra_args), ready_timeout_s
        self.process: Optional[subprocess.Popen] = None
        self.output = ""

    url = property(lambda self: f"http://127.0.0.1:{self.port}")
    base_url = property(lambda self: f"{self.url}/v1")

    def __enter__(self) -> "OpenAIServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start it and wait until /health answers 200 (Triton ready behind it)."""
        self.port = self.port or free_port()
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedbackend.serving.openai_server", "--triton-url", self.triton_url,
             "--port", str(self.port), "--tokenizer", self.tokenizer, *self.extra_args],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the OpenAI server on port {self.port} did not become ready; "
                           f"its output:\n{self.output}")

    def stop(self) -> Optional[int]:
        process, self.process = self.process, None
        if process is None:
            return None
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        self._log.seek(0)
        self.output = self._log.read().decode(errors="replace")
        self._log.close()
        return process.returncode


# ---------------------------------------------------------------- command line

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.serving.openai_server",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME,
                        help="Triton model for requests that name none")
    parser.add_argument("--tokenizer", "--model-path", dest="tokenizer", default="default",
                        help='the served model\'s folder, for its tokenizer and chat template '
                             '("default": the engine\'s default model)')
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get 413")
    parser.add_argument("--triton-admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                        help="the key of tritonserver's model repository API (python -m pagedbackend.serve "
                             f"--admin-key, ${ADMIN_KEY_ENV}): /v1/models then lists every ready text model, "
                             "not only --model-name")
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = Settings(args.triton_url, args.model_name, args.tokenizer, args.max_body_bytes,
                        args.triton_admin_key)
    try:
        app = create_app(settings)
    except (OSError, ValueError) as exc:
        print(f"error: cannot load the tokenizer from {args.tokenizer!r}: {exc}", file=sys.stderr)
        return 1
    print(f"OpenAI API: http://{args.host}:{args.port}/v1 (Triton gRPC {args.triton_url})", flush=True)
    serve(app, args.host, args.port, args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
