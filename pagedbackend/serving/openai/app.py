"""The OpenAI-compatible HTTP API in front of a running tritonserver: the
FastAPI app and its routes, and uvicorn to serve it.

``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events
with ``stream``, else one JSON answer), ``POST /v1/embeddings``
(``embeddings``), ``POST /rerank`` and ``/score`` (``scores``), ``GET /v1/models`` (Triton's ready text
models and the served model's LoRA adapters), ``GET /health``, ``POST
/tokenize``, ``POST /detokenize``, and the adapters' routes (``adapters``). Chat
messages become a prompt through the chat template of the served model's
tokenizer. Each prompt is one gRPC stream to the Triton model
(``triton_client``); a client that hangs up cancels its streams at once.
Large bodies, texts and answers are handled off the event loop (``offload``).
"""
import asyncio
import json
import pathlib
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedbackend.serving.constants import SERVED_MODEL
from pagedbackend.serving.openai import adapters as lora
from pagedbackend.serving.openai import embeddings, scores
from pagedbackend.serving.openai.answers import ChatAnswer, CompletionAnswer
from pagedbackend.serving.openai.asgi import (ApiKeyAuth, BodySizeLimit, CatchAll, ConcurrencyPerKey,
                                             h11_protocol_with_error_objects)
from pagedbackend.serving.openai.generations import OpenGenerations, answer
from pagedbackend.serving.openai.offload import run_sized
from pagedbackend.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  OpenAIError, TokenizeChatRequest, TokenizeRequest, map_openai,
                                                  openai_checked, parse_request, sampling_parameters)
from pagedbackend.serving.openai.reasoning import Reasoning, template_kwargs
from pagedbackend.serving.openai.token_ids import check_token_ids
from pagedbackend.serving.openai.schema import add_request_bodies
from pagedbackend.serving.openai.structured import (Tools, messages_with_tools, structured_outputs,
                                                    template_knows_tools)
from pagedbackend.serving.openai.triton_client import Triton, is_text_model
from pagedbackend.serving.requests import RequestLimits, model_context_length

# Room for an image of up to the Triton model's max_image_bytes (20 MiB) as
# base64 (4/3 as long) in a data URL, and the rest of the request.
DEFAULT_MAX_BODY_BYTES = 32 << 20
DEFAULT_MAX_HEADER_BYTES = 64 << 10   # the request line and headers together


@dataclass
class Settings:
    triton_url: str = "127.0.0.1:8001"
    model_name: str = SERVED_MODEL             # the Triton model of a request that names none
    tokenizer: str = "default"                 # folder of the served model's tokenizer
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_key: Optional[str] = None            # opens Triton's model index for /v1/models
    reasoning_parser: Optional[str] = None     # vLLM's: qwen3 or deepseek_r1 (reasoning.py); None: off
    # What one request may ask for (requests.RequestLimits); max_model_len None:
    # the tokenizer folder's config.json says it.
    limits: RequestLimits = field(default_factory=RequestLimits)
    api_keys: Sequence[str] = ()               # Bearer keys every route but /health needs; (): open
    triton_api_key: Optional[str] = None       # the key of tritonserver's inference APIs (serve --api-key)
    max_concurrent_per_key: int = 0            # requests in flight per key (per address without keys); 0: no cap
    # Whether the served model takes images; None: its folder's config.json
    # says (a vision_config), read with the tokenizer.
    takes_images: Optional[bool] = None
    # Several served models (Triton model name -> its folder, for the
    # tokenizer, the context length and whether it takes images), the first
    # the default; empty: ``model_name`` served from ``tokenizer``.
    models: Dict[str, str] = field(default_factory=dict)


@dataclass
class Served:
    """What the API needs of one served model besides Triton: its tokenizer,
    the request limits with its context length, and whether it takes images."""
    tokenizer: object
    limits: RequestLimits
    takes_images: bool


def load_served(folder: str, limits: RequestLimits, takes_images: Optional[bool] = None) -> Served:
    """The tokenizer, context length and image input of a model folder (the
    engine's, from local files only; "default": the engine's default model)."""
    from pagedbackend.engine.tokenizer import load_tokenizer
    from pagedbackend.models.default_model import resolve_model_path
    path = resolve_model_path(folder)
    if limits.max_model_len is None:
        limits = limits.replace(max_model_len=model_context_length(path))
    return Served(load_tokenizer(path), limits, folder_takes_images(path) if takes_images is None else takes_images)


