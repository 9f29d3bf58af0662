"""A Dynamo worker (NVIDIA Dynamo 1.6.1, ``dynamo.common.backend``) in front
of one replica: a tritonserver serving our model.

It registers the model with Dynamo (token ids in and out; the frontend
tokenises, applies the chat template and detokenises from ``--model-path``),
relays the replica's KV-cache events (vLLM's ZMQ format, read by Dynamo's own
relay) to Dynamo's KV router, reports the replica's KV usage as Dynamo's
worker load and its running and waiting requests as ``pagedbackend:``
gauges on the worker's metrics, maps Dynamo's sampling and stop options to
ours (refusing by name what it cannot honour), cancels a request whose client
went away, and goes when its replica goes (so the router stops sending it
requests). SIGTERM drains through Dynamo's own worker lifecycle.
"""
import argparse
import asyncio
import json
import logging
import os
import pathlib
import signal
from typing import Dict, Optional

from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import ComponentSnapshot, ZmqSource
from dynamo.llm.exceptions import Disconnected, InvalidArgument, Unknown

from pagedbackend.serving.constants import SERVED_MODEL, SHUTTING_DOWN
from pagedbackend.serving.dynamo.replica import Load, Replica
from pagedbackend.serving.dynamo.requests import Unsupported, chunk, final_fields, sampling_parameters
from pagedbackend.serving.openai.protocol import OpenAIError
from pagedbackend.serving.openai.triton_client import ClientGone

logger = logging.getLogger("pagedbackend.dynamo")
LOAD_PERIOD_S = 0.5


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.serving.dynamo",
                                     description="A Dynamo worker in front of one pagedbackend replica.")
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="the replica's gRPC address")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics", help="the replica's metrics")
    parser.add_argument("--triton-model", default=SERVED_MODEL, help="the model's name on the replica")
    parser.add_argument("--model-path", required=True,
                        help="the model folder (tokenizer, chat template, config.json) the frontend reads")
    parser.add_argument("--served-model-name", default=SERVED_MODEL, help="the model's name for clients")
    parser.add_argument("--block-size", type=int, default=16, help="the replica's KV block size")
    parser.add_argument("--context-length", type=int, help="default: the model's max_position_embeddings")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--kv-events-endpoint", help="the replica's kv_events_config endpoint (none: no KV routing)")
    parser.add_argument("--kv-events-topic", default="")
    parser.add_argument("--namespace", default=env("DYN_NAMESPACE", "pagedbackend"))
    parser.add_argument("--component", default="backend")
    parser.add_argument("--endpoint", default="generate")
    parser.add_argument("--discovery-backend", default=env("DYN_DISCOVERY_BACKEND", "etcd"))
    parser.add_argument("--request-plane", default=env("DYN_REQUEST_PLANE", "tcp"))
    parser.add_argument("--event-plane", default=env("DYN_EVENT_PLANE"))
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the replica")
    return parser.parse_args(argv)


