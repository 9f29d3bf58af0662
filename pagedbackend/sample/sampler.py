"""Token selection for a batch of sequences with different sampling parameters.

First the logits of each row are processed as its parameters ask: the
repetition penalty (as Hugging Face: over prompt and output, a positive logit
divided by it, a negative one multiplied), presence and frequency penalties
(as vLLM and OpenAI: over the generated tokens), logit bias, allowed tokens,
bad words, and the EOS / stop tokens held back before ``min_tokens``.
Greedy rows take the argmax. Sampled rows apply temperature, top-k, top-p and
min-p, then draw with the exponential race (argmax of p / E, E ~ Exp(1)), which
equals a categorical draw. Log-probabilities are taken from the processed
logits, before temperature, and only for rows that ask for them
(``SampleRow.logprob``, or top log-probabilities in the request): each costs a
log-softmax over the whole vocabulary. Tokens ruled out (-inf) get
``LOGPROB_FLOOR``, as vLLM writes them. A row with a seed draws its noise from a generator
keyed by (seed, output index, position), so its result does not depend on the
batch it lands in, nor on preemption.
"""
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..sampling_params import SamplingParams
from .token_mask import mask_logits

# Log-probabilities are written no lower than this (vLLM's floor): a token the
# grammar, allowed_token_ids or a bias of -inf rules out would otherwise be
# -inf, which no JSON answer can carry.
LOGPROB_FLOOR = -9999.0


