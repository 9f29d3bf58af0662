"""What the engine core hands to the output processor after a step, and what
the output processor hands back.

The core (scheduling, the forward pass, sampling, token-level stops) reports
per request the tokens each sequence gained since its last report, with their
raw log-probabilities; the output processor turns them into text, finds stop
strings, formats log-probabilities and builds the deltas a caller sees. A
stop string ends a sequence that the core still runs: the output processor
says so with a ``SeqFinish`` and the core frees it (``LLMEngine.finish``).
Everything here is a copy, so the two may run in different threads.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..core.sequence import RequestMetrics
from ..sampling_params import SamplingParams


@dataclass
class SeqStep:
    """One sequence's news: its output index, new tokens and, when kept, per
    new token ``(logprob, top)`` (``Sequence.append_token``); its finish as
    the core decided it (end of sequence, a stop token, the length, the
    grammar's end, an abort)."""
    seq_id: int
    index: int
    new_token_ids: List[int]
    new_logprobs: List[Tuple[Optional[float], Optional[tuple]]]
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None


@dataclass
class CoreOutput:
    """One request's news from a step: every sequence of the request (those
    without new tokens too), whether the core has finished it, and, once,
    its prompt log-probabilities (per prompt token ``{id: (logprob, rank)}``,
    None for the first) and, for a finished beam search, its best hypotheses."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    params: SamplingParams
    wants_logprob: bool
    seqs: List[SeqStep]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[list] = None
    beams: Optional[list] = None
    error: Optional[str] = None      # the request ended with an error (its final output)
    refused: bool = False            # with error: refused before it ran
    is_beam_search: bool = False
    embedding: Optional[List[float]] = None   # a finished embedding request's pooled vector


@dataclass
class SeqFinish:
    """From the output processor: ``seq_id`` of ``request_id`` stopped at a
    stop string (``stop_reason``); or, with ``error``, the whole request failed
    while its output was built (its final output is sent). ``dropped``:
    generated tokens it did not return (past a stop string, after a final
    output), which the core's count of generated tokens leaves out."""
    request_id: str
    seq_id: Optional[int] = None
    stop_reason: Optional[object] = None
    error: Optional[str] = None
    dropped: int = 0