def context_length_of(model_path: str) -> int:
    config = json.loads((pathlib.Path(model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("max_seq_len") or 2048)


class ReplicaWorker(LLMEngine):
    """Dynamo's engine contract, served by a replica over gRPC."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.replica = Replica(args.triton_url, args.metrics_url, args.triton_model)
        self.context_length = args.context_length or context_length_of(args.model_path)
        self.streams: Dict[str, object] = {}   # Dynamo request id -> its Triton stream
        self.tasks = []
        self.leaving = False
        self.snapshots = None
        self.registry = None
        self.gauges = {}

    @classmethod
    async def from_args(cls, argv=None):
        args = parse_args(argv)
        engine = cls(args)
        config = WorkerConfig(namespace=args.namespace, component=args.component, endpoint=args.endpoint,
                              model_name=args.model_path, served_model_name=args.served_model_name,
                              discovery_backend=args.discovery_backend, request_plane=args.request_plane,
                              event_plane=args.event_plane)
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        await self.replica.open(self.args.ready_timeout)
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self.replica.poll_load(LOAD_PERIOD_S, self._report_load)),
                      loop.create_task(self.replica.watch(self._replica_gone))]
        logger.info("worker %s serves %s at %s (%d KV blocks)", worker_id, self.args.served_model_name,
                    self.args.triton_url, self.replica.load.kv_blocks_total)
        return EngineConfig(model=self.args.model_path, served_model_name=self.args.served_model_name,
                            llm=LlmRegistration(context_length=self.context_length,
                                                kv_cache_block_size=self.args.block_size,
                                                total_kv_blocks=self.replica.load.kv_blocks_total or None,
                                                max_num_seqs=self.args.max_num_seqs,
                                                max_num_batched_tokens=self.args.max_num_batched_tokens))

    async def kv_event_sources(self):
        if not self.args.kv_events_endpoint:
            return []
        return [ZmqSource(endpoint=self.args.kv_events_endpoint, topic=self.args.kv_events_topic, dp_rank=0)]

    # ------------------------------------------------------------ load
    def component_metrics_dp_ranks(self):
        return [0]

    def attach_snapshot_publisher(self, publisher) -> None:
        self.snapshots = publisher

    async def register_prometheus(self, metrics) -> None:
        from prometheus_client import CollectorRegistry, Gauge
        from dynamo.common.backend.metrics import register_engine_registry
        self.registry = CollectorRegistry()
        self.gauges = {name: Gauge(f"pagedbackend:{name}", text, registry=self.registry) for name, text in (
            ("num_requests_running", "Requests the replica is decoding."),
            ("num_requests_waiting", "Requests queued on the replica."),
            ("kv_cache_usage_ratio", "The replica's used KV blocks / total."))}
        register_engine_registry(metrics, self.registry, prefix_filters=["pagedbackend:"])

    def _report_load(self, load: Load) -> None:
        if self.snapshots is not None:
            self.snapshots.publish(0, ComponentSnapshot(
                kv_used_blocks=load.kv_blocks_used, kv_total_blocks=load.kv_blocks_total,
                gpu_cache_usage=load.kv_usage, dp_rank=0, kv_cache_hit_rate=load.hit_rate))
        if self.gauges:
            self.gauges["num_requests_running"].set(load.num_requests_running)
            self.gauges["num_requests_waiting"].set(load.num_requests_waiting)
            self.gauges["kv_cache_usage_ratio"].set(load.kv_usage)

    async def _replica_gone(self) -> None:
        """Leave the fleet: Dynamo's worker unregisters on SIGTERM, so the router
        stops choosing us; the requests still open end with an error."""
        if self.leaving:
            return
        self.leaving = True
        for stream in list(self.streams.values()):
            stream.cancel("the replica went away")
        os.kill(os.getpid(), signal.SIGTERM)

    async def _check_replica(self) -> None:
        """After a request found the replica unreachable: leave at once if it is gone."""
        if not await self.replica.triton.ready(self.replica.model):
            await self._replica_gone()

    # ------------------------------------------------------------ requests
    async def generate(self, request, context):
        try:
            token_ids, params = sampling_parameters(request, self.context_length)
        except Unsupported as exc:
            raise InvalidArgument(str(exc)) from None
        stream = self.replica.stream(token_ids, params, logprobs=params.get("logprobs") is not None)
        request_id = context.id()
        self.streams[request_id] = stream
        completion = 0
        try:
            async for update in stream:
                if context.is_stopped():
                    stream.cancel()
                    return
                ids = (update.token_ids or [[]])[0]
                completion += len(ids)
                out = chunk(ids, update.logprobs[0] if update.logprobs else None)
                reason = update.reasons[0] if update.reasons else None
                if reason is not None:
                    out.update(final_fields(reason, update.num_input_tokens or len(token_ids), completion,
                                            update.num_cached_tokens))
                if ids or reason is not None:
                    yield out
        except ClientGone:
            return
        except OpenAIError as exc:
            if exc.status == 400:
                raise InvalidArgument(exc.message) from None
            if exc.status == 503 or SHUTTING_DOWN in exc.message:   # another replica can take it
                self.tasks.append(asyncio.get_running_loop().create_task(self._check_replica()))
                raise Disconnected(f"replica {self.args.triton_url}: {exc.message}") from None
            raise Unknown(f"replica {self.args.triton_url}: {exc.message}") from None
        finally:
            self.streams.pop(request_id, None)
            stream.cancel()

    async def abort(self, context) -> None:
        stream = self.streams.pop(context.id(), None)
        if stream is not None:
            stream.cancel()

    async def cleanup(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        for stream in list(self.streams.values()):
            stream.cancel()
        await self.replica.close()


def main(argv=None) -> None:
    from dynamo.common.backend.run import run
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(ReplicaWorker, argv)
