"""Metric families on Triton's ``/metrics``, from ``model.py``, under our own
names (``pagedbackend:``) and vLLM's (``vllm:``, as NVIDIA's vllm_backend and
vLLM's own server export them), so dashboards built for either work.

Model parameters (config.pbtxt): ``REPORT_CUSTOM_METRICS`` (default true;
false exports nothing) and ``METRIC_NAMES``: ``both`` (default),
``pagedbackend`` or ``vllm``. Every metric is labelled by model and version.
Latency histograms are observed from the engine's request metrics (one clock).
Imported only inside Triton's Python backend stub.
"""
import time
from typing import Dict, List, Tuple

import triton_python_backend_utils as pb_utils

NAMESPACES = ("pagedbackend", "vllm")
GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
# A counter per draft position (label ``position``), from a list of EngineStats.
PER_POSITION = "counter per position"


def _one_two_five(limit: int) -> List[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return buckets
            buckets.append(step * scale)
        scale *= 10


TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 30, 60]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5]
GRAMMAR_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
REQUEST_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920]

# (namespace, name) -> (kind, EngineStats field or observation key, help, buckets)
FAMILIES: Dict[Tuple[str, str], tuple] = {
    ("pagedbackend", "kv_cache_usage_ratio"): (GAUGE, "kv_usage", "Used KV blocks / total KV blocks (1 = full).", None),
    ("pagedbackend", "kv_blocks_used"): (GAUGE, "num_used_blocks", "KV blocks in use.", None),
    ("pagedbackend", "kv_blocks_total"): (GAUGE, "num_total_blocks", "KV blocks in the device pool.", None),
    ("pagedbackend", "num_requests_running"): (GAUGE, "num_running", "Requests being decoded.", None),
    ("pagedbackend", "num_requests_waiting"): (GAUGE, "num_waiting", "Requests queued for admission.", None),
    ("pagedbackend", "num_requests_swapped"): (GAUGE, "num_swapped", "Requests swapped out to host memory.", None),
    ("pagedbackend", "kv_positions_stored"): (GAUGE, "stored_positions", "Token positions held in used KV blocks.", None),
    ("pagedbackend", "kv_slots_allocated"): (GAUGE, "allocated_slots", "Slots in used KV blocks (blocks x block size).", None),
    ("pagedbackend", "kv_blocks_shared"): (GAUGE, "num_shared_blocks", "KV blocks referenced by more than one sequence.", None),
    ("pagedbackend", "kv_blocks_cached_free"): (GAUGE, "num_cached_free_blocks",
                                                "Free KV blocks still holding a reusable prefix.", None),
    ("pagedbackend", "model_step_compiled"): (GAUGE, "compiled_step",
                                              "1 once the compiled model step serves (0: eager steps).", None),
    ("pagedbackend", "cpu_contended"): (GAUGE, "cpu_contended",
                                        "1 while other work wants our CPU cores (OpenMP threads sleep between regions).",
                                        None),
    ("pagedbackend", "prompt_tokens_total"): (COUNTER, "prompt_tokens", "Prompt tokens admitted.", None),
    ("pagedbackend", "generation_tokens_total"): (COUNTER, "generation_tokens", "Tokens generated.", None),
    ("pagedbackend", "engine_steps_total"): (COUNTER, "num_steps", "Engine steps that ran the model.", None),
    ("pagedbackend", "engine_step_seconds_total"): (COUNTER, "step_seconds",
                                                    "Wall time of those steps (mean step: rate over rate of steps).", None),
    ("pagedbackend", "engine_forward_seconds_total"): (COUNTER, "forward_seconds",
                                                       "Of the step time, the model's forward pass.", None),
    ("pagedbackend", "engine_sample_seconds_total"): (COUNTER, "sample_seconds",
                                                      "Of the step time, sampling and applying the tokens.", None),
    ("pagedbackend", "num_preemptions_total"): (COUNTER, "num_preemptions", "Sequence groups preempted.", None),
    ("pagedbackend", "prefix_cache_hits_total"): (COUNTER, "prefix_cache_hits",
                                                  "Prompt tokens found in the prefix cache.", None),
    ("pagedbackend", "prefix_cache_queries_total"): (COUNTER, "prefix_cache_queries",
                                                     "Prompt tokens looked up in the prefix cache.", None),
    ("pagedbackend", "kv_offload_blocks_saved_total"): (COUNTER, "kv_offload_saved",
                                                        "KV blocks written to the disk tier (kv_offload_dir).", None),
    ("pagedbackend", "kv_offload_blocks_loaded_total"): (COUNTER, "kv_offload_loaded",
                                                         "KV blocks read back from the disk tier.", None),
    ("pagedbackend", "kv_offload_blocks_dropped_total"): (COUNTER, "kv_offload_dropped",
                                                          "Disk-tier saves dropped (write queue full).", None),
    ("pagedbackend", "kv_offload_blocks_refused_total"): (
        COUNTER, "kv_offload_refused", "Disk-tier files refused on reading (torn, corrupt, another layout).", None),
    ("pagedbackend", "kv_offload_bytes"): (GAUGE, "kv_offload_bytes", "Bytes of the disk tier's files.", None),
    ("pagedbackend", "request_failures_total"): (COUNTER, "failed_requests",
                                                 "Requests ended by an error while handling them alone.", None),
    ("pagedbackend", "idle_leak_checks_failed_total"): (
        COUNTER, "idle_leak_checks_failed", "Times the engine went idle with KV blocks or sequences left behind.", None),
    ("pagedbackend", "structured_requests_total"): (COUNTER, "structured_requests",
                                                    "Requests with a structured-output constraint.", None),
    ("pagedbackend", "grammar_compiles_total"): (COUNTER, "grammar_compiles",
                                                 "Grammars compiled (the other constrained requests hit the cache).",
                                                 None),
    ("pagedbackend", "structured_mask_seconds_total"): (
        COUNTER, "structured_mask_seconds", "Of the sample time, filling and applying grammar token masks.", None),
    ("pagedbackend", "grammar_compile_seconds"): (HISTOGRAM, "grammar_compile",
                                                  "Time to compile a request's grammar (cache misses only).",
                                                  GRAMMAR_BUCKETS),
    ("pagedbackend", "spec_decode_num_drafts_total"): (COUNTER, "spec_num_drafts",
                                                       "Verifications of speculative tokens (a sequence, a step).", None),
    ("pagedbackend", "spec_decode_num_draft_tokens_total"): (COUNTER, "spec_num_draft_tokens",
                                                             "Speculative tokens proposed and verified.", None),
    ("pagedbackend", "spec_decode_num_accepted_tokens_total"): (COUNTER, "spec_num_accepted_tokens",
                                                                "Speculative tokens accepted.", None),
    ("pagedbackend", "spec_decode_num_accepted_tokens_per_pos"): (
        PER_POSITION, "spec_accepted_per_pos", "Speculative tokens accepted at each draft position.", None),
    ("pagedbackend", "spec_decode_propose_seconds_total"): (COUNTER, "propose_seconds",
                                                            "Of the step time, proposing speculative tokens.", None),
    ("pagedbackend", "lora_loads_total"): (COUNTER, "lora_loads", "LoRA adapter folders read.", None),
    ("pagedbackend", "lora_page_ins_total"): (COUNTER, "lora_page_ins",
                                              "LoRA adapters written into the device adapter pool.", None),
    ("pagedbackend", "lora_evictions_total"): (COUNTER, "lora_evictions",
                                               "LoRA adapters evicted from the device adapter pool.", None),
    ("pagedbackend", "lora_host_evictions_total"): (COUNTER, "lora_host_evictions",
                                                    "LoRA adapters whose weights left host memory.", None),
    ("pagedbackend", "time_to_first_token_seconds"): (HISTOGRAM, "ttft", "Time from arrival to the first token.",
                                                      TTFT_BUCKETS),
    ("pagedbackend", "time_per_output_token_seconds"): (HISTOGRAM, "tpot", "Time per output token after the first.",
                                                        TPOT_BUCKETS),
    ("pagedbackend", "e2e_request_latency_seconds"): (HISTOGRAM, "e2e", "Time from arrival to the final response.",
                                                      REQUEST_BUCKETS),
    # vLLM's names and types.
    ("vllm", "prompt_tokens_total"): (COUNTER, "prompt_tokens", "Prompt tokens admitted (vLLM name).", None),
    ("vllm", "generation_tokens_total"): (COUNTER, "generation_tokens", "Tokens generated (vLLM name).", None),
    ("vllm", "num_preemptions_total"): (COUNTER, "num_preemptions", "Sequence groups preempted (vLLM name).", None),
    ("vllm", "num_requests_running"): (GAUGE, "num_running", "Requests being decoded (vLLM name).", None),
    ("vllm", "num_requests_waiting"): (GAUGE, "num_waiting", "Requests queued for admission (vLLM name).", None),
    ("vllm", "kv_cache_usage_perc"): (GAUGE, "kv_usage", "Used / total KV blocks, 1 = full (vLLM name).", None),
    ("vllm", "gpu_cache_usage_perc"): (GAUGE, "kv_usage", "Used / total KV blocks, 1 = full (older vLLM name).", None),
    ("vllm", "spec_decode_num_drafts_total"): (COUNTER, "spec_num_drafts", "Speculative verifications (vLLM name).",
                                               None),
    ("vllm", "spec_decode_num_draft_tokens_total"): (COUNTER, "spec_num_draft_tokens",
                                                     "Speculative tokens proposed (vLLM name).", None),
    ("vllm", "spec_decode_num_accepted_tokens_total"): (COUNTER, "spec_num_accepted_tokens",
                                                        "Speculative tokens accepted (vLLM name).", None),
    ("vllm", "spec_decode_num_accepted_tokens_per_pos"): (
        PER_POSITION, "spec_accepted_per_pos", "Speculative tokens accepted per draft position (vLLM name).", None),
    ("vllm", "time_to_first_token_seconds"): (HISTOGRAM, "ttft", "Time from arrival to the first token (vLLM name).",
                                              TTFT_BUCKETS),
    ("vllm", "time_per_output_token_seconds"): (HISTOGRAM, "tpot", "Time per output token after the first (vLLM name).",
                                                TPOT_BUCKETS),
    ("vllm", "e2e_request_latency_seconds"): (HISTOGRAM, "e2e", "Time from arrival to the final response (vLLM name).",
                                              REQUEST_BUCKETS),
    ("vllm", "request_queue_time_seconds"): (HISTOGRAM, "queue", "Time from arrival to first scheduling.",
                                             REQUEST_BUCKETS),
    ("vllm", "request_inference_time_seconds"): (HISTOGRAM, "inference",
                                                 "Time from first scheduling to the end.", REQUEST_BUCKETS),
    ("vllm", "request_prefill_time_seconds"): (HISTOGRAM, "prefill",
                                               "Time from first scheduling to the first token.", REQUEST_BUCKETS),
    ("vllm", "request_decode_time_seconds"): (HISTOGRAM, "decode", "Time from the first token to the end.",
                                              REQUEST_BUCKETS),
    ("vllm", "request_prompt_tokens"): (HISTOGRAM, "prompt_len", "Prompt length of each finished request.", "tokens"),
    ("vllm", "request_generation_tokens"): (HISTOGRAM, "output_len", "Tokens generated for each finished request, all outputs.",
                                            "tokens"),
    ("vllm", "request_params_n"): (HISTOGRAM, "n", "The n sampling parameter of each finished request.", [1, 2, 5, 10, 20]),
}


