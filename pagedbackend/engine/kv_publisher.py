"""Publishing KV-cache events as vLLM does (``kv_events_config``), for routers
that route by the blocks each engine holds.

Wire format (vLLM's, what Dynamo's KV router and llm-d read): one ZMQ
multipart message per engine step that had events: ``[topic, 8-byte
big-endian sequence number, msgpack([timestamp, [event, ...],
data_parallel_rank])]``, each event a tagged array (``core/kv_events.py``).

The engine thread only queues a batch (``publish`` never waits); a thread of
the publisher's own encodes and sends it and keeps the last ``buffer_steps``
for replay: a subscriber that joined late or saw a gap in the sequence numbers
sends the number to start from to the ROUTER ``replay_endpoint`` and gets
``[sequence, payload]`` for every buffered batch from there on, then
``[-1, b""]``.
"""
import collections
import logging
import queue
import threading
import time
from typing import Optional

from ..core.kv_events import MEDIUM_DISK, KVEventLog
from ..kv_events_config import KVEventsConfig

logger = logging.getLogger("pagedbackend")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05


def encode_batch(timestamp: float, events: list, dp_rank: int = 0) -> bytes:
    import msgpack
    return msgpack.packb([timestamp, [event.wire() for event in events], dp_rank], use_bin_type=True)


class NullPublisher:
    """Events off: nothing is sent."""
    dropped = 0
    sent = 0

    def publish(self, events: list) -> None:
        return None

    def shutdown(self) -> None:
        return None


class ZmqPublisher:
    """A PUB socket (and optionally a ROUTER socket for replay) served by one thread."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0):
        import zmq
        self.config, self.dp_rank = config, dp_rank
        self._queue: "queue.Queue" = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque = collections.deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot bind {exc}") from None
        self._topic = config.topic.encode("utf-8")
        self.sent = 0          # batches sent
        self.dropped = 0       # batches dropped because the queue was full
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="pagedbackend-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """Queue one step's events; never blocks the engine step."""
        if not events or self._stopping:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("KV-event queue full (%d batches): batches are dropped, so routers see a "
                               "stale cache", self.config.max_queue_size)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout``), then close the sockets."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def _serve(self) -> None:
        sequence = 0
        while True:
            if self._replay is not None:
                self._answer_replays()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            timestamp, events = item
            try:
                payload = encode_batch(timestamp, events, self.dp_rank)
                seq = sequence.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
            except Exception:   # a batch that cannot go out must not stop the next ones
                logger.exception("KV-event batch %d could not be sent", sequence)
                continue
            self._buffer.append((seq, payload))
            sequence += 1
            self.sent += 1

    def _answer_replays(self) -> None:
        import zmq
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignored a KV-event replay request of %d frames", len(frames))
                continue
            client, _empty, start = frames
            first = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self._buffer):
                    if int.from_bytes(seq, "big") >= first:
                        self._replay.send_multipart((client, b"", seq, payload), flags=zmq.NOBLOCK)
                self._replay.send_multipart((client, b"", END_OF_REPLAY, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("a KV-event replay could not be sent whole (the subscriber is not reading)")


def make_publisher(config: Optional[KVEventsConfig], dp_rank: int = 0):
    """The publisher ``kv_events_config`` asks for (a NullPublisher when off)."""
    if config is None or not config.publishes:
        return NullPublisher()
    return ZmqPublisher(config, dp_rank)


class KVEventRelay:
    """The engine's end of ``kv_events_config``: the block pool records its
    events in a log (``medium``: the pool's, vLLM's "GPU" or "CPU"), and
    ``flush`` (once per engine step) hands them to the publisher as one
    batch, with the disk tier's (``tier``, medium "DISK") after them."""

    def __init__(self, config: Optional[KVEventsConfig], prefix_caching: bool, pool, medium: Optional[str] = None):
        self.publisher = make_publisher(config)
        self.pool = pool
        self.tier = None   # the disk tier (engine/kv_tier.py), when kv_offload_dir is set
        if config is not None and config.publishes:
            if prefix_caching:
                pool.events = KVEventLog(medium)
            else:
                logger.warning("kv_events_config is on but enable_prefix_caching is off: no block enters "
                               "the prefix cache, so no event is published")

    def flush(self) -> None:
        """Publish what the block pool and the disk tier recorded since the last flush."""
        log = self.pool.events
        if self.tier is not None:
            for kind, what in self.tier.take_events():
                if log is None:
                    continue
                if kind == "stored":
                    log.stored(what.key, what.parent_key, what.token_ids, what.salt, medium=MEDIUM_DISK)
                else:
                    log.removed(what, medium=MEDIUM_DISK)
        if log is not None and log.events:
            self.publisher.publish(log.take())

    def shutdown(self) -> None:
        """Send what is queued, then close the publisher's sockets; the disk
        tier writes what it has queued."""
        self.publisher.shutdown()
        if self.tier is not None:
            self.tier.close()