def folder_takes_images(folder) -> bool:
    """Whether a Hugging Face model folder is a vision-language model's (its
    config.json has a ``vision_config``, as every such family served has)."""
    try:
        config = json.loads((pathlib.Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def chat_images(req) -> List[str]:
    """The images of the messages' content parts, as sent, in order."""
    return [url for i, m in enumerate(req.messages) for url in m.image_urls(i)]


def chat_prompt(tokenizer, req: ChatCompletionRequest, tools: Optional[Tools] = None) -> str:
    """The messages through the tokenizer's chat template, as text, with the
    tools (``structured.messages_with_tools``); an image part reaches the
    template as ``{"type": "image"}``, which a vision model's template writes
    as its image placeholder."""
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "the model's tokenizer has no chat template; use /v1/completions", "messages")
    knows_tools = template_knows_tools(tokenizer)
    messages = messages_with_tools([m.for_template(i) for i, m in enumerate(req.messages)], tools, knows_tools)
    extra = {**template_kwargs(req), **({"tools": tools.as_openai()} if tools is not None and knows_tools else {})}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt, **extra)
    except Exception as exc:  # the template's own checks (raise_exception, unexpected roles)
        raise OpenAIError(400, f"the chat template refused the messages: {exc}", "messages") from None


def create_app(settings: Settings, tokenizer=None) -> FastAPI:
    triton = Triton(settings.triton_url, settings.admin_key, settings.triton_api_key)
    if settings.models:
        settings.model_name = next(iter(settings.models))
        served = {name: load_served(folder, settings.limits) for name, folder in settings.models.items()}
    elif tokenizer is not None:   # given (tests): the limits and image input as the settings say
        served = {settings.model_name: Served(tokenizer, settings.limits, bool(settings.takes_images))}
    else:
        served = {settings.model_name: load_served(settings.tokenizer, settings.limits, settings.takes_images)}
    default = served[settings.model_name]
    settings.limits, settings.takes_images = default.limits, default.takes_images
    adapters = lora.Adapters(triton, settings.model_name, settings.admin_key)
    limits = settings.limits
    started = int(time.time())
    open_generations = OpenGenerations()

    async def lifespan(_app):
        await triton.open()
        yield
        await triton.close()

    app = FastAPI(title="pagedbackend OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ConcurrencyPerKey, limit=settings.max_concurrent_per_key, keyed=bool(settings.api_keys))
    app.add_middleware(ApiKeyAuth, keys=settings.api_keys)   # before any body is read
    app.add_middleware(CatchAll)   # outermost of ours: it also sees BodySizeLimit's errors

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(OpenAIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


    async def model_for(name: Optional[str], logprobs: bool,
                        images: bool = False) -> Tuple[str, Optional[str], Served]:
        """The Triton model of a request's ``model``, the adapter it names
        (None: the model itself; an adapter's name wins over other models'),
        and what the API serves it with (a Triton model not served here by
        name: the default model's tokenizer)."""
        name, adapter = name or settings.model_name, None
        if name != settings.model_name and await adapters.find(name):
            name, adapter = settings.model_name, name
        config = await triton.config(name)
        if not is_text_model(config):
            raise OpenAIError(400, f"model {name} is not a text generation model "
                              "(it lacks text_input or text_output)", "model")
        if logprobs and "logprobs" not in {o["name"] for o in config.get("output", [])}:
            raise OpenAIError(400, f"logprobs are not supported by model {name}: it has no logprobs output",
                              "logprobs")
        model = served.get(name, default)
        if images and (not model.takes_images or "image" not in {i["name"] for i in config.get("input", [])}):
            raise OpenAIError(400, f"model {name} takes no image input: it serves text only", "messages")
        return name, adapter, model

    @app.get("/health")
    async def health():
        if await triton.ready(settings.model_name):
            return {"status": "ok"}
        return JSONResponse(OpenAIError(503, f"Triton or its model {settings.model_name} "
                                             "is not ready").body(), status_code=503)

    @app.get("/v1/models")
    async def models():
        names = await triton.text_models(list(served))
        cards = [{"id": name, "object": "model", "created": started, "owned_by": "pagedbackend"} for name in names]
        if settings.model_name in names:
            cards += lora.model_cards(await adapters.listed(), settings.model_name, started)
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        listed = await adapters.listed() if model_id != settings.model_name else {}
        if model_id in listed:
            return lora.model_cards({model_id: listed[model_id]}, settings.model_name, started)[0]
        if model_id not in await triton.text_models([model_id]):
            raise OpenAIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return {"id": model_id, "object": "model", "created": started, "owned_by": "pagedbackend"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.body()
        req = await run_sized(len(body), parse_request, CompletionRequest, body)
        model, adapter, use = await model_for(req.model, req.logprobs is not None)
        prompts = req.prompts(len(use.tokenizer))
        # max_tokens 0 (score the prompt): one token is generated and not returned.
        params = sampling_parameters(req, max(req.max_tokens or 0, 1) if req.max_tokens is not None else None,
                                     req.logprobs)
        constraint = structured_outputs(req)
        if constraint is not None:
            params["structured_outputs"] = constraint
        if req.echo and req.logprobs is not None:
            params["prompt_logprobs"] = req.logprobs
        if adapter is not None:
            params["lora_name"] = adapter
        params = map_openai(params, prompts, use.limits).wire()   # checked here, before Triton sees it
        shape = await run_sized(len(body), CompletionAnswer, req, adapter or model, prompts,
                                use.tokenizer)   # echo's texts
        return await answer(request, triton, model, prompts, params, req.logprobs is not None,
                            shape, req.stream, open_generations)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await request.body()
        req = await run_sized(len(body), parse_request, ChatCompletionRequest, body)
        images = chat_images(req)
        model, adapter, use = await model_for(req.model, req.logprobs, bool(images))
        openai_checked(use.limits.check_tools, req.tools)   # their count and size, before they are read
        tools = Tools.of(req)
        prompt = await run_sized(len(body), chat_prompt, use.tokenizer, req, tools)
        reasoning = Reasoning.of(settings.reasoning_parser, req, prompt)
        shape = ChatAnswer(req, adapter or model, tools, reasoning)
        params = sampling_parameters(req, req.max_completion_tokens or req.max_tokens, shape.top)
        constraint = structured_outputs(req)
        if tools is not None and tools.calls:
            if constraint is not None:
                raise OpenAIError(400, "response_format and structured outputs do not combine with tools "
                                  "unless tool_choice is none", "tool_choice")
            constraint = {"structural_tag": json.dumps(tools.structural_tag())}
        if reasoning is not None:   # the constraint starts after the reasoning
            constraint = reasoning.constrain(constraint)
        if constraint is not None:
            params["structured_outputs"] = constraint
        if adapter is not None:
            params["lora_name"] = adapter
        params = map_openai(params, [prompt], use.limits).wire()   # checked here, before Triton sees it
        return await answer(request, triton, model, [prompt], params, req.logprobs, shape, req.stream,
                            open_generations, images)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.body()
        req = await run_sized(len(body), parse_request,
                              lambda data: TokenizeChatRequest if "messages" in data else TokenizeRequest, body)
        tokenizer = (await model_for(req.model, False))[2].tokenizer
        if isinstance(req, TokenizeChatRequest) and chat_images(req):
            raise OpenAIError(400, "/tokenize counts text only: its messages may hold no image parts "
                              "(a chat completion's usage counts an image's tokens)", "messages")

        def work():
            text = chat_prompt(tokenizer, req) if isinstance(req, TokenizeChatRequest) else req.prompt
            ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
            return {"count": len(ids), "tokens": ids,
                    "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}
        return await run_sized(len(body), work)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await request.body()
        req = await run_sized(len(body), parse_request, DetokenizeRequest, body)
        tokenizer = (await model_for(req.model, False))[2].tokenizer
        openai_checked(check_token_ids, req.tokens, len(tokenizer), "tokens")
        return {"prompt": await run_sized(len(req.tokens), tokenizer.decode, req.tokens)}

    lora.add_routes(app, adapters)
    embeddings.add_routes(app, triton, settings.model_name, limits)
    scores.add_routes(app, triton, settings.model_name, limits)
    add_request_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                             "/v1/embeddings": embeddings.EmbeddingsRequest, "/rerank": scores.RerankRequest,
                             "/v1/rerank": scores.RerankRequest, "/score": scores.ScoreRequest,
                             "/v1/score": scores.ScoreRequest,
                             "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
    app.state.triton = triton
    app.state.open_generations = open_generations
    return app


# The exit status of a server whose Triton model was ready and then stayed
# unready for ``lost_s`` (its engine failed, or tritonserver went away).
TRITON_LOST_STATUS = 3


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning",
          max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, model: str = SERVED_MODEL, lost_s: float = 0.0) -> int:
    """uvicorn (headers over ``max_header_bytes`` get a 431 error object), whose first SIGTERM or SIGINT also ends every open generation
    at once with the error "the server is shutting down" (uvicorn alone would
    wait for them to finish); later signals change nothing. With ``lost_s`` >
    0, a ``model`` that was ready and stays unready that long stops the server
    with ``TRITON_LOST_STATUS`` (so that a supervisor restarts it); returns the
    exit status."""
    import uvicorn
    outcome = {"status": 0}

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
            if lost_s > 0:
                self.watch = asyncio.create_task(self.watch_triton())

        async def watch_triton(self):
            seen_ready, unready_since = False, None
            while not self.should_exit:
                ready = await app.state.triton.ready(model)
                now = time.monotonic()
                seen_ready |= ready
                unready_since = None if ready else (unready_since or now)
                if seen_ready and unready_since is not None and now - unready_since >= lost_s:
                    print(f"error: Triton's model {model} has not been ready for {lost_s:g} s (its engine "
                          f"failed, or tritonserver stopped); exiting with status {TRITON_LOST_STATUS}",
                          file=sys.stderr, flush=True)
                    outcome["status"] = TRITON_LOST_STATUS
                    self.handle_exit(None, None)
                    return
                await asyncio.sleep(0.25)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            http=h11_protocol_with_error_objects(), h11_max_incomplete_event_size=max_header_bytes)
    Server(config).run()
    return outcome["status"]
