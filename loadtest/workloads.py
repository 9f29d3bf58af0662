"""Seeded synthetic request traces with the statistics of the paper's workloads.

No data set can be downloaded here, so these are synthetic stand-ins, not the
real ShareGPT, Alpaca or WMT16 traces: lengths are drawn from lognormal
distributions whose location is solved so that the mean *after* rounding and
clipping matches the paper's figures (Sec. 6.1, Fig. 11):

- ``sharegpt_like``: input mean 161, output mean 338 tokens, heavy tails,
  prompt + output clipped to ``max_model_len`` (2048 by default).
- ``alpaca_like``: input mean 19, output mean 58 tokens, light tails.
- ``shared_prefix``: a few-shot prefix common to every request (1-shot about
  80 tokens, 5-shot about 340, as in Sec. 6.4) plus a short distinct suffix.

Figures produced from these traces must say that the workloads are synthetic.
The same ``seed`` always gives the same trace, token ids and text.
"""
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

# Heavy tails: a lognormal with sigma 1 has a coefficient of variation of 1.3.
SHAREGPT = {"input_mean": 161, "output_mean": 338, "input_sigma": 1.0, "output_sigma": 1.0}
ALPACA = {"input_mean": 19, "output_mean": 58, "input_sigma": 0.6, "output_sigma": 0.8}
# Few-shot prefix lengths for the shared-prefix workload, by number of shots.
PREFIX_LEN = {1: 80, 5: 340}
# A sentence to translate and its translation.
SUFFIX_MEAN, SUFFIX_SIGMA = 30, 0.5
SHARED_OUTPUT_MEAN, SHARED_OUTPUT_SIGMA = 32, 0.5


@dataclass(frozen=True)
class Request:
    """One synthetic request: prompt and output lengths in tokens.

    ``prefix_len`` leading prompt tokens are shared with every other request of
    the trace that has a prefix (0: nothing shared)."""

    prompt_len: int
    output_len: int
    prefix_len: int = 0

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


# ---------------------------------------------------------------- lengths

def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(np.asarray(z, dtype=float) / math.sqrt(2.0)))


def _clipped_lognormal_mean(mu: float, sigma: float, low: float, high: np.ndarray) -> np.ndarray:
    """E[clip(X, low, high)] for X ~ lognormal(mu, sigma); ``high`` may be an array."""
    high = np.asarray(high, dtype=float)
    cdf = lambda x: _normal_cdf((np.log(x) - mu) / sigma)
    # Partial expectation: integral of x f(x) over [low, high].
    partial = math.exp(mu + sigma ** 2 / 2) * (
        _normal_cdf((np.log(high) - mu - sigma ** 2) / sigma)
        - _normal_cdf((math.log(low) - mu - sigma ** 2) / sigma))
    return low * cdf(low) + partial + high * (1.0 - cdf(high))


def _solve_mu(target_mean: float, sigma: float, low: float, high: np.ndarray,
              weights: Optional[np.ndarray] = None) -> float:
    """The mu for which the (weighted) mean of clip(X, low, high) is ``target_mean``."""
    lo, hi = math.log(low) - 10 * sigma, math.log(np.max(high)) + 10 * sigma
    w = np.ones(np.size(high)) / np.size(high) if weights is None else weights
    for _ in range(100):  # the clipped mean grows monotonically with mu
        mid = (lo + hi) / 2
        if float(np.dot(w, _clipped_lognormal_mean(mid, sigma, low, high))) < target_mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _lognormal_pmf(mu: float, sigma: float, cap: int) -> np.ndarray:
    """P(clip(rint(X), 1, cap) = k) for k = 1..cap."""
    edges = np.arange(1, cap, dtype=float) + 0.5
    cdf = np.concatenate([[0.0], _normal_cdf((np.log(edges) - mu) / sigma), [1.0]])
    return np.diff(cdf)


