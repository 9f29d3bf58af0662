"""Beam search over shared KV blocks, step for step the same selection as
Hugging Face transformers' ``generate(num_beams=k, do_sample=False)``.

Each step takes the best ``K = max(2, 1 + #eos) * width`` continuations of all
live beams by cumulative log-probability. Among them, candidates ranked in the
top ``width`` that end the sequence (EOS, or the length limit) become finished
hypotheses scored ``logprob_sum / generated_len ** length_penalty``; the best
``width`` that do not end it become the next live beams. The search stops when
no live beam can beat the worst of ``width`` finished hypotheses.

The engine turns the selection into block operations: a beam chosen as a parent
more than once is forked (its blocks shared), a beam not chosen is freed, and
only the block being extended is copied on write.
"""
from dataclasses import dataclass, field
from typing import List, Sequence, Set, Tuple, Union

import torch


@dataclass
class Hypothesis:
    score: float                # length-normalised
    cumulative_logprob: float
    token_ids: List[int]        # prompt + generated


@dataclass
class BeamStep:
    # (parent beam index, token id, cumulative logprob) for the next live beams
    continuations: List[Tuple[int, int, float]]
    done: bool


@dataclass
class BeamSearchState:
    width: int
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False   # True, False or "never", as Hugging Face's
    finished: List[Hypothesis] = field(default_factory=list)   # best first, at most width
    improvable: bool = True

    def step(self, beam_token_ids: Sequence[List[int]], beam_logprob_sums: Sequence[float],
             logprobs: torch.Tensor, num_generated: int, max_tokens: int,
             stop_ids: Set[int]) -> BeamStep:
        """``logprobs`` is ``[num_live_beams, vocab]`` (log-softmax of each beam's
        next-token logits); ``num_generated`` tokens precede this step."""
        width = self.width
        vocab = logprobs.shape[1]
        k = max(2, 1 + len(stop_ids)) * width
        sums = torch.tensor(beam_logprob_sums, dtype=logprobs.dtype, device=logprobs.device)
        scores = (logprobs + sums.unsqueeze(1)).flatten()
        top_scores, top_idx = scores.topk(min(k, scores.numel()))
        length = num_generated + 1
        at_limit = length >= max_tokens
        continuations = []
        ends_all = True
        for rank, (score, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
            parent, token = divmod(idx, vocab)
            ends = at_limit or token in stop_ids
            ends_all &= ends
            if ends:
                if rank < width and self.improvable and not self._full_and_early():
                    self._add(Hypothesis(score / length ** self.length_penalty, score,
                                         beam_token_ids[parent] + [token]))
            elif len(continuations) < width:
                continuations.append((parent, token, score))
        if len(self.finished) == width and continuations:
            # "never": the best live beam might still grow to max_tokens (HF's canonical rule)
            reach = max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
            best_possible = continuations[0][2] / reach ** self.length_penalty
            if best_possible <= self.finished[-1].score:
                self.improvable = False
        done = ends_all or not self.improvable or self._full_and_early() or not continuations
        return BeamStep(continuations, done)

    def _full_and_early(self) -> bool:
        return self.early_stopping is True and len(self.finished) == self.width

    def _add(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        # Stable sort: among equal scores the earlier hypothesis stays ahead.
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width:]

    def best(self, n: int) -> List[Hypothesis]:
        return self.finished[:n]
