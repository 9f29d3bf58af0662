"""Sequences and sequence groups: the scheduler's unit of work.

A request becomes one ``SequenceGroup``. It starts with one sequence (the
prompt); parallel sampling and beam search fork it into several that share the
prompt's KV blocks. Preemption and admission act on whole groups.
"""
import enum
import itertools
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..sampling_params import SamplingParams


class GroupStatus(enum.Enum):
    WAITING = "waiting"    # no KV blocks: not admitted yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"    # blocks in the host pool
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass
class RequestMetrics:
    """One request's timeline on the engine's clock (``time.time()``)."""
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None    # when its latest token was sampled
    finished_time: Optional[float] = None
    num_cached_prompt_tokens: int = 0
    grammar_compile_time: Optional[float] = None   # seconds, when this request's grammar was compiled for it


class Sequence:
    """One token stream: prompt tokens followed by generated tokens."""

    def __init__(self, prompt_token_ids: List[int], index: int = 0):
        self.seq_id = next(_seq_ids)
        self.index = index                      # output index within its request
        self.token_ids: List[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0            # tokens whose K/V are in the cache
        self.cumulative_logprob = 0.0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        # Output tokens already handed to the output processor, and for those
        # not yet handed on, when log-probabilities are kept: per token
        # ``(logprob, top)``, ``top`` being ``(rank, {id: logprob})`` when asked.
        self.num_reported = 0
        self.new_logprobs: List[Tuple[Optional[float], Optional[tuple]]] = []
        # Structured outputs: the grammar matcher this sequence's tokens advance
        # (owned by the engine; None when unconstrained).
        self.constraint = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int, logprob: Optional[float], top: Optional[tuple] = None) -> None:
        """Add a generated token; ``logprob`` is None when nobody asked for it;
        ``top``: ``(rank, {id: logprob})`` of the top tokens, when asked."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob
            self.new_logprobs.append((logprob, top))

    def take_new(self) -> Tuple[List[int], List[Tuple[Optional[float], Optional[tuple]]]]:
        """The output tokens (and their log-probabilities) not yet handed on; marks them handed on."""
        start = self.num_prompt_tokens + self.num_reported
        new_ids, new_logprobs = self.token_ids[start:], self.new_logprobs
        self.num_reported += len(new_ids)
        self.new_logprobs = []
        return new_ids, new_logprobs

    def fork(self, index: int) -> "Sequence":
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = next(_seq_ids)
        child.index = index
        child.token_ids = list(self.token_ids)
        child.new_logprobs = list(self.new_logprobs)
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, index={self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, finish={self.finish_reason})")


class SequenceGroup:
    """All sequences of one request, with its sampling parameters."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                 params: SamplingParams, arrival_time: float, max_tokens: int):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.max_tokens = max_tokens            # resolved: never None
        self.status = GroupStatus.WAITING
        self.seqs: List[Sequence] = [Sequence(prompt_token_ids)]  # live sequences
        self.finished_seqs: List[Sequence] = []
        self.forked = False                     # parallel samples / beams created
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.beam = None                        # BeamSearchState for beam search
        # The chosen tokens' log-probabilities are computed only when they are
        # returned or needed: top logprobs, ranking best_of > n candidates, or
        # cumulative_logprob asked for (the Triton input return_cumulative_logprob).
        self.wants_logprob = params.logprobs is not None or params.best_of > params.n
        self.num_preemptions = 0
        self.bad_words_ids: List[List[int]] = []   # token sequences never to complete
        self.priority = params.priority         # lower first under scheduling_policy=priority
        # With prompt_logprobs: one entry per prompt token computed so far (the
        # first is None); collected from the prefill's logits, chunk by chunk.
        self.prompt_logprobs: Optional[list] = [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False
        # The request's prefix-cache namespace: blocks are shared only with equal salts.
        # With an adapter, its key follows the salt (lora.manager.Adapter.key).
        self.cache_salt: bytes = (params.cache_salt or "").encode("utf-8", "surrogatepass")
        self.grammar = None                     # structured outputs: the grammar's compile
        self.lora = None                        # the adapter it runs with (lora.manager.Adapter); None: base
        # An embedding request: its PoolingParams, resolved against the model
        # (pooling_type and normalize set). Its prompt is computed and pooled,
        # nothing is sampled (engine.pooling); None: a generation request.
        self.pooling = None
        # Computed whole in one step, never chunked, no prefix-cache hit: an
        # encoder's input (worker.encoder_runner), whose every token attends to all.
        self.whole_prompt = False
        # A cross-encoder's pair: the position where the second segment (the document) starts.
        self.token_type_start = None
        self.embedding: Optional[List[float]] = None   # its pooled output, once computed
        # Images of the prompt (multimodal.inputs.MultiModalItem), and their
        # hashes by block index for the prefix cache (multimodal.inputs.block_keys).
        self.mm_items: list = []
        self.block_keys: Optional[dict] = None

    @property
    def lora_name(self) -> Optional[str]:
        """Its adapter's name (None: the base model), for metrics and KV events."""
        return None if self.lora is None else self.lora.request.lora_name

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id (0: the base model, as vLLM's KV events give it)."""
        return 0 if self.lora is None else self.lora.request.lora_int_id

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt log-probabilities are asked for and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def reuses_cached_prefix(self) -> bool:
        """Whether a cached prefix may stand in for computing the prompt's
        first blocks: not when every prompt position's output is needed
        (prompt log-probabilities; a MEAN or CLS pooler, which reads every
        position's hidden state, or the first one's)."""
        if self.needs_prompt_logits or self.whole_prompt:
            return False
        return self.pooling is None or self.pooling.pooling_type == "LAST"

    @property
    def is_beam_search(self) -> bool:
        return self.params.use_beam_search

    @property
    def streams_deltas(self) -> bool:
        """Plain sampling with every candidate returned streams token by token;
        beam search and best_of > n decide their outputs only at the end."""
        return not self.is_beam_search and self.params.best_of == self.params.n

    @property
    def is_finished(self) -> bool:
        return self.status == GroupStatus.FINISHED

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, {self.status.value}, seqs={self.seqs})"
