"""The engine's adapters: which are registered, which versions hold weights
in host memory, which hold pages in the device pool, and what each step's
entries read.

- Registry: adapters by id and by name (``add``, ``remove``, ``resolve``).
  Reloading a name in place (``add(..., replace=True)``) makes a new
  version; requests already queued keep the version they started with.
- Host tier: at most ``max_cpu_loras`` registered versions keep their
  weights, least recently used dropped first (a request for a dropped one
  reads its folder again); a version a request uses, or one in the device
  pool, is never dropped.
- Device pool (``pool.AdapterPool``): admission lets a group run only when
  its adapter's pages and those of every running group's adapters fit the
  pool together (``fits``, the scheduler's ``adapter_room``); each step pages
  in the adapters it reads (``prepare_step``), evicting only adapters that no
  running group uses.
- Prefix cache: a request's blocks are keyed by its adapter's name and
  content hash (``Adapter.key``), so two adapters never share KV blocks and a
  reloaded adapter never meets the blocks of its former weights.

Loading (reading and checking a folder) runs in the caller's thread, under
no lock; the registry is locked; the pool is the engine thread's.
"""
import hashlib
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from .peft_adapter import LoRAWeights, ModuleShapes, load_peft_adapter
from .pool import AdapterPool
from .request import LoRAError, LoRARequest

# The first byte of an adapter's prefix-cache key: a request's cache_salt is
# UTF-8 text, which never holds it, so a salt can never pose as an adapter.
KEY_MARK = b"\xff"


@dataclass(frozen=True, eq=False)
class StepLoRA:
    """What a step's entry tells the runner: its adapter's pages and the
    module kinds it adapts (entries with the same object share a segment)."""
    pages: Tuple[int, ...]
    kinds: FrozenSet[str]

    @property
    def rank(self) -> int:
        return len(self.pages)


@dataclass(eq=False)
class Adapter:
    """One loaded version of an adapter: a request for it runs with these weights."""
    request: LoRARequest
    weights: LoRAWeights
    key: bytes = b""                       # prefix-cache namespace: name and content
    step: Optional[StepLoRA] = None        # while it holds pages in the device pool

    def __post_init__(self):
        digest = hashlib.sha256(self.request.lora_name.encode() + b"\0" + self.weights.content_hash)
        self.key = KEY_MARK + digest.digest()

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def rank(self) -> int:
        return self.weights.rank


@dataclass
class _Entry:
    request: LoRARequest
    version: Optional[Adapter]   # None while its weights are out of the host tier


@dataclass
class LoRAStats:
    loads: int = 0               # folders read (first loads, reloads, host-tier misses)
    host_evictions: int = 0      # versions whose weights left the host tier
    requests: Counter = field(default_factory=Counter)   # adapter name -> requests admitted


