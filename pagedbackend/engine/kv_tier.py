"""The disk tier below the prefix cache (``kv_offload_dir``): one file per
KV block, named by its prefix-cache key, bounded by ``kv_offloading_size``.

- A file is ``MAGIC``, a format version, a JSON header (the layout it was
  written for: model identity, layers, KV heads, row width, block size,
  cache dtype; the key; the payload's size and SHA-256), then the block's
  bytes exactly as the cache stores them (K and V of every layer, an int8
  cache's scales inside its rows). A file that is torn, corrupt, or written
  for another layout or key is refused: deleted, counted, never served.
- The name is a hash of layout and key, so engines of different layouts
  sharing a folder never read each other's blocks.
- Writes run on a thread of the tier's own (a bounded queue; when it is
  full a save is dropped and counted, the step never waits), to a temporary
  name, then ``os.replace``: a crash never leaves half a file under a real name.
- Least recently used files go first when a write would pass the bound; a
  read makes a file recent (and touches it, so the order survives a restart).
- At shutdown the pool's cached blocks are written too (``before_close``),
  so a restart finds every prefix the engine held.
- At start the folder is indexed (oldest first by modification time);
  replicas sharing it may add and remove files at any time: a file found
  that the index lacks is adopted, one gone is a miss.
"""
import collections
import hashlib
import json
import logging
import os
import pathlib
import queue
import struct
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

logger = logging.getLogger("pagedbackend")

MAGIC = b"PBKVBLK\0"
VERSION = 1
_PREFIX = struct.Struct("<8sHI")   # magic, version, header length
SUFFIX = ".kvblock"
STALE_TEMP_S = 600.0   # a temporary file this old was left by a crash
GiB = 1024 ** 3


@dataclass
class TierStats:
    """The tier's counters since start (``EngineStats.kv_offload_*``)."""
    saved: int = 0     # blocks written to disk
    loaded: int = 0    # blocks read back into the pool
    dropped: int = 0   # saves dropped: the write queue was full, or a block larger than the bound
    refused: int = 0   # files refused on reading (torn, corrupt, another layout): deleted
    evicted: int = 0   # files removed to stay under the bound

    def copy_to(self, stats) -> None:
        for name, value in self.__dict__.items():
            setattr(stats, f"kv_offload_{name}", value)


