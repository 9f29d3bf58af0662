"""Standard JSON only: ``strict_loads`` refuses ``NaN``, ``Infinity`` and
``-Infinity`` (which Python's parser accepts and no other does), and
``StrictResponses`` checks every JSON body and every server-sent event that
an httpx client (the openai client included) reads while it is installed.
The API tests run under it (``tests/serving/conftest.py``)."""
import json
from typing import List

import httpx


def _refuse(constant: str):
    raise ValueError(f"{constant} is not standard JSON")


def strict_loads(text):
    """``json.loads`` that refuses NaN and the infinities."""
    return json.loads(text, parse_constant=_refuse)


def check_body(body: bytes, content_type: str, complete: bool) -> List[str]:
    """What is not standard JSON in a response body: the whole of a JSON body
    (read to its end), each complete event of an event stream."""
    problems = []
    if "text/event-stream" in content_type:
        events = body.split(b"\n\n")
        for event in events if complete else events[:-1]:
            for line in event.split(b"\n"):
                data = line[len(b"data:"):].strip() if line.startswith(b"data:") else None
                if data and data != b"[DONE]":
                    problems += _check(data)
    elif "json" in content_type and complete and body:
        problems += _check(body)
    return problems


def _check(text: bytes) -> List[str]:
    try:
        strict_loads(text)
    except ValueError as exc:
        return [f"{exc}: {text[:300]!r}"]
    return []


class _Recorder:
    def __init__(self, response: httpx.Response, problems: List[str]):
        self.content_type = response.headers.get("content-type", "")
        self.body, self.complete, self.problems = bytearray(), False, problems

    def add(self, chunk: bytes) -> None:
        self.body += chunk

    def close(self) -> None:
        self.problems += check_body(bytes(self.body), self.content_type, self.complete)


class _SyncStream(httpx.SyncByteStream):
    def __init__(self, stream, recorder: _Recorder):
        self._stream, self._recorder = stream, recorder

    def __iter__(self):
        for chunk in self._stream:
            self._recorder.add(chunk)
            yield chunk
        self._recorder.complete = True

    def close(self) -> None:
        self._recorder.close()
        self._stream.close()


class _AsyncStream(httpx.AsyncByteStream):
    def __init__(self, stream, recorder: _Recorder):
        self._stream, self._recorder = stream, recorder

    async def __aiter__(self):
        async for chunk in self._stream:
            self._recorder.add(chunk)
            yield chunk
        self._recorder.complete = True

    async def aclose(self) -> None:
        self._recorder.close()
        await self._stream.aclose()


class StrictResponses:
    """While installed, every response body read through httpx is checked;
    ``problems`` lists what was not standard JSON."""

    def __init__(self):
        self.problems: List[str] = []
        self._saved = None

    def install(self) -> None:
        sync, async_ = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request
        self._saved = (sync, async_)
        problems = self.problems

        def handle_request(transport, request):
            response = sync(transport, request)
            response.stream = _SyncStream(response.stream, _Recorder(response, problems))
            return response

        async def handle_async_request(transport, request):
            response = await async_(transport, request)
            response.stream = _AsyncStream(response.stream, _Recorder(response, problems))
            return response
        httpx.HTTPTransport.handle_request = handle_request
        httpx.AsyncHTTPTransport.handle_async_request = handle_async_request

    def uninstall(self) -> None:
        httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request = self._saved
