"""Sampling parameters, with vLLM's field names, defaults and ranges.

Every field is checked when the object is built, so a request that reaches
the engine cannot fail on its parameters: a wrong type, a value out of range
or a non-finite number raises ``InvalidRequestError`` naming the parameter
and what it accepts. What depends on the model (token ids inside the
vocabulary, the words of ``bad_words``) is checked by the engine at submission
(``LLMEngine.make_group``), still before the request is queued.
"""
import json
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

from .config import coerce
from .errors import InvalidRequestError
from .structured.params import (MAX_SCHEMA_DEPTH, MAX_TAG_DEPTH, StructuredOutputsParams, from_guided_fields,
                                 text_depth)

# Nesting of the sampling_parameters JSON: a structural tag inside structured_outputs.
MAX_PARAMETERS_DEPTH = MAX_TAG_DEPTH + 2

_EPS = 1e-5
# The most top log-probabilities one token may ask for (vLLM's default limit).
MAX_LOGPROBS = 20
# OpenAI's range for a logit bias.
MAX_LOGIT_BIAS = 100.0

# vLLM parameters that pagedbackend does not implement; a request that sets one
# is refused with the reason. Those marked with a default are accepted when
# they carry vLLM's default value (so clients that always send them still work).
UNSUPPORTED = {
    "lora_name": "an adapter is chosen per request, not by SamplingParams: the Triton model reads "
                 "lora_name beside the sampling parameters; LLM.generate takes lora_request=",
    "lora_request": "an adapter is chosen per request, not by SamplingParams: LLM.generate and "
                    "add_request take lora_request=",
    "logits_processors": "custom logits processors are not supported",
    "response_format": "response_format is an OpenAI API field; in sampling parameters use "
                       "structured_outputs (json, json_object, regex, choice, grammar)",
    "logprob_token_ids": "log-probabilities of chosen token ids are not supported",
    "extra_args": "extra_args are not supported",
}
# Taken as sent, never coerced from text (the checks in _validate apply).
VERBATIM = ("cache_salt",)
ACCEPTED_AT_DEFAULT = {"detokenize": True, "spaces_between_special_tokens": True,
                       "output_kind": None, "lora_name": None}