class LoRAManager:
    def __init__(self, config, shapes: ModuleShapes, write_pages: Callable[[LoRAWeights, List[int]], None]):
        """``shapes``: the model's projections (``LoRAModel.shapes``);
        ``write_pages(weights, pages)`` writes an adapter into the pool."""
        self.shapes, self.write_pages = dict(shapes), write_pages
        self.max_lora_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.pool = AdapterPool(config.max_loras * config.max_lora_rank)
        self.stats = LoRAStats()
        self._lock = threading.Lock()
        self._entries: Dict[int, _Entry] = {}
        self._ids: Dict[str, int] = {}
        self._host: "OrderedDict[Adapter, None]" = OrderedDict()   # versions holding weights, LRU first

    # ------------------------------------------------------------ registry
    def add(self, request: LoRARequest, replace: bool = False) -> Adapter:
        """Register and load an adapter (or, with ``replace``, load a new
        version of a registered one: same name, same id, its folder read again);
        a registered one without ``replace`` is returned as it is."""
        with self._lock:
            current = self._registered(request)
            if current is not None and current.version is not None and not replace:
                self._touch(current.version)
                return current.version
        version = Adapter(request, self.load(request))
        with self._lock:
            self._registered(request)   # checked again: another thread may have taken the name
            self._entries[request.lora_int_id] = _Entry(request, version)
            self._ids[request.lora_name] = request.lora_int_id
            self._touch(version)
        return version

    def load(self, request: LoRARequest) -> LoRAWeights:
        """Read and check an adapter folder (no registry change)."""
        if not request.lora_path:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} has no lora_path to load it from")
        weights = load_peft_adapter(request.lora_path, self.shapes, self.max_lora_rank, request.lora_name)
        self.stats.loads += 1
        return weights

    def remove(self, name_or_id) -> bool:
        """Unregister an adapter: new requests cannot name it; requests that
        already have it finish with it, and its pages go back after them."""
        with self._lock:
            lora_id = self._ids.get(name_or_id) if isinstance(name_or_id, str) else name_or_id
            entry = self._entries.pop(lora_id, None)
            if entry is None:
                return False
            del self._ids[entry.request.lora_name]
            if entry.version is not None:
                self._host.pop(entry.version, None)
            return True

    def resolve(self, request: LoRARequest) -> Adapter:
        """The version a new request runs with: the registered one (read again
        if its weights left the host tier), or ``request`` loaded now."""
        with self._lock:
            entry = self._registered(request)
            if entry is not None and entry.version is not None:
                self._touch(entry.version)
                return entry.version
        if entry is not None:   # its weights left the host tier: read its registered folder again
            return self.add(entry.request, replace=True)
        return self.add(request)

    def get(self, name: str) -> Optional[LoRARequest]:
        with self._lock:
            lora_id = self._ids.get(name)
            return None if lora_id is None else self._entries[lora_id].request

    def list(self) -> List[LoRARequest]:
        """Registered adapters, in id order."""
        with self._lock:
            return [self._entries[i].request for i in sorted(self._entries)]

    def _registered(self, request: LoRARequest) -> Optional[_Entry]:
        """The entry of ``request``'s id, after checking that its name and id
        do not clash with another adapter's (lock held)."""
        entry = self._entries.get(request.lora_int_id)
        if entry is not None and entry.request.lora_name != request.lora_name:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is adapter {entry.request.lora_name!r}, "
                            f"not {request.lora_name!r}")
        other = self._ids.get(request.lora_name)
        if other is not None and other != request.lora_int_id:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} is loaded with lora_int_id {other}, "
                            f"not {request.lora_int_id}")
        return entry

    def _touch(self, version: Adapter) -> None:
        self._host[version] = None
        self._host.move_to_end(version)

    # ------------------------------------------------------------ the engine thread
    def fits(self, group, running: Iterable) -> bool:
        """Whether ``group``'s adapter fits the pool beside those of ``running``
        (the scheduler's admission check; a group without one always fits)."""
        adapter = group.lora
        if adapter is None:
            return True
        ranks = {id(g.lora): g.lora.rank for g in running if g.lora is not None}
        return id(adapter) in ranks or sum(ranks.values()) + adapter.rank <= self.pool.num_pages

    def prepare_step(self, scheduled: Sequence, running: Iterable) -> None:
        """Page in the adapters the step reads and set each entry's ``lora``."""
        pinned = {g.lora for g in running if g.lora is not None}
        for item in scheduled:
            adapter = item.group.lora
            item.lora = None if adapter is None else self._page_in(adapter, pinned)

    def _page_in(self, adapter: Adapter, pinned) -> StepLoRA:
        if self.pool.pages_of(adapter) is None:
            pages, evicted = self.pool.place(adapter, adapter.rank, pinned)
            for victim in evicted:
                victim.step = None
            self.write_pages(adapter.weights, pages)
            adapter.step = StepLoRA(tuple(pages), adapter.weights.kinds)
        return adapter.step

    def trim(self, live: Iterable[Adapter]) -> None:
        """Between steps: give back the pages of versions that are neither
        registered nor used (unloaded, replaced), and keep the host tier within
        ``max_cpu_loras``. ``live``: the versions of the engine's requests."""
        live = set(live)
        with self._lock:
            current = {e.version for e in self._entries.values() if e.version is not None}
            for adapter in self.pool.resident:
                if adapter not in current and adapter not in live:
                    self.pool.release(adapter)
                    adapter.step = None
            resident = set(self.pool.resident)
            for version in list(self._host):
                if len(self._host) <= self.max_cpu_loras:
                    break
                if version in live or version in resident:
                    continue
                del self._host[version]
                entry = self._entries.get(version.request.lora_int_id)
                if entry is not None and entry.version is version:
                    entry.version = None
                self.stats.host_evictions += 1

    def count_request(self, adapter: Adapter) -> None:
        self.stats.requests[adapter.name] += 1

    @property
    def num_host(self) -> int:
        """Versions whose weights the host tier holds."""
        return len(self._host)
