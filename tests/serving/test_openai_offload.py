"""The OpenAI server's fairness plumbing without a server: a request's prompts
start a few at a time (about PROMPT_TOKENS_IN_FLIGHT prompt tokens in
flight, at least one), later ones as earlier ones finish, none after a
cancel; large pieces of work run off the event loop while small ones run in
place. The streams here are plain async iterators standing in for Triton's
(what is tested is only when each one starts)."""
import asyncio
import threading

import pytest

from pagedbackend.serving.openai.offload import INLINE_CHARS, LARGE_CHARS, run_sized
from pagedbackend.serving.openai.triton_client import PROMPT_TOKENS_IN_FLIGHT, ClientGone, Generation, prompt_size


class Stream:
    """Two updates, then the end; records how many streams were open when it started."""

    def __init__(self, i: int, log: dict):
        self.i, self.log, self.cancelled = i, log, False
        log["open"] += 1
        log["most"] = max(log["most"], log["open"])
        log["started"].append(i)
        self.left = 2

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.cancelled:
            raise ClientGone()
        if not self.left:
            self.log["open"] -= 1
            raise StopAsyncIteration
        self.left -= 1
        return f"update of {self.i}"

    def cancel(self, reason=None):
        self.cancelled = True


def run_generation(sizes, stop_after=None):
    log = {"open": 0, "most": 0, "started": []}
    generation = Generation([lambda i=i: Stream(i, log) for i in range(len(sizes))], sizes)

    async def read():
        seen = []
        try:
            async for prompt, update in generation.updates():
                seen.append(prompt)
                if stop_after is not None and len(seen) == stop_after:
                    generation.cancel()
        except ClientGone:
            pass
        return seen
    return asyncio.run(read()), log


def test_long_prompts_of_one_request_run_one_at_a_time_in_order():
    seen, log = run_generation([prompt_size([1] * 366)] * 64)
    assert log["most"] == 1 and log["started"] == list(range(64))
    assert sorted(seen) == [i for i in range(64) for _ in range(2)]


def test_short_prompts_run_together_up_to_the_token_allowance():
    seen, log = run_generation([prompt_size("x" * 80)] * 64)   # 20 tokens each
    assert log["most"] == PROMPT_TOKENS_IN_FLIGHT // 20 and len(seen) == 128


def test_no_prompt_starts_after_a_cancel():
    _, log = run_generation([300] * 10, stop_after=1)
    assert log["started"] == [0]


def test_large_work_runs_off_the_loop_very_large_work_apart_and_small_work_in_place():
    threads = {}

    async def main():
        threads["small"] = await run_sized(10, threading.get_ident)
        threads["medium"] = await run_sized(INLINE_CHARS + 1, threading.get_ident)
        threads["large"] = await run_sized(LARGE_CHARS + 1, threading.get_ident)
        threads["loop"] = threading.get_ident()
        with pytest.raises(ValueError, match="refused"):
            await run_sized(INLINE_CHARS + 1, _refuse)
    asyncio.run(main())
    assert threads["small"] == threads["loop"] and len({threads["loop"], threads["medium"], threads["large"]}) == 3


def _refuse():
    raise ValueError("refused")
