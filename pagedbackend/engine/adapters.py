"""The engine's side of adapters: the manager it holds (``lora.manager``),
vLLM's adapter methods of ``LLMEngine`` (``AdapterMethods``), a request's
adapter checked before its group is built, and the adapter figures of
``EngineStats``."""
from typing import List, Optional

from ..config import EngineConfig
from ..lora import LoRAError, LoRARequest
from ..lora.manager import LoRAManager

__all__ = ["AdapterMethods", "LoRAManager", "lora_manager", "lora_stats", "resolve_adapter", "with_adapter"]
NOT_ENABLED = "LoRA is not enabled: start the engine with enable_lora=True to serve adapters"


def lora_manager(config: EngineConfig, runner) -> Optional[LoRAManager]:
    """The engine's adapters when ``enable_lora`` (the runner holds the pool);
    the scheduler admits a request only when its adapter fits the pool
    (``LoRAManager.fits``, its ``SchedulerInputs.adapter_room``)."""
    if not config.enable_lora:
        return None
    model = runner.lora
    if model is None:
        raise ValueError(f"enable_lora: the {type(runner).__name__} executor does not serve adapters")
    return LoRAManager(config, model.shapes(), model.write)


def resolve_adapter(manager: Optional[LoRAManager], lora_request: Optional[LoRARequest]):
    """The adapter a request runs with (None: the base model), read from its
    folder when new; raises ``LoRAError`` for a refused one, before any work."""
    if lora_request is None:
        return None
    if manager is None:
        raise LoRAError(NOT_ENABLED)
    if not isinstance(lora_request, LoRARequest):
        raise LoRAError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    return manager.resolve(lora_request)


def with_adapter(group, adapter):
    """``group`` running with ``adapter`` (None: the base model); the
    adapter's key joins the group's prefix-cache namespace."""
    if adapter is not None:
        group.lora = adapter
        group.cache_salt += adapter.key
    return group


class AdapterMethods:
    """vLLM's adapter methods of the engine, over its ``lora`` manager (None: off)."""
    lora: Optional[LoRAManager]

    def add_lora(self, lora_request: LoRARequest, replace: bool = False) -> bool:
        """Load an adapter now (``replace``: read a registered one's folder
        again, a new version for new requests); True once it is registered."""
        if self.lora is None:
            raise LoRAError(NOT_ENABLED)
        self.lora.add(lora_request, replace)
        return True

    def remove_lora(self, lora_id) -> bool:
        """Unregister an adapter (by id or name); running requests finish with it."""
        return self.lora is not None and self.lora.remove(lora_id)

    def list_loras(self) -> List[LoRARequest]:
        return [] if self.lora is None else self.lora.list()

    def _adapters_for_step(self, scheduled) -> None:
        """Page in the step's adapters; adapters leave the pool and the host
        tier only here, between steps, never while a request uses them."""
        if self.lora is not None:
            self.lora.trim(g.lora for g in self.groups.values() if g.lora is not None)
            self.lora.prepare_step(scheduled, self.scheduler.running)


def lora_stats(manager: LoRAManager, scheduler, compiling, stats) -> None:
    """Fill ``stats``' adapter fields: the adapters of running and of waiting
    requests (vLLM's ``lora_requests_info``), the pool's size in adapters of
    the largest rank, and the manager's counters."""
    stats.lora_running = sorted({g.lora_name for g in scheduler.running if g.lora is not None})
    waiting = [*scheduler.waiting, *scheduler.swapped, *compiling]
    stats.lora_waiting = sorted({g.lora_name for g in waiting if g.lora is not None})
    stats.max_lora = manager.pool.num_pages // manager.max_lora_rank
    stats.lora_requests = dict(manager.stats.requests)
    stats.lora_loads = manager.stats.loads
    stats.lora_page_ins = manager.pool.page_ins
    stats.lora_evictions = manager.pool.evictions
    stats.lora_host_evictions = manager.stats.host_evictions