def finite_logprob(value: float) -> float:
    """``value`` with -inf (and NaN) raised to ``LOGPROB_FLOOR``."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass
class SampleRow:
    row: int                           # which logits row
    params: SamplingParams
    suppress: Sequence[int] = ()       # token ids forbidden now (EOS before min_tokens)
    seed_key: Optional[Tuple[int, int, int]] = None  # (seed, output index, position)
    logprob: bool = False              # return the chosen token's log-probability
    # For penalties and bad words (set when the parameters ask for them):
    token_ids: Sequence[int] = ()      # the sequence so far, prompt then output
    num_prompt_tokens: int = 0
    bad_words_ids: Sequence[Sequence[int]] = ()
    constraint: Optional[object] = None  # the sequence's grammar matcher (structured outputs)


@dataclass
class Sample:
    token_id: int
    logprob: Optional[float] = None    # under the processed distribution, before temperature; when asked
    top_logprobs: Optional[Dict[int, float]] = None   # when asked: the top ids and the chosen one
    rank: Optional[int] = None         # when asked: 1 + tokens more likely than the chosen one


def _seeded_generator(key: Tuple[int, int, int], device: torch.device) -> torch.Generator:
    seed, index, position = key
    mixed = ((seed * 1_000_003 + index) * 1_000_033 + position) % (2 ** 63)
    return torch.Generator(device=device).manual_seed(mixed)


class NoAllowedTokenError(ValueError):
    """A constrained row where the grammar and the other parameters together allow no token."""


def apply_suppression(logits: torch.Tensor, rows: Sequence[SampleRow], masked: bool = False) -> None:
    """Structured-output masks (unless ``masked``), then each row's processing
    and suppressed tokens. On a constrained row, holding back EOS before
    ``min_tokens`` yields to a grammar that allows nothing else (the output is
    complete)."""
    if not masked:
        mask_logits(logits, rows)
    for r in rows:
        if r.params.has_logits_processing:
            _process_row(logits[r.row], r)
        if r.suppress:
            ids = list(r.suppress)
            kept = logits[r.row, ids].clone() if r.constraint is not None else None
            logits[r.row, ids] = float("-inf")
            if kept is not None and not bool(torch.isfinite(logits[r.row]).any()):
                logits[r.row, ids] = kept
        # The grammar alone always allows a token; processing and suppression may take them all.
        if (r.constraint is not None and (r.suppress or r.params.has_logits_processing)
                and not bool(torch.isfinite(logits[r.row]).any())):
            raise NoAllowedTokenError("no token satisfies the structured-output constraint together with "
                                      "allowed_token_ids, bad_words or logit_bias")


def _process_row(logits: torch.Tensor, r: SampleRow) -> None:
    """Penalties, bias, allowed tokens and bad words for one row, in place."""
    p, device = r.params, logits.device
    output = list(r.token_ids[r.num_prompt_tokens:])
    if p.repetition_penalty != 1.0 and r.token_ids:
        seen = torch.tensor(sorted(set(r.token_ids)), device=device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                   values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output:
        ids, counts = torch.tensor(output, device=device).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=device)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device)
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[torch.tensor(p.allowed_token_ids, device=device)] = True
        logits.masked_fill_(~keep, float("-inf"))
    for word in r.bad_words_ids:
        prefix = list(word[:-1])
        if not prefix or output[-len(prefix):] == prefix:
            logits[word[-1]] = float("-inf")


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks, for rows of ``logits``."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temps.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
        rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = rank >= ks.unsqueeze(1)
        top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= top_ps.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_ps = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


ARGMAX_BLOCK = 1024


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a 2-D tensor: the same indices (the first
    of equal maxima; NaN counts as the largest), found in two passes. torch's
    CPU argmax over the last dimension runs a row at a time in scalar code (3
    ms for 30 rows of 49,152 here), while amax is vectorised. So each block of
    ``ARGMAX_BLOCK`` values gets its maximum, then argmax runs over those
    maxima and over the one block that holds the row's first maximum."""
    rows, width = logits.shape
    if width < 4 * ARGMAX_BLOCK or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    full = width // ARGMAX_BLOCK * ARGMAX_BLOCK
    block_max = logits[:, :full].reshape(rows, -1, ARGMAX_BLOCK).amax(dim=-1)
    if full < width:   # a last, shorter block
        block_max = torch.cat([block_max, logits[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    starts = block_max.argmax(dim=-1) * ARGMAX_BLOCK
    # The chosen block of each row; the last one's positions past the end
    # repeat the last value, after it, so they are never the first maximum.
    columns = (starts[:, None] + torch.arange(ARGMAX_BLOCK, device=logits.device)).clamp_(max=width - 1)
    return starts + logits.gather(1, columns).argmax(dim=-1)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow],
           generator: Optional[torch.Generator] = None, masked: bool = False) -> List[Sample]:
    """One token per row. ``logits`` is float32 ``[num_rows_in_batch, vocab]``;
    it is modified in place by suppression (``masked``: the structured-output
    masks are applied already)."""
    apply_suppression(logits, rows, masked)
    # Greedy picks for every row at once (no copy of the logits).
    row_idx = torch.tensor([r.row for r in rows], device=logits.device)
    token_ids = row_argmax(logits)[row_idx]
    random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random:
        idx = torch.tensor([rows[i].row for i in random], device=logits.device)
        probs = _filter(logits[idx], [rows[i].params for i in random]).softmax(dim=-1)
        noise = torch.empty_like(probs)
        for j, i in enumerate(random):
            key = rows[i].seed_key
            noise[j].exponential_(generator=_seeded_generator(key, logits.device) if key else generator)
        token_ids[random] = row_argmax(probs / noise)
    samples = [Sample(t) for t in token_ids.tolist()]
    asked = [i for i, r in enumerate(rows) if r.logprob or r.params.logprobs is not None]
    if asked:
        # The processed logits' log-probabilities, for the asking rows only
        # (log_softmax is the fastest normaliser on CPU).
        logprobs = torch.log_softmax(logits[row_idx[asked]], dim=-1).clamp_(min=LOGPROB_FLOOR)
        chosen = logprobs.gather(1, token_ids[asked].unsqueeze(1)).squeeze(1).tolist()
        for j, i in enumerate(asked):
            samples[i].logprob = chosen[j]
            k = rows[i].params.logprobs
            if k is not None:
                top = {}
                if k > 0:
                    values, ids = logprobs[j].topk(k)
                    top = dict(zip(ids.tolist(), values.tolist()))
                top[samples[i].token_id] = chosen[j]
                samples[i].top_logprobs = top
                samples[i].rank = int((logprobs[j] > chosen[j]).sum()) + 1
    return samples


class Sampler:
    """``sample`` with the engine's unseeded generator, kept on the logits'
    device (a CPU generator cannot draw into CUDA tensors)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._generator: Optional[torch.Generator] = None
        self.mask_seconds = 0.0   # spent filling and applying structured-output masks

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> List[Sample]:
        if any(r.constraint is not None for r in rows):
            start = time.perf_counter()
            mask_logits(logits, rows)
            self.mask_seconds += time.perf_counter() - start
        return sample(logits, rows, self.generator(logits.device), masked=True)