@functools.lru_cache(maxsize=None)
def _calibrate(input_mean: float, output_mean: float, input_sigma: float,
               output_sigma: float, max_model_len: int) -> tuple[float, float]:
    """Lognormal locations (mu) for prompt and output lengths."""
    prompt_cap = max_model_len // 2
    mu_in = _solve_mu(input_mean, input_sigma, 1.0, np.array([prompt_cap]))
    # The output cap depends on the prompt drawn; average the calibration over
    # the prompt length distribution so the clipped output mean hits its target.
    caps = max_model_len - np.arange(1, prompt_cap + 1)
    mu_out = _solve_mu(output_mean, output_sigma, 1.0, caps,
                       _lognormal_pmf(mu_in, input_sigma, prompt_cap))
    return mu_in, mu_out


def _paired_lengths(rng: np.random.Generator, n: int, input_mean: float, output_mean: float,
                    input_sigma: float, output_sigma: float, max_model_len: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths with prompt <= max_model_len // 2 and
    prompt + output <= max_model_len."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
    mu_in, mu_out = _calibrate(input_mean, output_mean, input_sigma, output_sigma, max_model_len)
    prompt_cap = max_model_len // 2
    prompts = np.clip(np.rint(rng.lognormal(mu_in, input_sigma, n)), 1, prompt_cap)
    outputs = np.clip(np.rint(rng.lognormal(mu_out, output_sigma, n)), 1, max_model_len - prompts)
    return prompts.astype(int), outputs.astype(int)


def _check_count(num_requests: int) -> None:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")


def sharegpt_like(num_requests: int, seed: int, max_model_len: int = 2048) -> list[Request]:
    """Conversational trace: long, heavy-tailed prompts and outputs (mean 161 / 338)."""
    _check_count(num_requests)
    rng = np.random.default_rng([seed, 1])
    prompts, outputs = _paired_lengths(rng, num_requests, max_model_len=max_model_len, **SHAREGPT)
    return [Request(int(p), int(o)) for p, o in zip(prompts, outputs)]


def alpaca_like(num_requests: int, seed: int, max_model_len: int = 2048) -> list[Request]:
    """Instruction-following trace: short prompts and outputs (mean 19 / 58)."""
    _check_count(num_requests)
    rng = np.random.default_rng([seed, 2])
    prompts, outputs = _paired_lengths(rng, num_requests, max_model_len=max_model_len, **ALPACA)
    return [Request(int(p), int(o)) for p, o in zip(prompts, outputs)]


def shared_prefix(num_requests: int, seed: int, shots: int = 1,
                  max_model_len: int = 2048) -> list[Request]:
    """Few-shot translation trace: one prefix shared by all, distinct suffixes."""
    _check_count(num_requests)
    if shots not in PREFIX_LEN:
        raise ValueError(f"shots must be one of {sorted(PREFIX_LEN)}, got {shots}")
    prefix = PREFIX_LEN[shots]
    rng = np.random.default_rng([seed, 3, shots])
    suffixes, outputs = _paired_lengths(
        rng, num_requests, SUFFIX_MEAN, SHARED_OUTPUT_MEAN, SUFFIX_SIGMA, SHARED_OUTPUT_SIGMA,
        max_model_len - prefix)
    return [Request(prefix + int(s), int(o), prefix) for s, o in zip(suffixes, outputs)]


WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    "sharegpt": sharegpt_like,
    "alpaca": alpaca_like,
    "shared-prefix-1": lambda n, seed, **kw: shared_prefix(n, seed, shots=1, **kw),
    "shared-prefix-5": lambda n, seed, **kw: shared_prefix(n, seed, shots=5, **kw),
}


def make_trace(name: str, num_requests: int, seed: int, **kwargs) -> list[Request]:
    """A trace by workload name (a key of ``WORKLOADS``)."""
    try:
        return WORKLOADS[name](num_requests, seed, **kwargs)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}") from None


# ---------------------------------------------------------------- arrivals

def poisson_arrivals(rate: float, num_requests: int, seed: int, start: float = 0.0) -> list[float]:
    """Arrival times in seconds of a Poisson process of ``rate`` requests/s.

    ``rate=math.inf`` sends everything at ``start`` (an offline batch)."""
    _check_count(num_requests)
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if math.isinf(rate):
        return [float(start)] * num_requests
    gaps = np.random.default_rng([seed, 4]).exponential(1.0 / rate, num_requests)
    return (start + np.cumsum(gaps)).tolist()


