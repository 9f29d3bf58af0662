"""Work that would hold up the event loop: tokenising and detokenising,
chat templates, decoding and checking large request bodies, writing large
answers. Small pieces run in place (a thread hop costs more than they do);
large ones run on a few worker threads, so that one client's megabyte of text
holds up nobody else's request. The tokenizers release the GIL while they
work (measured: the loop ran throughout a 4 s tokenisation of 960 KB, its
longest pause 67 ms)."""
import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

WORKERS = 2              # threads for large pieces (they queue beyond that)
INLINE_CHARS = 16 * 1024  # pieces of at most this size (characters, tokens) run in place

T = TypeVar("T")
_pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="openai-offload")


async def run_sized(size: int, work: Callable[..., T], *args, **kwargs) -> T:
    """``work(*args, **kwargs)``: in place when ``size`` is at most
    INLINE_CHARS, else on a worker thread while the loop serves others."""
    if size <= INLINE_CHARS:
        return work(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(work, *args, **kwargs))
