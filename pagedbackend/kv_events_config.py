"""vLLM's ``kv_events_config``: KV-cache events (blocks entering and leaving
the prefix cache, ``core/kv_events.py``) published for KV-aware routers by
``engine/kv_publisher.py``. A field of ``EngineConfig``."""
from dataclasses import dataclass
from typing import Any, Optional

from .config_json import config_fields

ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class KVEventsConfig:
    """vLLM's field names and defaults, except the endpoint: loopback here."""
    enable_kv_cache_events: bool = False
    # "zmq" (a PUB socket) or "null" (nothing sent); None: zmq when events are
    # enabled (vLLM's rule).
    publisher: Optional[str] = None
    # Where the PUB socket binds (always binds; "tcp://*:5557" for every interface).
    endpoint: str = "tcp://127.0.0.1:5557"
    # A ROUTER socket that replays buffered batches to a subscriber that sends
    # an 8-byte big-endian sequence number to start from (None: no replay).
    replay_endpoint: Optional[str] = None
    # Batches (one per engine step with events) kept for replay.
    buffer_steps: int = 10_000
    # ZeroMQ high-water mark of the PUB socket (messages queued per subscriber).
    hwm: int = 100_000
    # Batches waiting for the publisher thread; beyond it a batch is dropped
    # (and counted) rather than holding up the engine step.
    max_queue_size: int = 100_000
    # The first frame of every message (subscribers filter by prefix).
    topic: str = ""

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be zmq or null, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(ADDRESS_SCHEMES)):
                raise ValueError(f"kv_events_config.{name} must be a tcp://, ipc:// or inproc:// address, "
                                 f"got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """Events are on and go out through ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def build(cls, value: Any) -> Optional["KVEventsConfig"]:
        """From a dict, its JSON text (config.pbtxt), an instance, or None / "" (off)."""
        value = config_fields(cls, "kv_events_config", value)
        if value is None or isinstance(value, cls):
            return value
        return cls(**value)
