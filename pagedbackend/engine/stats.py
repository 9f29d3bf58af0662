"""The engine's statistics snapshot: its counters with the block pool's,
the scheduler's queues and preemptions, speculation, the CPU governor and adapters."""
import logging
from typing import Dict, List

from .adapters import lora_stats
from .outputs import EngineStats

logger = logging.getLogger("pagedbackend")


def engine_stats(engine) -> EngineStats:
    """A copy of ``engine.stats`` with the pool, queue and step fields filled in."""
    bm, sch, st = engine.block_manager, engine.scheduler, engine.stats
    st.num_running = len(sch.running)
    st.num_waiting = len(sch.waiting) + len(engine.compiling)   # compiling: held before the scheduler
    st.num_swapped = len(sch.swapped)
    st.num_used_blocks = bm.num_used_blocks
    st.num_total_blocks = bm.num_total_blocks
    st.kv_usage = bm.usage
    st.num_swap_blocks = bm.num_swap_blocks
    st.num_free_swap_blocks = bm.num_free_swap_blocks
    st.num_shared_blocks = bm.num_shared_blocks
    st.num_cached_free_blocks = bm.num_cached_free_blocks
    st.stored_positions = bm.stored_positions()
    st.allocated_slots = bm.num_used_blocks * bm.block_size
    st.num_swap_preemptions = sch.num_swap_preemptions
    st.num_recompute_preemptions = sch.num_recompute_preemptions
    st.num_preemptions = sch.num_swap_preemptions + sch.num_recompute_preemptions
    st.prefix_cache_queries = bm.prefix_queries
    st.prefix_cache_hits = bm.prefix_hits
    st.compiled_step = engine.runner.compiled_step
    st.structured_mask_seconds = engine.sampler.mask_seconds
    st.grammar_compiles = engine.grammars.compiles
    if engine.speculator is not None:
        engine.speculator.stats.copy_to(st)
    st.cpu_contended = engine.runner.cpu_contended
    if engine.kv_tier is not None:
        engine.kv_tier.stats.copy_to(st)
        st.kv_offload_bytes = engine.kv_tier.num_bytes
    if engine.lora is not None:
        lora_stats(engine.lora, sch, engine.compiling, st)
    return EngineStats(**st.__dict__)


def engine_description(engine) -> Dict[str, object]:
    """What serves, for a log line at start: model, what it serves (with the
    pooler of embeddings), dtype, quantisation, how the linear layers multiply
    (and whether through the C++ operators), attention, KV pool, context,
    speculation, the LoRA kernel."""
    runner, config = engine.runner, engine.config
    spec = config.speculative_config
    serves = config.runner if config.runner != "pooling" else f"pooling ({engine.pooling.defaults.pooling_type})"
    return {"model": config.model, "runner": serves, "dtype": config.dtype, "quantization": config.quantization,
            **runner.describe(),
            "num_kv_blocks": runner.num_kv_blocks, "max_model_len": engine.max_model_len,
            "speculative": spec.method if spec is not None else None}


def idle_leaks(engine) -> List[str]:
    """What an idle engine still holds: blocks not free (nor free and cached),
    requests still tracked, pooled states left. A violation is logged and
    counted (``EngineStats.idle_leak_checks_failed``)."""
    leaks = engine.scheduler.idle_leaks()
    if engine.groups:
        leaks.append(f"{len(engine.groups)} request(s) still tracked")
    if engine.pooling.pooled:
        leaks.append(f"{len(engine.pooling.pooled)} embedding request(s) still pooled")
    if leaks:
        engine.stats.idle_leak_checks_failed += 1
        logger.error("engine idle but not clean: %s", "; ".join(leaks))
    return leaks
