"""What a KV-aware router learns from an engine's KV-cache events: its view
of the prefix cache, built by applying events in order and checking the rules
a router relies on (a block stored under a known parent, removed only after
its children), and a ZMQ subscriber that reads vLLM's wire format."""
import time

import msgpack
import zmq

from pagedbackend.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_hash


def decode_event(fields: list):
    """One wire event (a tagged array) back as the dataclass."""
    tag, rest = fields[0], fields[1:]
    if tag == "BlockStored":
        keys = rest[7] if len(rest) > 7 else None
        return BlockStored(rest[0], rest[1], rest[2], rest[3], rest[4], rest[5], rest[6],
                           None if keys is None else [None if k is None else tuple(k) for k in keys])
    if tag == "BlockRemoved":
        return BlockRemoved(rest[0], rest[1])
    assert tag == "AllBlocksCleared", f"unknown event {tag!r}"
    return AllBlocksCleared()


class RouterView:
    """Block hash -> (parent hash, tokens, extra keys), from events."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks = {}

    def apply(self, events) -> None:
        """The pool's events ("DISK" ones, the disk tier's, are another view)."""
        bs = self.block_size
        for event in events:
            if getattr(event, "medium", None) == "DISK":
                continue
            if isinstance(event, BlockStored):
                assert event.block_size == bs and len(event.token_ids) == bs * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert parent is None or parent in self.blocks, "stored under a parent the router lacks"
                    assert h not in self.blocks, "stored twice"
                    keys = None if event.extra_keys is None else event.extra_keys[i]
                    self.blocks[h] = (parent, tuple(event.token_ids[i * bs:(i + 1) * bs]), keys)
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert h in self.blocks, "removed a block the router does not hold"
                    assert all(p != h for p, _, _ in self.blocks.values()), "a parent left before its child"
                    del self.blocks[h]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()

    def expected(self, pool) -> dict:
        """The view a block pool's prefix cache should give."""
        return {external_hash(h): (None if b.parent_hash is None else external_hash(b.parent_hash),
                                   b.token_ids, (b.salt.decode(),) if b.salt else None)
                for h, b in pool.cached.items()}


class Subscriber:
    """A SUB socket on a publisher's endpoint; ``read`` returns (sequence, batch)
    pairs until the socket stays quiet for ``quiet_s``."""

    def __init__(self, endpoint: str, topic: str = ""):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        time.sleep(0.3)   # a SUB socket misses what is sent before it has joined

    def read(self, quiet_s: float = 0.5) -> list:
        batches = []
        while self.socket.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.socket.recv_multipart()
            timestamp, events, dp_rank = msgpack.unpackb(payload)
            batches.append((int.from_bytes(seq, "big"), [decode_event(e) for e in events]))
        return batches

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def replay(endpoint: str, start: int, timeout_s: float = 5.0) -> list:
    """(sequence, payload) pairs a publisher's replay socket sends from ``start`` on."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while sock.poll(int(timeout_s * 1000)):
            _empty, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return got
            got.append((int.from_bytes(seq, "big"), payload))
        raise TimeoutError("the replay did not end")
    finally:
        sock.close()
        context.term()
