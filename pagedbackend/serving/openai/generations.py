"""One OpenAI request run on Triton and answered: its prompts' streams
started, the client's hang-up watched, the answer written as its shape says;
and every generation still open, so that a stopping server ends each one."""
import asyncio
import functools
import json
from typing import AsyncIterator, Callable, List, Optional, Sequence

from fastapi import Request
from fastapi.responses import Response

from pagedbackend.serving.constants import SHUTTING_DOWN
from pagedbackend.serving.openai.answers import SSE_DONE, Answer, Run, sse
from pagedbackend.serving.openai.asgi import EventStream
from pagedbackend.serving.openai.offload import run_sized
from pagedbackend.serving.openai.protocol import OpenAIError
from pagedbackend.serving.openai.triton_client import ClientGone, Generation, Triton, prompt_size


async def _watch_disconnect(receive, on_disconnect: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


async def _prepend(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


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
                 logprobs: bool, shape: Answer, stream: bool, open_generations: OpenGenerations,
                 images: Sequence[str] = ()) -> Response:
    """Run the prompts on Triton (with ``images``, as sent: the model's
    ``image`` input) and answer as ``shape`` says.

    The first update is awaited before answering, so that a request the model
    refuses gets an HTTP error status even when streaming. The client hanging
    up, at any point, cancels the Triton requests still running."""
    if open_generations.closing:
        raise OpenAIError(503, open_generations.closing)
    outputs = {o["name"] for o in (await triton.config(model)).get("output", [])}
    if shape.wants_prompt_logprobs and "prompt_logprobs" not in outputs:
        raise OpenAIError(400, f"echo with logprobs needs prompt log-probabilities, which model {model} "
                          "does not return (no prompt_logprobs output)", "echo")
    cached = "num_cached_tokens" in outputs
    generation = Generation([functools.partial(triton.stream, model, p, params, logprobs, cached,
                                               shape.wants_prompt_logprobs, images=images) for p in prompts],
                            [prompt_size(p) for p in prompts])
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
    return Response(await run_sized(answer_size(run), render, shape.whole, run), media_type="application/json")


def answer_size(run: Run) -> int:
    """About how many characters a whole answer writes (log-probabilities:
    some per entry)."""
    size = sum(len(c.text) + 64 * len(c.positions) for c in run.choices)
    return size + sum(64 * len(p) for p in run.prompt_logprobs if p)


def render(whole: Callable[[Run], dict], run: Run) -> bytes:
    """The whole answer as standard JSON (as JSONResponse writes it)."""
    return json.dumps(whole(run), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")

