"""The HTTP plumbing under the OpenAI app: ASGI middleware that checks API
keys, caps the requests in flight per key, caps request bodies and turns unanswered exceptions into OpenAI error objects, uvicorn's
HTTP protocol answering a malformed or oversized request head with one too,
and a server-sent-events response fed straight from an async iterator."""
import json
import logging
import uuid
from typing import AsyncIterator, Dict, Sequence

from fastapi.responses import JSONResponse, Response

from pagedbackend.serving.openai.protocol import OpenAIError
from pagedbackend.serving.security import bearer, key_matches

logger = logging.getLogger("pagedbackend.openai")
DRAIN_AFTER_REFUSAL_S = 5.0   # how long a refused request head may still be sent


class ApiKeyAuth:
    """ASGI middleware: with ``keys``, every route but ``open_paths`` needs
    ``Authorization: Bearer KEY`` with one of them; others get 401 and an
    OpenAI error object (``invalid_api_key``) before anything else runs."""

    def __init__(self, app, keys: Sequence[str], open_paths: Sequence[str] = ("/health",)):
        self.app, self.keys, self.open_paths = app, list(keys), set(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths \
                or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        token = bearer(headers.get(b"authorization", b"").decode("latin-1"))
        if key_matches(token, self.keys):
            return await self.app(scope, receive, send)
        error = OpenAIError(401, "Incorrect API key provided: send it as 'Authorization: Bearer KEY'"
                            if token else "Missing API key: send it as 'Authorization: Bearer KEY'",
                            None, "invalid_api_key")
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class ConcurrencyPerKey:
    """ASGI middleware: at most ``limit`` requests in flight per API key (per
    client address when the API has no keys); one more gets 429 and an OpenAI
    error object (``rate_limit_exceeded``) naming the limit. A request counts
    from its head to the last byte of its answer (a body still arriving and a
    stream still open hold their place); ``open_paths`` are not counted."""

    def __init__(self, app, limit: int, keyed: bool, open_paths: Sequence[str] = ("/health",)):
        self.app, self.limit, self.keyed, self.open_paths = app, limit, keyed, set(open_paths)
        self.in_flight: Dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.limit <= 0 or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        if self.keyed:   # ApiKeyAuth, outside this one, admitted only the keys
            who = bearer(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")) or ""
        else:
            who = (scope.get("client") or ("",))[0]
        if self.in_flight.get(who, 0) >= self.limit:
            error = OpenAIError(429, f"too many concurrent requests: {self.limit} per "
                                f"{'API key' if self.keyed else 'client address'} (max_concurrent_per_key)",
                                None, "rate_limit_exceeded")
            return await JSONResponse(error.body(), status_code=429)(scope, receive, send)
        self.in_flight[who] = self.in_flight.get(who, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[who] -= 1
            if not self.in_flight[who]:
                del self.in_flight[who]


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
            # The client learns an id to quote, not the exception (it may name
            # internal files, addresses or shared-memory regions).
            incident = uuid.uuid4().hex[:12]
            logger.error("unhandled error %s in %s %s", incident, scope.get("method"), scope.get("path"),
                         exc_info=exc)
            if state["ended"]:
                return
            if state["started"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            error = OpenAIError(500, f"internal error (logged on the server as {incident})")
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



def h11_protocol_with_error_objects():
    """uvicorn's h11 protocol class whose refusal of a request head it cannot
    read (malformed, or over ``h11_max_incomplete_event_size``: 431) is an
    OpenAI error object rather than uvicorn's plain text. Built on first use,
    so that importing this module does not import uvicorn."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ErrorObjectH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.refusal = 400
            next_event = self.conn.next_event

            def watched_next_event():   # keeps h11's status for the head it refused
                try:
                    return next_event()
                except h11.RemoteProtocolError as exc:
                    self.refusal = exc.error_status_hint
                    raise
            self.conn.next_event = watched_next_event

        def send_400_response(self, msg: str) -> None:
            status = self.refusal if 400 <= self.refusal < 500 else 400
            message = ("the request line and headers are larger than the limit of "
                       f"{self.config.h11_max_incomplete_event_size} bytes" if status == 431 else
                       "the request is not valid HTTP/1.1")
            body = json.dumps(OpenAIError(status, message).body()).encode("utf-8")
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            # Half-close and read on (dropping it) what the client still sends, so that
            # it reads the answer rather than a reset; closed at the end, or at a bound.
            self.dropped = 0
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(DRAIN_AFTER_REFUSAL_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if getattr(self, "dropped", None) is None:
                return super().data_received(data)
            self.dropped += len(data)
            if self.dropped > BodySizeLimit.DRAIN_LIMIT_BYTES:
                self.transport.close()

    return ErrorObjectH11Protocol
