"""What the engine returns: per request, one entry per returned sequence."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..core.sequence import RequestMetrics


@dataclass
class Logprob:
    """One token's log-probability (processed logits, before temperature), its
    rank in the distribution (1 = most likely) and its text, as vLLM reports them."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int                       # which of the request's n outputs
    text: str                        # offline: the whole text; streamed: new text since the last delta
    token_ids: List[int]             # likewise: all tokens, or the new ones
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[List[Dict[int, Logprob]]] = None   # per token: chosen and top ids -> Logprob
    finish_reason: Optional[str] = None  # None while running; "stop", "length" or "abort"
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    num_tokens: int = 0              # tokens generated so far in total

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None      # set when the engine failed this request
    # With ``error``: the request's own fault (refused before it ran, as a grammar
    # the library cannot parse, or a grammar no token can continue), not a failure.
    refused: bool = False
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first),
    # ``{token id: Logprob}`` with the prompt token first; in the first output
    # after the prompt is computed (and in the final one of requests that stream nothing)
    prompt_logprobs: Optional[List[Optional[Dict[int, "Logprob"]]]] = None


@dataclass
class EmbeddingOutput:
    """One embedding request's pooled vector (vLLM's ``EmbeddingOutput``)."""
    embedding: List[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What an embedding request returns, as vLLM's: ``outputs.embedding``
    and the prompt's token ids (their count is the request's usage)."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None
    refused: bool = False


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``)."""
    score: float


@dataclass
class ScoringRequestOutput:
    """What a score request returns, as vLLM's: ``outputs.score`` and the
    pair's token ids (``LLM.score``)."""
    request_id: str
    prompt_token_ids: List[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0            # used device blocks / total
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_free_swap_blocks: int = 0
    num_swap_blocks: int = 0
    num_shared_blocks: int = 0       # referenced by more than one sequence
    num_cached_free_blocks: int = 0  # free, but still holding a reusable prefix
    stored_positions: int = 0        # token positions held in used blocks
    allocated_slots: int = 0         # used blocks x block size
    num_preemptions: int = 0         # total since start
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    prefix_cache_queries: int = 0    # prompt tokens looked up
    prefix_cache_hits: int = 0       # prompt tokens found cached
    prompt_tokens: int = 0           # total prompt tokens admitted
    generation_tokens: int = 0       # total tokens generated
    num_steps: int = 0
    step_seconds: float = 0.0        # wall time in steps that ran the model, total
    forward_seconds: float = 0.0     # of which in the model's forward pass
    sample_seconds: float = 0.0      # of which sampling and applying tokens
    last_step_tokens: int = 0        # tokens computed in the latest step
    finished_requests: int = 0
    aborted_requests: int = 0
    rejected_requests: int = 0
    failed_requests: int = 0         # ended by an exception while handling them alone
    idle_leak_checks_failed: int = 0  # times the engine went idle with blocks or sequences left
    compiled_step: bool = False      # the compiled model step serves (not eager steps)
    cpu_contended: bool = False      # OpenMP threads sleep between regions (worker/cpu_wait.py)
    structured_requests: int = 0     # requests with a structured-output constraint
    grammar_compiles: int = 0        # grammars compiled (the others came from the cache)
    structured_mask_seconds: float = 0.0  # of the sample time, filling and applying grammar masks
    # Speculative decoding (vLLM's counters): verifications with drafts, draft
    # tokens, accepted ones, and accepted ones per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: List[int] = field(default_factory=list)
    propose_seconds: float = 0.0     # of the step time, proposing speculative tokens
    # The disk tier (kv_offload_dir): blocks written to disk and read back into
    # the pool, saves dropped (its write queue full), files refused on reading
    # (torn, corrupt, another layout: recomputed) and removed to stay under the
    # bound, and the bytes of its files.
    kv_offload_saved: int = 0
    kv_offload_loaded: int = 0
    kv_offload_dropped: int = 0
    kv_offload_refused: int = 0
    kv_offload_evicted: int = 0
    kv_offload_bytes: int = 0
    # Adapters (enable_lora): those the running and the waiting requests use
    # (vLLM's lora_requests_info), the device pool's size in adapters of
    # max_lora_rank, requests admitted per adapter name, adapter folders read,
    # adapters written into the pool and evicted from it, and adapters whose
    # weights left the host tier (max_cpu_loras).
    lora_running: List[str] = field(default_factory=list)
    lora_waiting: List[str] = field(default_factory=list)
    max_lora: int = 0
    lora_requests: Dict[str, int] = field(default_factory=dict)
    lora_loads: int = 0
    lora_page_ins: int = 0
    lora_evictions: int = 0
    lora_host_evictions: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def memory_utilisation(self) -> float:
        """Stored token positions / allocated slots (the paper's Figure 2 measure)."""
        return self.stored_positions / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.generation_tokens / self.num_steps if self.num_steps else 0.0