# ---------------------------------------------------------------- token ids

def make_prompt_token_ids(trace: Sequence[Request], vocab_size: int, seed: int,
                          prefix_token_ids: Optional[Sequence[int]] = None,
                          low: int = 100, high: Optional[int] = None) -> list[list[int]]:
    """Deterministic prompt token ids for a trace, drawn from ``[low, high)``.

    ``high`` defaults to ``vocab_size``; keep ``low`` above the special ids.
    Requests with ``prefix_len > 0`` start with the same prefix tokens: the
    given ``prefix_token_ids`` or one drawn from the seed."""
    high = vocab_size if high is None else high
    if not 0 <= low < high <= vocab_size:
        raise ValueError(f"need 0 <= low < high <= vocab_size, got [{low}, {high}) "
                         f"with vocab_size {vocab_size}")
    rng = np.random.default_rng([seed, 5])
    longest_prefix = max((r.prefix_len for r in trace), default=0)
    if prefix_token_ids is None:
        prefix = rng.integers(low, high, longest_prefix).tolist()
    else:
        prefix = list(prefix_token_ids)
        if len(prefix) < longest_prefix:
            raise ValueError(f"prefix_token_ids has {len(prefix)} ids, the trace needs {longest_prefix}")
    return [prefix[:r.prefix_len] + rng.integers(low, high, r.prompt_len - r.prefix_len).tolist()
            for r in trace]


# ---------------------------------------------------------------- text

WORDS = (
    "the of and to in is was for on that with as by at from it an be this are "
    "or which his her they we you not but all had have were one their there "
    "time year people way day man thing woman life child world school state "
    "family student group country problem hand part place case week company "
    "system program question work government number night point home water "
    "room mother area money story fact month lot right study book eye job "
    "word business issue side kind head house service friend father power hour "
    "game line end member law car city community name president team minute "
    "idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research "
    "girl guy moment air teacher force education river mountain garden window "
    "green quiet simple early bright careful open small large ancient modern "
    "write read speak listen travel build carry follow explain remember"
).split()


def _count_tokens(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(getattr(ids, "ids", ids))


def _text_of_length(tokenizer, rng: np.random.Generator, num_tokens: int) -> str:
    """Words from ``WORDS`` whose tokenization is about ``num_tokens`` long."""
    if num_tokens <= 0:
        return ""
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), 2 * num_tokens + 8)]
    measure = lambda k: _count_tokens(tokenizer, " ".join(words[:k]))
    count = num_tokens
    for _ in range(2):  # rescale the word count by the measured tokens per word
        count = min(len(words), max(1, round(count * num_tokens / max(measure(count), 1))))
    # Then walk a word at a time while that gets closer, a bounded number of steps.
    for _ in range(16):
        got = measure(count)
        if got < num_tokens and count < len(words):
            step = 1
        elif got > num_tokens and count > 1:
            step = -1
        else:
            break
        if abs(measure(count + step) - num_tokens) >= abs(got - num_tokens):
            break  # the neighbour is no closer
        count += step
    return " ".join(words[:count])


def make_text_prompts(trace: Sequence[Request], tokenizer, seed: int,
                      prefix_text: Optional[str] = None) -> list[str]:
    """Text prompts of roughly each request's prompt length under ``tokenizer``.

    ``tokenizer`` needs ``encode(text, add_special_tokens=False)`` returning ids
    (a list or an object with ``.ids``). Requests with a prefix share the same
    leading text: ``prefix_text`` or words drawn from the seed, sized to the
    longest ``prefix_len`` in the trace."""
    rng = np.random.default_rng([seed, 6])
    longest_prefix = max((r.prefix_len for r in trace), default=0)
    if prefix_text is None and longest_prefix:
        prefix_text = _text_of_length(tokenizer, rng, longest_prefix)
    prompts = []
    for r in trace:
        suffix = _text_of_length(tokenizer, rng, r.prompt_len - r.prefix_len)
        prompts.append(f"{prefix_text} {suffix}".strip() if r.prefix_len else suffix)
    return prompts
