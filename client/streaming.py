"""Streaming clients for the paged_llm model: gRPC (sync and asyncio), HTTP
generate_stream, and the OpenAI-compatible API in front of the server.

Each yields ``Delta`` objects as responses arrive; ``collect`` / ``acollect`` fold
them into a ``Result`` (texts, finish reasons, time to first token, per-token
arrival times). Every request asks for finish_reason and token counts, so a
delta knows how many tokens it carries. n > 1 and beam search: a response holds
one element per output, which become one delta each (``Delta.index``).
"""
import json
import os
import queue
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, Iterable, Iterator, List, Optional

import numpy as np

DEFAULT_MODEL = "paged_llm"
DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_HTTP_URL = "http://127.0.0.1:8000"
DEFAULT_OPENAI_URL = "http://127.0.0.1:9000"
OUTPUTS = ("text_output", "finish_reason", "cumulative_logprob", "num_input_tokens", "num_output_tokens")


class ServerError(RuntimeError):
    """The server refused the request or failed it."""



# The servers' API key (docs/security.md): the client sends ``api_key``, else
# the first key of $PAGEDBACKEND_API_KEY; None sends none.
API_KEY_ENV = "PAGEDBACKEND_API_KEY"
API_KEY_HEADER = "pagedbackend-api-key"   # tritonserver's HTTP port; gRPC adds a prefix
GRPC_API_KEY_HEADER = "triton-grpc-protocol-" + API_KEY_HEADER


