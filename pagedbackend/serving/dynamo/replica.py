"""The replica a Dynamo worker fronts: its tritonserver over gRPC (one stream
per request, token ids in through ``input_ids``, out through ``output_ids``),
its load read from Triton's ``/metrics``, and a watch that notices when it
has gone."""
import asyncio
import logging
import urllib.request
from dataclasses import dataclass
from typing import Awaitable, Callable, Dict, List, Optional

from pagedbackend.serving.openai.triton_client import Triton, TritonStream

logger = logging.getLogger("pagedbackend.dynamo")

LOAD_GAUGES = ("kv_blocks_used", "kv_blocks_total", "num_requests_running", "num_requests_waiting",
               "prefix_cache_hits_total", "prefix_cache_queries_total")


@dataclass
class Load:
    """The replica's engine as its metrics show it."""
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    prefix_cache_hits_total: float = 0.0
    prefix_cache_queries_total: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def hit_rate(self) -> Optional[float]:
        """Cached over looked-up prompt tokens so far; None before any lookup."""
        q = self.prefix_cache_queries_total
        return self.prefix_cache_hits_total / q if q else None


def parse_load(text: str, model: str) -> Load:
    """The ``pagedbackend:*`` gauges and counters of ``model`` in a metrics page."""
    values: Dict[str, float] = {}
    label = f'model="{model}"'
    for line in text.splitlines():
        if not line.startswith("pagedbackend:") or label not in line:
            continue
        name = line.split("{", 1)[0][len("pagedbackend:"):]
        if name in LOAD_GAUGES:
            values[name] = float(line.rsplit(" ", 1)[1])
    load = Load(**{k: (int(v) if isinstance(getattr(Load, k), int) else v) for k, v in values.items()})
    return load


class Replica:
    """One tritonserver serving ``model`` (gRPC ``grpc_url``, metrics ``metrics_url``)."""

    def __init__(self, grpc_url: str, metrics_url: str, model: str):
        self.grpc_url, self.metrics_url, self.model = grpc_url, metrics_url, model
        self.triton = Triton(grpc_url)
        self.load = Load()

    async def open(self, ready_timeout_s: float) -> None:
        """Connect and wait until the model is ready (a replica may start after us)."""
        await self.triton.open()
        deadline = asyncio.get_running_loop().time() + ready_timeout_s
        while not await self.triton.ready(self.model):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"model {self.model} at {self.grpc_url} not ready after {ready_timeout_s:.0f} s")
            await asyncio.sleep(0.5)
        self.load = await self.read_load()

    async def close(self) -> None:
        await self.triton.close()

    def stream(self, token_ids: List[int], params: dict, logprobs: bool) -> TritonStream:
        return self.triton.stream(self.model, token_ids, params, logprobs, cached_tokens=True, output_ids=True)

    async def read_load(self) -> Load:
        def fetch() -> str:
            with urllib.request.urlopen(self.metrics_url, timeout=5.0) as reply:
                return reply.read().decode()
        return parse_load(await asyncio.to_thread(fetch), self.model)

    async def poll_load(self, period_s: float, on_load: Callable[[Load], None]) -> None:
        """Read the load every ``period_s`` and hand it on (a failed read is skipped)."""
        while True:
            try:
                self.load = await self.read_load()
                on_load(self.load)
            except Exception as exc:   # the watch decides whether the replica is gone
                logger.debug("replica metrics unreadable: %r", exc)
            await asyncio.sleep(period_s)

    async def watch(self, on_gone: Callable[[], Awaitable[None]], period_s: float = 1.0, misses: int = 3) -> None:
        """Call ``on_gone`` once the model has not answered ready ``misses`` times in a row."""
        missed = 0
        while True:
            await asyncio.sleep(period_s)
            missed = 0 if await self.triton.ready(self.model) else missed + 1
            if missed >= misses:
                logger.error("replica %s (model %s) is gone", self.grpc_url, self.model)
                await on_gone()
                return
