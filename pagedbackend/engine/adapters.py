"""The engine's side of adapters: the manager it holds (``lora.manager``)
and the adapter figures of ``EngineStats``."""
from ..lora.manager import LoRAManager

__all__ = ["LoRAManager", "lora_stats"]


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