class Metrics:
    """The families of the chosen namespaces, fed from engine statistics
    (gauges, counters) and from each request's timeline (histograms)."""

    def __init__(self, labels: dict, namespaces=NAMESPACES, max_model_len: int = 8192):
        self.families = []  # each family must outlive its metrics
        self.gauges, self.counters, self.histograms = [], [], {}
        self.last: Dict[str, float] = {}
        self.labels = labels
        self.per_position = []   # (EngineStats list field, family, {position: metric})
        try:
            for (space, name), (kind, key, text, buckets) in FAMILIES.items():
                if space not in namespaces:
                    continue
                family = pb_utils.MetricFamily(name=f"{space}:{name}", description=text, kind={
                    GAUGE: pb_utils.MetricFamily.GAUGE, COUNTER: pb_utils.MetricFamily.COUNTER,
                    PER_POSITION: pb_utils.MetricFamily.COUNTER, HISTOGRAM: pb_utils.MetricFamily.HISTOGRAM}[kind])
                self.families.append(family)
                if kind == PER_POSITION:
                    self.per_position.append((key, family, {}))
                elif kind == HISTOGRAM:
                    buckets = _one_two_five(max_model_len) if buckets == "tokens" else buckets
                    self.histograms.setdefault(key, []).append(family.Metric(labels=labels, buckets=buckets))
                else:
                    (self.gauges if kind == GAUGE else self.counters).append((key, family.Metric(labels=labels)))
                    self.last[key] = 0
        except pb_utils.TritonModelException as exc:  # metrics switched off in the server
            pb_utils.Logger.log_warn(f"paged_llm: no custom metrics: {exc}")
            self.gauges, self.counters, self.histograms, self.per_position = [], [], {}, []

    def lora(self, enabled: bool, namespaces=NAMESPACES) -> None:
        """With adapters: vLLM's ``vllm:lora_requests_info`` (labels: running and
        waiting adapters, max_lora; value: when they were last seen so) and
        requests per adapter (``pagedbackend:lora_requests_total{lora_name}``).
        Series are kept per label set, as vLLM keeps them: the current one
        has the latest time."""
        self.lora_families = {}
        if not enabled or not (self.gauges or self.counters):
            return
        for space, name, kind, text in (
                ("vllm", "lora_requests_info", pb_utils.MetricFamily.GAUGE,
                 "Running and waiting LoRA adapters (labels) and max_lora; value: time of the latest change."),
                ("pagedbackend", "lora_requests_total", pb_utils.MetricFamily.COUNTER,
                 "Requests admitted per LoRA adapter.")):
            if space in namespaces:
                self.lora_families[name] = pb_utils.MetricFamily(name=f"{space}:{name}", description=text, kind=kind)
                self.families.append(self.lora_families[name])
        self.lora_info, self.lora_requests = {}, {}   # label values -> metric

    def update(self, stats):
        """Counters first, then gauges: a scrape that sees a gauge of this
        refresh also sees its counters."""
        if getattr(self, "lora_families", None):
            self._update_lora(stats)
        increments = {}
        for key, _ in self.counters:
            value = getattr(stats, key)
            if value > self.last[key]:
                increments[key] = value - self.last[key]
        for key, counter in self.counters:
            if key in increments:
                counter.increment(float(increments[key]))
        for key, amount in increments.items():
            self.last[key] += amount
        for key, family, metrics in self.per_position:   # metrics: position -> [metric, value reported]
            for position, value in enumerate(getattr(stats, key)):
                if value > (metrics[position][1] if position in metrics else 0):
                    if position not in metrics:
                        metrics[position] = [family.Metric(labels={**self.labels, "position": str(position)}), 0]
                    metrics[position][0].increment(float(value - metrics[position][1]))
                    metrics[position][1] = value
        for key, gauge in self.gauges:
            gauge.set(float(getattr(stats, key)))

    def _update_lora(self, stats) -> None:
        requests = self.lora_families.get("lora_requests_total")
        for name, count in (stats.lora_requests.items() if requests is not None else ()):
            metric, seen = self.lora_requests.get(name, (None, 0))
            if count > seen:
                metric = metric or requests.Metric(labels={**self.labels, "lora_name": name})
                metric.increment(float(count - seen))
                self.lora_requests[name] = (metric, count)
        info = self.lora_families.get("lora_requests_info")
        if info is not None:   # as vLLM: one series per label set, the current one set to now
            labels = (",".join(stats.lora_running), ",".join(stats.lora_waiting), str(stats.max_lora))
            if labels not in self.lora_info:
                self.lora_info[labels] = info.Metric(labels={
                    **self.labels, "running_lora_adapters": labels[0], "waiting_lora_adapters": labels[1],
                    "max_lora": labels[2]})
            self.lora_info[labels].set(time.time())

    def observe(self, key: str, value: float):
        for histogram in self.histograms.get(key, ()):
            histogram.observe(value)

    def observe_tokens(self, metrics, previous_token_time, new_tokens: int) -> None:
        """TTFT for a request's first tokens, else time per output token since
        the previous delta; ``metrics`` is the delta's RequestMetrics."""
        if metrics is None or metrics.last_token_time is None or not new_tokens:
            return
        if previous_token_time is None:
            self.observe("ttft", metrics.first_token_time - metrics.arrival_time)
        else:
            self.observe("tpot", (metrics.last_token_time - previous_token_time) / new_tokens)

    def observe_finished(self, metrics, prompt_len: int = 0, output_len: int = 0, n: int = 1) -> None:
        """A finished request: its latencies, phases and sizes."""
        if metrics is None or metrics.finished_time is None:
            return
        self.observe("e2e", metrics.finished_time - metrics.arrival_time)
        if metrics.grammar_compile_time is not None:
            self.observe("grammar_compile", metrics.grammar_compile_time)
        scheduled, first = metrics.first_scheduled_time, metrics.first_token_time
        if scheduled is not None:
            self.observe("queue", scheduled - metrics.arrival_time)
            self.observe("inference", metrics.finished_time - scheduled)
            if first is not None:
                self.observe("prefill", first - scheduled)
                self.observe("decode", metrics.finished_time - first)
        self.observe("prompt_len", prompt_len)
        self.observe("output_len", output_len)
        self.observe("n", n)
