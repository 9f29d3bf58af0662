"""Sampling parameters, with vLLM's field names and defaults."""
import json
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

from .config import coerce

_EPS = 1e-5


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad parameters, a prompt that can never fit)."""


@dataclass
class SamplingParams:
    n: int = 1                         # outputs returned
    best_of: Optional[int] = None      # candidates generated (>= n); beam width for beam search
    temperature: float = 1.0           # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                    # -1 or 0: all tokens
    min_p: float = 0.0
    seed: Optional[int] = None         # per-request generator: same seed, same output
    max_tokens: Optional[int] = 16     # None: up to the model's context length
    min_tokens: int = 0                # EOS and stop tokens are suppressed before this many
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None     # top log-probabilities returned per generated token
    use_beam_search: bool = False
    length_penalty: float = 1.0        # beam score = logprob sum / length ** length_penalty
    early_stopping: bool = False       # beam search: stop once best_of hypotheses are finished
    skip_special_tokens: bool = True
    stop_list: List[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self):
        if self.best_of is None:
            self.best_of = self.n
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self):
        def bad(msg):
            raise InvalidRequestError(msg)
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            bad(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.use_beam_search:
            if self.best_of < 2 and self.n < 2:
                pass  # width 1 beam search is greedy search; allowed
            if self.temperature > _EPS:
                bad("beam search needs temperature 0")
            if self.top_p < 1.0 or self.top_k != -1 or self.min_p > 0:
                bad("beam search does not combine with top_p, top_k or min_p")
        elif self.is_greedy and self.best_of > 1:
            bad(f"best_of > 1 ({self.best_of}) needs temperature > 0 or use_beam_search")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def beam_width(self) -> int:
        return self.best_of

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "SamplingParams":
        """Build from JSON-like values (as sent to a server); numbers given as
        strings are accepted, unknown names are refused."""
        if not isinstance(params, dict):
            raise InvalidRequestError(f"sampling parameters must be a JSON object, got {type(params).__name__}")
        known = {f.name: f for f in fields(cls) if f.init}
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        kwargs = {}
        for name, value in params.items():
            kwargs[name] = coerce(f"sampling parameter {name}", hints[name], value, InvalidRequestError)
        try:
            return cls(**kwargs)
        except TypeError as exc:  # e.g. comparing a list with an int
            raise InvalidRequestError(f"invalid sampling parameters: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> "SamplingParams":
        try:
            params = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"sampling_parameters is not valid JSON: {exc}") from None
        return cls.from_dict(params)