def api_key_of(api_key: Optional[str] = None) -> Optional[str]:
    if api_key:
        return api_key
    keys = [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return keys[0] if keys else None


def triton_headers(api_key: Optional[str] = None, grpc: bool = False) -> Dict[str, str]:
    """The key header of tritonserver's HTTP (or gRPC) port, if there is a key."""
    key = api_key_of(api_key)
    return {GRPC_API_KEY_HEADER if grpc else API_KEY_HEADER: key} if key else {}

@dataclass
class Delta:
    text: str                     # new text of output ``index``
    index: int                    # which of the request's outputs
    time: float                   # seconds since the request was sent
    finish_reason: Optional[str] = None
    num_tokens: int = 0           # tokens in this delta
    num_input_tokens: Optional[int] = None
    cumulative_logprob: Optional[float] = None


@dataclass
class Result:
    texts: List[str] = field(default_factory=list)
    finish_reasons: List[Optional[str]] = field(default_factory=list)
    num_output_tokens: List[int] = field(default_factory=list)
    token_times: List[List[float]] = field(default_factory=list)  # per output, one per token
    cumulative_logprobs: List[Optional[float]] = field(default_factory=list)
    num_input_tokens: Optional[int] = None
    deltas: List[Delta] = field(default_factory=list)
    latency: float = 0.0          # seconds from sending to the last response

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""

    @property
    def ttft(self) -> Optional[float]:
        firsts = [times[0] for times in self.token_times if times]
        return min(firsts) if firsts else None

    @property
    def time_per_output_token(self) -> Optional[float]:
        """Mean gap between tokens after the first, over all outputs."""
        gaps = [(t[-1] - t[0]) / (len(t) - 1) for t in self.token_times if len(t) > 1]
        return sum(gaps) / len(gaps) if gaps else None

    def add(self, delta: Delta) -> None:
        while len(self.texts) <= delta.index:
            self.texts.append("")
            self.finish_reasons.append(None)
            self.num_output_tokens.append(0)
            self.token_times.append([])
            self.cumulative_logprobs.append(None)
        i = delta.index
        self.deltas.append(delta)
        self.texts[i] += delta.text
        self.num_output_tokens[i] += delta.num_tokens
        self.token_times[i].extend([delta.time] * delta.num_tokens)
        self.finish_reasons[i] = delta.finish_reason or self.finish_reasons[i]
        if delta.cumulative_logprob is not None:
            self.cumulative_logprobs[i] = delta.cumulative_logprob
        if delta.num_input_tokens is not None:
            self.num_input_tokens = delta.num_input_tokens
        self.latency = max(self.latency, delta.time)


def collect(deltas: Iterable[Delta]) -> Result:
    result = Result()
    for delta in deltas:
        result.add(delta)
    return result


async def acollect(deltas: AsyncIterator[Delta]) -> Result:
    result = Result()
    async for delta in deltas:
        result.add(delta)
    return result


class _Decoder:
    """Turns response arrays into deltas; skips empty ones and repeated finish reasons."""

    def __init__(self, n: int):
        self.n = n
        self.finished = set()

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.n

    def deltas(self, arrays: Dict[str, list], at: float) -> List[Delta]:
        texts = arrays.get("text_output") or []
        reasons, counts, logprobs = (_column(arrays, name, len(texts)) for name in
                                     ("finish_reason", "num_output_tokens", "cumulative_logprob"))
        num_input = (arrays.get("num_input_tokens") or [None])[0]
        out = []
        for i, text in enumerate(texts):
            text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
            reason = reasons[i].decode() if isinstance(reasons[i], bytes) else reasons[i]
            reason = None if reason in (None, "None", "") else reason
            new_finish = reason is not None and i not in self.finished
            if reason is not None:
                self.finished.add(i)
            num = int(counts[i]) if counts[i] is not None else 0
            if text or num or new_finish:
                out.append(Delta(text, i, at, reason if new_finish else None, num,
                                 None if num_input is None else int(num_input),
                                 None if logprobs[i] is None else float(logprobs[i])))
        return out


def _column(arrays: Dict[str, list], name: str, length: int) -> list:
    values = list(arrays.get(name) or [])
    return values + [None] * (length - len(values))


def _expected_outputs(params: Optional[dict]) -> int:
    return int((params or {}).get("n", 1) or 1)


def _grpc_inputs(module, prompt: str, params: Optional[dict], stream: bool,
                 exclude_input: Optional[bool], cumulative_logprob: bool = False, images=()) -> list:
    values = {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
              "stream": np.array([stream]),
              "sampling_parameters": np.array([json.dumps(params or {}).encode("utf-8")], dtype=np.object_),
              "return_finish_reason": np.array([True]),
              "return_num_input_tokens": np.array([True]),
              "return_num_output_tokens": np.array([True])}
    if exclude_input is not None:
        values["exclude_input_in_output"] = np.array([exclude_input])
    if cumulative_logprob:   # the server computes it only for requests that ask
        values["return_cumulative_logprob"] = np.array([True])
    inputs = []
    for name, value in values.items():
        tensor = module.InferInput(name, [1], "BYTES" if value.dtype == np.object_ else "BOOL")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    if images:   # the model's image input: one base64 image (or data URL) per element
        tensor = module.InferInput("image", [len(images)], "BYTES")
        tensor.set_data_from_numpy(np.array([i.encode("ascii") if isinstance(i, str) else i for i in images],
                                            dtype=np.object_))
        inputs.append(tensor)
    return inputs


def _arrays(result) -> Dict[str, list]:
    arrays = {}
    for name in OUTPUTS:
        value = result.as_numpy(name)
        if value is not None:
            arrays[name] = value.reshape(-1).tolist()
    return arrays


def grpc_stream(prompt: str, params: Optional[dict] = None, *, url: str = DEFAULT_GRPC_URL,
                model: str = DEFAULT_MODEL, stream: bool = True, exclude_input: Optional[bool] = None,
                timeout: float = 300.0, cumulative_logprob: bool = False,
                api_key: Optional[str] = None, images=()) -> Iterator[Delta]:
    """One request over a gRPC stream (tritonclient.grpc). Closing the generator
    early cancels the request on the server. ``cumulative_logprob``: ask for it
    (``Delta.cumulative_logprob``); ``api_key``: see ``api_key_of``; ``images``:
    base64 images (or data URLs) for the prompt (the model's ``image`` input)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    responses: "queue.Queue" = queue.Queue()
    decoder = _Decoder(_expected_outputs(params))
    client = grpcclient.InferenceServerClient(url)
    complete = False  # cancelling a completed request makes tritonserver 2.51 hold the model
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)),
                            stream_timeout=timeout, headers=triton_headers(api_key, grpc=True) or None)
        start = time.perf_counter()
        client.async_stream_infer(model, _grpc_inputs(grpcclient, prompt, params, stream, exclude_input,
                                                      cumulative_logprob, images),
                                  request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        while True:
            left = start + timeout - time.perf_counter()
            try:
                result, error = responses.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise TimeoutError(f"no complete answer from {url} within {timeout:.0f} s") from None
            if error is not None:
                complete = True
                raise ServerError(_message(error))
            deltas = decoder.deltas(_arrays(result), time.perf_counter() - start)
            final = result.get_response().parameters.get("triton_final_response")
            complete = (final is not None and final.bool_param) or (final is None and decoder.done)
            yield from deltas
            if complete:
                return
    except InferenceServerException as exc:
        # A broken stream reports its cause through the callback; prefer that.
        earlier = [e for _, e in list(responses.queue) if e is not None]
        raise ServerError(_message(earlier[0] if earlier else exc)) from None
    finally:
        client.stop_stream(cancel_requests=not complete)
        client.close()


async def grpc_stream_async(prompt: str, params: Optional[dict] = None, *, url: str = DEFAULT_GRPC_URL,
                            model: str = DEFAULT_MODEL, stream: bool = True,
                            exclude_input: Optional[bool] = None, timeout: float = 300.0,
                            client=None, cumulative_logprob: bool = False,
                            api_key: Optional[str] = None, images=()) -> AsyncIterator[Delta]:
    """One request over a gRPC stream (tritonclient.grpc.aio); pass ``client`` to
    share one connection between many concurrent requests. Closing the generator
    early cancels the request."""
    import tritonclient.grpc.aio as aioclient
    from tritonclient.utils import InferenceServerException

    own_client = client is None
    client = client or aioclient.InferenceServerClient(url)
    decoder = _Decoder(_expected_outputs(params))
    request = {"model_name": model, "request_id": uuid.uuid4().hex,
               "inputs": _grpc_inputs(aioclient, prompt, params, stream, exclude_input,
                                      cumulative_logprob, images)}

    async def requests():
        yield request

    start = time.perf_counter()
    responses = client.stream_infer(requests(), stream_timeout=timeout,
                                    headers=triton_headers(api_key, grpc=True) or None)
    complete = False
    try:
        async for result, error in responses:
            if error is not None:
                complete = True
                raise ServerError(_message(error))
            deltas = decoder.deltas(_arrays(result), time.perf_counter() - start)
            final = result.get_response().parameters.get("triton_final_response")
            complete = (final is not None and final.bool_param) or decoder.done
            for delta in deltas:
                yield delta
            if complete:
                return
        if not decoder.done:
            raise ServerError("the stream ended before every output finished")
    except InferenceServerException as exc:
        raise ServerError(_message(exc)) from None
    finally:
        if not complete:  # the consumer stopped early: cancel the request
            responses.cancel()
        if own_client:
            await client.close()


def http_stream(prompt: str, params: Optional[dict] = None, *, url: str = DEFAULT_HTTP_URL,
                model: str = DEFAULT_MODEL, stream: bool = True, exclude_input: Optional[bool] = None,
                timeout: float = 300.0, as_request_parameters: bool = False,
                cumulative_logprob: bool = False, api_key: Optional[str] = None) -> Iterator[Delta]:
    """One request to /v2/models/<model>/generate_stream (server-sent events).

    Sampling parameters go in the ``sampling_parameters`` input, or with
    ``as_request_parameters`` in the body's ``parameters`` object.
    """
    body = {"text_input": prompt, "stream": stream, "return_finish_reason": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True}
    if exclude_input is not None:
        body["exclude_input_in_output"] = exclude_input
    if cumulative_logprob:
        body["return_cumulative_logprob"] = True
    if as_request_parameters:
        body["parameters"] = params or {}
    else:
        body["sampling_parameters"] = json.dumps(params or {})
    base = url if "://" in url else f"http://{url}"
    request = urllib.request.Request(f"{base}/v2/models/{model}/generate_stream",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Accept": "text/event-stream", **triton_headers(api_key)})
    decoder = _Decoder(_expected_outputs(params))
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            for raw in reply:  # one SSE line at a time, as they arrive
                if time.perf_counter() - start > timeout:
                    raise TimeoutError(f"no complete answer from {base} within {timeout:.0f} s")
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = standard_json(line[len("data:"):])
                if "error" in event:
                    raise ServerError(event["error"])
                arrays = {k: v if isinstance(v, list) else [v] for k, v in event.items() if k in OUTPUTS}
                yield from decoder.deltas(arrays, time.perf_counter() - start)
    except urllib.error.HTTPError as exc:
        raise ServerError(_http_error(exc)) from None
    if not decoder.done:
        raise ServerError("the event stream ended before every output finished")


def standard_json(text: str):
    """``text`` decoded as standard JSON: NaN and the infinities, which other
    parsers refuse, are refused here too (ServerError)."""
    def refuse(constant):
        raise ServerError(f"the server sent {constant}, which is not standard JSON: {text[:200]!r}")
    return json.loads(text, parse_constant=refuse)


def sse_events(url: str, body: dict, timeout: float, api_key: Optional[str] = None) -> Iterator[dict]:
    """POST ``body`` as JSON and yield each server-sent event's JSON ``data``
    until ``[DONE]`` or the end; an event with an ``error`` raises ServerError.
    ``api_key`` (``api_key_of``) goes as ``Authorization: Bearer``."""
    key = api_key_of(api_key)
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        for raw in reply:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            event = standard_json(data)
            if "error" in event:
                error = event["error"]
                raise ServerError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
            yield event


def openai_stream(prompt: str, params: Optional[dict] = None, *, url: str = DEFAULT_OPENAI_URL,
                  model: str = DEFAULT_MODEL, chat: bool = False, timeout: float = 300.0,
                  api_key: Optional[str] = None) -> Iterator[Delta]:
    """One streamed request to the OpenAI-compatible API (``pagedbackend.serving.openai``):
    ``/v1/completions``, or ``/v1/chat/completions`` with ``prompt`` as the user's message.

    ``params`` keep vLLM's names (the API takes the ones OpenAI lacks as extra
    fields). Each chunk's token count is the growth of the running usage that
    ``stream_options.continuous_usage_stats`` adds to every chunk.
    """
    body = {"model": model, "stream": True, **(params or {}),
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if chat:
        body["messages"], path = [{"role": "user", "content": prompt}], "/v1/chat/completions"
    else:
        body["prompt"], path = prompt, "/v1/completions"
    base = url if "://" in url else f"http://{url}"
    expected, finished, tokens_seen = _expected_outputs(params), set(), 0
    start = time.perf_counter()
    try:
        for event in sse_events(f"{base.rstrip('/')}{path}", body, timeout, api_key):
            usage = event.get("usage") or {}
            new_tokens = usage.get("completion_tokens", tokens_seen) - tokens_seen
            tokens_seen += new_tokens
            at = time.perf_counter() - start
            for choice in event.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                reason = choice.get("finish_reason")
                if reason is not None:
                    finished.add(choice["index"])
                if text or new_tokens or reason:
                    yield Delta(text, choice["index"], at, reason, new_tokens, usage.get("prompt_tokens"))
    except urllib.error.HTTPError as exc:
        raise ServerError(_http_error(exc)) from None
    if len(finished) < expected:
        raise ServerError("the event stream ended before every output finished")


def generate(prompt: str, params: Optional[dict] = None, protocol: str = "grpc", **kwargs) -> Result:
    """Run one request to completion and return its Result."""
    streams = {"grpc": grpc_stream, "http": http_stream, "openai": openai_stream}
    if protocol not in streams:
        raise ValueError(f"protocol must be grpc, http or openai, got {protocol!r}")
    return collect(streams[protocol](prompt, params, **kwargs))


def _message(error) -> str:
    text = error.message() if callable(getattr(error, "message", None)) else str(error)
    return text or str(error)


def _http_error(exc: "urllib.error.HTTPError") -> str:
    """The error text of a refused request: a JSON body or a server-sent event."""
    try:
        body = exc.read().decode("utf-8", "replace").strip()
    except OSError:
        body = ""
    detail = body
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("data:"):
            line = line[len("data:"):]
        try:
            error = json.loads(line).get("error", detail)
            detail = error.get("message", error) if isinstance(error, dict) else error  # OpenAI's error object
            break
        except (ValueError, AttributeError):
            continue
    return f"HTTP {exc.code}: {detail or exc.reason}"
