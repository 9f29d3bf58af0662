"""Work that would hold up the event loop: tokenising and detokenising,
chat templates, decoding and checking large request bodies, writing large
answers. Small pieces run in place (a thread hop costs more than they do);
larger ones on worker threads, so that one client's megabyte of text holds
up nobody else's request. The very large ones (a 960 KB text takes 2-4 s to
tokenise here) have a thread of their own: they queue behind each other, not
in front of medium ones, and leave the other core to the model. The
tokenizers release the GIL while they work (measured: the loop ran
throughout a 4 s tokenisation of 960 KB, its longest pause 67 ms)."""
import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

INLINE_CHARS = 16 * 1024   # pieces of at most this size (characters, tokens) run in place
LARGE_CHARS = 256 * 1024   # pieces above this size run on the thread for very large ones

T = TypeVar("T")
_medium = ThreadPoolExecutor(2, thread_name_prefix="openai-offload")
_large = ThreadPoolExecutor(1, thread_name_prefix="openai-offload-large")


async def run_sized(size: int, work: Callable[..., T], *args, **kwargs) -> T:
    """``work(*args, **kwargs)``: in place when ``size`` is at most
    INLINE_CHARS, else on a worker thread while the loop serves others."""
    if size <= INLINE_CHARS:
        return work(*args, **kwargs)
    pool = _large if size > LARGE_CHARS else _medium
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(work, *args, **kwargs))
