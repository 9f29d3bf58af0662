"""pagedbackend metric families on Triton's ``/metrics``, from ``model.py``.

Imported only inside Triton's Python backend stub.
"""
import triton_python_backend_utils as pb_utils


class Metrics:
    """pagedbackend:* metric families on Triton's /metrics, labelled by model and version.

    Latency histograms are observed from the engine's request metrics (one clock)."""

    GAUGES = {  # name -> (EngineStats field, help)
        "kv_cache_usage_ratio": ("kv_usage", "Used KV blocks / total KV blocks (1 = full)."),
        "kv_blocks_used": ("num_used_blocks", "KV blocks in use."),
        "kv_blocks_total": ("num_total_blocks", "KV blocks in the device pool."),
        "num_requests_running": ("num_running", "Requests being decoded."),
        "num_requests_waiting": ("num_waiting", "Requests queued for admission."),
        "num_requests_swapped": ("num_swapped", "Requests swapped out to host memory."),
        "kv_positions_stored": ("stored_positions", "Token positions held in used KV blocks."),
        "kv_slots_allocated": ("allocated_slots", "Slots in used KV blocks (blocks x block size)."),
        "kv_blocks_shared": ("num_shared_blocks", "KV blocks referenced by more than one sequence."),
        "kv_blocks_cached_free": ("num_cached_free_blocks", "Free KV blocks still holding a reusable prefix."),
    }
    COUNTERS = {
        "prompt_tokens_total": ("prompt_tokens", "Prompt tokens admitted."),
        "generation_tokens_total": ("generation_tokens", "Tokens generated."),
        "num_preemptions_total": ("num_preemptions", "Sequence groups preempted."),
        "prefix_cache_hits_total": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
        "prefix_cache_queries_total": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
        "request_failures_total": ("failed_requests", "Requests ended by an error while handling them alone."),
        "idle_leak_checks_failed_total": ("idle_leak_checks_failed",
                                          "Times the engine went idle with KV blocks or sequences left behind."),
    }
    HISTOGRAMS = {
        "time_to_first_token_seconds": ("Time from arrival to the first token.",
                                        [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]),
        "time_per_output_token_seconds": ("Time per output token after the first.",
                                          [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5]),
        "e2e_request_latency_seconds": ("Time from arrival to the final response.",
                                        [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600]),
    }

    def __init__(self, labels: dict):
        self.families = []  # each family must outlive its metrics
        self.gauges, self.counters, self.histograms, self.last = {}, {}, {}, {}
        try:
            for name, (attr, text) in self.GAUGES.items():
                self.gauges[attr] = self._family(name, text, pb_utils.MetricFamily.GAUGE).Metric(labels=labels)
            for name, (attr, text) in self.COUNTERS.items():
                self.counters[attr] = self._family(name, text, pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
                self.last[attr] = 0
            for name, (text, buckets) in self.HISTOGRAMS.items():
                family = self._family(name, text, pb_utils.MetricFamily.HISTOGRAM)
                self.histograms[name] = family.Metric(labels=labels, buckets=buckets)
        except pb_utils.TritonModelException as exc:  # metrics switched off in the server
            pb_utils.Logger.log_warn(f"paged_llm: no custom metrics: {exc}")
            self.gauges, self.counters, self.histograms = {}, {}, {}

    def _family(self, name, text, kind):
        family = pb_utils.MetricFamily(name=f"pagedbackend:{name}", description=text, kind=kind)
        self.families.append(family)
        return family

    def update(self, stats):
        for attr, gauge in self.gauges.items():
            gauge.set(float(getattr(stats, attr)))
        for attr, counter in self.counters.items():
            value = getattr(stats, attr)
            if value > self.last[attr]:
                counter.increment(float(value - self.last[attr]))
                self.last[attr] = value

    def observe(self, name: str, value: float):
        if name in self.histograms:
            self.histograms[name].observe(value)

    def observe_tokens(self, metrics, previous_token_time, new_tokens: int) -> None:
        """TTFT for a request's first tokens, else time per output token since
        the previous delta; ``metrics`` is the delta's RequestMetrics."""
        if metrics is None or metrics.last_token_time is None or not new_tokens:
            return
        if previous_token_time is None:
            self.observe("time_to_first_token_seconds", metrics.first_token_time - metrics.arrival_time)
        else:
            self.observe("time_per_output_token_seconds",
                         (metrics.last_token_time - previous_token_time) / new_tokens)

    def observe_finished(self, metrics) -> None:
        if metrics is not None and metrics.finished_time is not None:
            self.observe("e2e_request_latency_seconds", metrics.finished_time - metrics.arrival_time)