@dataclass
class SamplingParams:
    n: int = 1                         # outputs returned
    best_of: Optional[int] = None      # candidates generated (>= n); beam width for beam search
    presence_penalty: float = 0.0      # [-2, 2]: subtracted once from every token already generated
    frequency_penalty: float = 0.0     # [-2, 2]: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0    # > 0: as HF, over prompt and output (logit / p if > 0, else * p)
    temperature: float = 1.0           # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                    # -1 or 0: all tokens
    min_p: float = 0.0
    seed: Optional[int] = None         # per-request generator: same seed, same output
    max_tokens: Optional[int] = 16     # None: up to the model's context length
    min_tokens: int = 0                # EOS and stop tokens are suppressed before this many
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None   # words never generated (their last token is banned after their prefix)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None     # top log-probabilities returned per generated token (<= MAX_LOGPROBS)
    # vLLM's: for every prompt token after the first, its log-probability and
    # rank plus the top k (0: the prompt token alone), from the model's raw logits
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[Dict[int, float]] = None   # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Optional[List[int]] = None   # only these tokens may be generated
    truncate_prompt_tokens: Optional[int] = None    # keep only the last k prompt tokens
    use_beam_search: bool = False
    length_penalty: float = 1.0        # beam score = logprob sum / length ** length_penalty
    # beam search, as Hugging Face's: True stops once best_of hypotheses are finished;
    # False stops when no live beam can beat them at its current length; "never"
    # when none can at any length up to max_tokens (with length_penalty > 0)
    early_stopping: Union[bool, str] = False
    skip_special_tokens: bool = True
    # vLLM's per-request field: prefix-cache blocks are shared only between
    # requests with the same salt (one tenant's prompts stay out of another's reach)
    cache_salt: Optional[str] = None
    # vLLM's per-request priority: under scheduling_policy=priority lower values
    # are scheduled first and preempted last (ties by arrival); ignored under fcfs
    priority: int = 0
    # vLLM's: constrain the output to a JSON schema, regex, choice or grammar
    # (a StructuredOutputsParams or its JSON object)
    structured_outputs: Optional[StructuredOutputsParams] = None
    stop_list: List[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self):
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_list = list(self.stop)
        elif self.stop is not None:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        self.allowed_token_ids = (None if self.allowed_token_ids is None
                                  else _int_list("allowed_token_ids", self.allowed_token_ids))
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise InvalidRequestError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            self.top_k = -1
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.build(self.structured_outputs)
        self._validate()

    def _validate(self):
        def bad(msg):
            raise InvalidRequestError(msg)

        def integer(name, low, value=None, optional=False):
            value = getattr(self, name) if value is None else value
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                bad(f"{name} must be an integer >= {low}, got {value!r}")

        def number(name, low=-math.inf, high=math.inf, low_open=False, high_open=False):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
            if (value < low or (low_open and value == low)) or (value > high or (high_open and value == high)):
                lo, hi = ("(" if low_open else "[") + f"{low:g}", f"{high:g}" + (")" if high_open else "]")
                bad(f"{name} must be in {lo}, {hi}, got {value!r}")

        integer("n", 1)
        integer("best_of", 1)
        if self.best_of < self.n:
            bad(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        number("temperature", 0.0)
        number("top_p", 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, low_open=True)
        number("length_penalty")
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        integer("truncate_prompt_tokens", 1, optional=True)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            bad(f"priority must be an integer, got {self.priority!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids must not be empty")
        if isinstance(self.early_stopping, str) and self.early_stopping.strip().lower() in ("true", "false"):
            self.early_stopping = self.early_stopping.strip().lower() == "true"
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            bad(f'early_stopping must be true, false or "never", got {self.early_stopping!r}')
        for name in ("ignore_eos", "include_stop_str_in_output", "use_beam_search", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            if self.use_beam_search:
                bad("beam search does not combine with structured_outputs")
            if self.ignore_eos:
                bad("ignore_eos does not combine with structured_outputs: the output ends where its grammar does")
        if self.use_beam_search:
            if self.temperature > _EPS:
                bad("beam search needs temperature 0")
            if self.top_p < 1.0 or self.top_k != -1 or self.min_p > 0:
                bad("beam search does not combine with top_p, top_k or min_p")
            if self.has_logits_processing:
                bad("beam search does not combine with penalties, logit_bias, allowed_token_ids or bad_words")
            if self.logprobs is not None:
                bad("logprobs are not returned with beam search (each beam's cumulative_logprob is): "
                    "leave logprobs unset")
        else:
            if self.is_greedy and self.best_of > self.n:
                bad(f"best_of ({self.best_of}) > n ({self.n}) needs temperature > 0 or use_beam_search: "
                    "greedy candidates are all the same")
            if self.length_penalty != 1.0:
                bad(f"length_penalty ({self.length_penalty!r}) applies to beam search only: set "
                    "use_beam_search or leave it at 1")
            if self.early_stopping is not False:
                bad("early_stopping applies to beam search only: set use_beam_search or leave it false")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def beam_width(self) -> int:
        return self.best_of

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def has_logits_processing(self) -> bool:
        """Anything that changes the logits before selection besides temperature and the filters."""
        return bool(self.has_penalties or self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words)

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id the parameters name lies inside the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("logit_bias", list(self.logit_bias or {}))):
            outside = [t for t in ids if not 0 <= t < vocab_size]
            if outside:
                raise InvalidRequestError(f"{name}: token id {outside[0]} is outside the vocabulary "
                                          f"[0, {vocab_size})")

    @classmethod
    def from_dict(cls, params: Dict[str, Any]) -> "SamplingParams":
        """Build from JSON-like values (as sent to a server); numbers given as
        strings are accepted, unknown names are refused."""
        if not isinstance(params, dict):
            raise InvalidRequestError(f"sampling parameters must be a JSON object, got {type(params).__name__}")
        params = from_guided_fields(dict(params))
        for name, default in ACCEPTED_AT_DEFAULT.items():
            if name in params and params[name] == default:
                del params[name]
        unsupported = sorted(set(params) & set(UNSUPPORTED))
        if unsupported:
            raise InvalidRequestError(f"sampling parameter {unsupported[0]}: {UNSUPPORTED[unsupported[0]]}")
        fixed = sorted(set(params) & set(ACCEPTED_AT_DEFAULT))
        if fixed:
            raise InvalidRequestError(f"sampling parameter {fixed[0]} is only supported at its default "
                                      f"({json.dumps(ACCEPTED_AT_DEFAULT[fixed[0]])})")
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}")
        hints = typing.get_type_hints(cls)
        # A salt is taken as given: coercion would read "" (and "none") as no salt at all.
        kwargs = {name: value if name in VERBATIM else
                  coerce(f"sampling parameter {name}", hints[name], value, InvalidRequestError)
                  for name, value in params.items()}
        try:
            return cls(**kwargs)
        except TypeError as exc:  # e.g. comparing a list with an int
            raise InvalidRequestError(f"invalid sampling parameters: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> "SamplingParams":
        if text_depth(text) > MAX_PARAMETERS_DEPTH:   # before the recursive decoder sees it
            raise InvalidRequestError(f"sampling_parameters nests deeper than {MAX_PARAMETERS_DEPTH} levels "
                                      "(a schema goes in structured_outputs.json, at most "
                                      f"{MAX_SCHEMA_DEPTH} levels deep)")
        try:
            params = json.loads(text) if text.strip() else {}
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRequestError(f"sampling_parameters is not valid JSON: {exc}") from None
        return cls.from_dict(params)


def _int_list(name: str, value) -> List[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value):
        raise InvalidRequestError(f"{name} must be a list of non-negative integers, got {value!r}")
    return list(value)


def _logit_bias(value) -> Optional[Dict[int, float]]:
    """Token id -> bias; JSON object keys arrive as strings."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must be an object of token id -> bias, got {value!r}")
    bias = {}
    for key, amount in value.items():
        try:
            token = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0 or (isinstance(key, float) and not key.is_integer()):
            raise InvalidRequestError(f"logit_bias: {key!r} is not a token id")
        if (isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount)
                or abs(amount) > MAX_LOGIT_BIAS):
            raise InvalidRequestError(f"logit_bias: the bias of token {token} must be a number in "
                                      f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {amount!r}")
        bias[token] = float(amount)
    return bias