class DiskTier:
    """Files of KV blocks in ``folder``, at most ``max_bytes`` of them
    (headers included); ``layout``: what the payloads were computed for,
    refused when a file says otherwise; ``block_bytes``: a payload's size."""

    def __init__(self, folder: str, max_bytes: int, layout: Dict[str, object], block_bytes: int,
                 queue_blocks: int = 256):
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.layout = json.loads(json.dumps(layout, sort_keys=True))
        self._layout_tag = hashlib.sha256(json.dumps(self.layout, sort_keys=True).encode()).digest()
        self.block_bytes = block_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: "collections.OrderedDict[str, int]" = collections.OrderedDict()   # name -> bytes, LRU first
        self._bytes = 0
        self._pending: Dict[str, bytes] = {}    # queued, not yet written: name -> payload
        self._staged: Dict[bytes, bytes] = {}   # key -> payload checked for this step's loads
        # What happened to reported blocks, for KV events: ("stored", TierSave) / ("removed", key).
        self._reported: Dict[str, bytes] = {}   # name -> key of a reported block written here
        self.events: collections.deque = collections.deque()
        self._queue: "queue.Queue" = queue.Queue(maxsize=queue_blocks)
        self.before_close = None   # called by close() first (engine/block_moves.py: save the pool's blocks)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------ names and index
    def name(self, key: bytes) -> str:
        return hashlib.blake2b(key, key=self._layout_tag[:32], digest_size=20).hexdigest() + SUFFIX

    @property
    def num_bytes(self) -> int:
        """Bytes of the files the index holds."""
        return self._bytes

    def _scan(self) -> None:
        now, found = time.time(), []
        for entry in os.scandir(self.folder):
            try:
                info = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                found.append((info.st_mtime, entry.name, info.st_size))
            elif entry.name.endswith(".tmp") and now - info.st_mtime > STALE_TEMP_S:
                _unlink(self.folder / entry.name)
        with self._lock:
            for _, name, size in sorted(found):
                self._index[name] = size
                self._bytes += size
            self._shrink(0)

    def _shrink(self, room: int) -> None:
        """Remove least recently used files until ``room`` more bytes fit (lock held)."""
        while self._index and self._bytes + room > self.max_bytes:
            name, size = self._index.popitem(last=False)
            self._bytes -= size
            _unlink(self.folder / name)
            self.stats.evicted += 1
            key = self._reported.pop(name, None)
            if key is not None:
                self.events.append(("removed", key))

    def _forget(self, name: str) -> None:
        """Drop a file from the index (lock held)."""
        size = self._index.pop(name, None)
        if size is not None:
            self._bytes -= size
        key = self._reported.pop(name, None)
        if key is not None:
            self.events.append(("removed", key))

    # ------------------------------------------------------------ the block manager's port
    def contains(self, key: bytes) -> bool:
        """Whether a file for ``key`` exists (or is being written)."""
        name = self.name(key)
        with self._lock:
            if name in self._index or name in self._pending:
                return True
            try:   # another replica's file: adopt it
                size = (self.folder / name).stat().st_size
            except OSError:
                return False
            self._shrink(size)
            self._index[name] = size
            self._bytes += size
            return True

    def stage(self, key: bytes) -> bool:
        """Read and check ``key``'s file now and hold its payload for the
        step's load; False (a miss) when it is gone or refused."""
        name = self.name(key)
        with self._lock:
            payload = self._pending.get(name)
            if name in self._index:
                self._index.move_to_end(name)
        if payload is None:
            payload = self._read(name, key)
            if payload is None:
                return False
        self._staged[key] = payload
        return True

    def unstage(self, key: bytes) -> None:
        self._staged.pop(key, None)

    def take_staged(self, key: bytes) -> bytes:
        """A staged payload, for the worker's load."""
        self.stats.loaded += 1
        return self._staged.pop(key)

    def discard_staged(self) -> None:
        """Payloads staged for loads the pass called off."""
        self._staged.clear()

    # ------------------------------------------------------------ reading
    def _read(self, name: str, key: bytes) -> Optional[bytes]:
        path = self.folder / name
        try:
            data = path.read_bytes()
        except OSError:   # removed under us (another replica's bound): a miss
            with self._lock:
                self._forget(name)
            return None
        problem = self._check(data, key)
        if problem is not None:
            logger.warning("kv_offload_dir: refused %s (%s); the block is recomputed", path, problem)
            _unlink(path)
            with self._lock:
                self._forget(name)
            self.stats.refused += 1
            return None
        try:
            os.utime(path)   # recently used, also for the next start's index
        except OSError:
            pass
        return data[-self.block_bytes:]

    def _check(self, data: bytes, key: bytes) -> Optional[str]:
        """What is wrong with a file's bytes for ``key`` (None: nothing)."""
        if len(data) < _PREFIX.size:
            return "shorter than its header"
        magic, version, header_len = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            return "not a KV block file"
        if version != VERSION:
            return f"format version {version}, this engine reads {VERSION}"
        try:
            header = json.loads(data[_PREFIX.size:_PREFIX.size + header_len])
        except ValueError:
            return "its header is not JSON"
        payload = data[_PREFIX.size + header_len:]
        if not isinstance(header, dict) or header.get("layout") != self.layout:
            return "written for another model or cache layout"
        if header.get("key") != key.hex():
            return "written for another block"
        if header.get("size") != len(payload) or len(payload) != self.block_bytes:
            return f"payload of {len(payload)} bytes, expected {self.block_bytes}"
        if header.get("sha256") != hashlib.sha256(payload).hexdigest():
            return "payload checksum mismatch"
        return None

    # ------------------------------------------------------------ writing
    def save(self, record, payload: bytes, wait: bool = False) -> None:
        """Queue a block for writing (``record``: its ``TierSave``); dropped
        and counted when the queue is full (unless ``wait``) or the block can
        never fit."""
        name = self.name(record.key)
        with self._lock:
            if name in self._index or name in self._pending:
                return
            if self._file_size(record.key, payload) > self.max_bytes:
                self.stats.dropped += 1
                return
            self._pending[name] = payload
        try:
            self._queue.put((name, record, payload), block=wait)
        except queue.Full:
            with self._lock:
                self._pending.pop(name, None)
            self.stats.dropped += 1

    def _file_size(self, key: bytes, payload: bytes) -> int:
        """The file's size (the header's checksum is as long as any)."""
        return _PREFIX.size + len(self._header(key, payload, "0" * 64)) + len(payload)

    def _header(self, key: bytes, payload: bytes, digest: Optional[str] = None) -> bytes:
        return json.dumps({"layout": self.layout, "key": key.hex(), "size": len(payload),
                           "sha256": digest or hashlib.sha256(payload).hexdigest()}, sort_keys=True).encode()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:   # a full disk, a folder removed: the block is simply not kept
                logger.exception("kv_offload_dir: writing a block failed")
                with self._lock:
                    self._pending.pop(item[0], None)
            finally:
                self._queue.task_done()

    def _write(self, name: str, record, payload: bytes) -> None:
        header = self._header(record.key, payload)
        data = _PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload
        with self._lock:   # room first, so the folder never holds more than the bound
            self._shrink(len(data))
            self._index[name] = len(data)
            self._bytes += len(data)
        temp = self.folder / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(temp, "wb") as f:
                f.write(data)
            os.replace(temp, self.folder / name)
        except BaseException:
            _unlink(temp)
            with self._lock:
                self._forget(name)
            raise
        with self._lock:
            self._pending.pop(name, None)
            self.stats.saved += 1
            if record.reported:
                self._reported[name] = record.key
                self.events.append(("stored", record))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Write what is queued (and first what ``before_close`` saves: the
        pool's cached blocks), then stop the writer (idempotent)."""
        if self._writer.is_alive():
            if self.before_close is not None:
                self.before_close()
            self._queue.put(None)
            self._writer.join()

    def take_events(self) -> List[Tuple[str, object]]:
        events = []
        while self.events:
            events.append(self.events.popleft())
        return events


def _unlink(path: pathlib.Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
