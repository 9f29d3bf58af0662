"""Token selection for a batch of sequences with different sampling parameters.

Greedy rows take the argmax. Sampled rows apply temperature, top-k, top-p and
min-p, then draw with the exponential race (argmax of p / E, E ~ Exp(1)), which
equals a categorical draw. The chosen token's log-probability (a log-softmax
over the whole vocabulary) is computed only for rows that ask for it
(``SampleRow.logprob``, or top log-probabilities in the request). A row with a seed draws its noise from a generator
keyed by (seed, output index, position), so its result does not depend on the
batch it lands in, nor on preemption.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..sampling_params import SamplingParams


@dataclass
class SampleRow:
    row: int                           # which logits row
    params: SamplingParams
    suppress: Sequence[int] = ()       # token ids forbidden now (EOS before min_tokens)
    seed_key: Optional[Tuple[int, int, int]] = None  # (seed, output index, position)
    logprob: bool = False              # return the chosen token's log-probability


@dataclass
class Sample:
    token_id: int
    logprob: Optional[float] = None    # under the model's distribution, when asked
    top_logprobs: Optional[Dict[int, float]] = None


def _seeded_generator(key: Tuple[int, int, int], device: torch.device) -> torch.Generator:
    seed, index, position = key
    mixed = ((seed * 1_000_003 + index) * 1_000_033 + position) % (2 ** 63)
    return torch.Generator(device=device).manual_seed(mixed)


def apply_suppression(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    for r in rows:
        if r.suppress:
            logits[r.row, list(r.suppress)] = float("-inf")


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


def sample(logits: torch.Tensor, rows: Sequence[SampleRow],
           generator: Optional[torch.Generator] = None) -> List[Sample]:
    """One token per row. ``logits`` is float32 ``[num_rows_in_batch, vocab]``;
    it is modified in place by suppression."""
    apply_suppression(logits, rows)
    # Greedy picks for every row at once (no copy of the logits).
    row_idx = torch.tensor([r.row for r in rows], device=logits.device)
    token_ids = logits.argmax(dim=-1)[row_idx]
    random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random:
        idx = torch.tensor([rows[i].row for i in random], device=logits.device)
        probs = _filter(logits[idx], [rows[i].params for i in random]).softmax(dim=-1)
        noise = torch.empty_like(probs)
        for j, i in enumerate(random):
            key = rows[i].seed_key
            noise[j].exponential_(generator=_seeded_generator(key, logits.device) if key else generator)
        token_ids[random] = (probs / noise).argmax(dim=-1)
    samples = [Sample(t) for t in token_ids.tolist()]
    asked = [i for i, r in enumerate(rows) if r.logprob or r.params.logprobs is not None]
    if asked:
        # The model's log-probabilities, for the asking rows only (log_softmax
        # is the fastest normaliser on CPU).
        logprobs = torch.log_softmax(logits[row_idx[asked]], dim=-1)
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
    return samples


class Sampler:
    """``sample`` with the engine's unseeded generator, kept on the logits'
    device (a CPU generator cannot draw into CUDA tensors)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._generator: Optional[torch.Generator] = None

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> List[Sample]:
        return sample(logits, rows, self.generator(logits.device))
