"""From a step's logits to tokens applied to their sequences: prompt
log-probabilities taken from prefill chunks, one sample row per candidate (or
per position of a speculative entry, verified by ``spec_decode``), the
batch sampled at once, and the tokens applied to their sequences
(``token_updates.py``).

A request whose share of this raises fails alone (``isolated``): it is
recorded with the reason, whatever it added to the step's update that would
hand it blocks is withdrawn, and the other requests go on.
"""
import logging
from collections import defaultdict
from typing import Dict, List, Optional, Sequence as Seq, Set

import torch

from ..core.scheduler import ScheduledSeq, StepUpdate
from ..core.sequence import Sequence, SequenceGroup
from ..errors import InvalidRequestError
from ..sample import SampleRow, Sampler
from .token_updates import TokenUpdates

logger = logging.getLogger("pagedbackend")


def isolated(group: SequenceGroup, failed: Dict, what: str, work, update: Optional[StepUpdate] = None) -> bool:
    """Run one request's share of a step. If it raises, the request alone
    fails: it is recorded in ``failed`` (with the reason, also logged, and
    whether it is the request's own fault: an ``InvalidRequestError``) and
    whatever it added to ``update`` that would hand it blocks is withdrawn."""
    marks = (len(update.forks), len(update.finished)) if update is not None else None
    try:
        work()
        return True
    except Exception as exc:
        if update is not None:
            del update.forks[marks[0]:]
            del update.finished[marks[1]:]
        own_fault = isinstance(exc, InvalidRequestError)
        if own_fault:   # the message is the client's to read
            message = str(exc)
            logger.info("request %s refused while %s: %s", group.request_id, what, exc)
        else:
            message = f"request {group.request_id} failed while {what}: {type(exc).__name__}: {exc}"
            logger.error("%s", message, exc_info=True)
        failed.setdefault(group.request_id, (group, message, own_fault))
        return False


class StepSampler:
    def __init__(self, sampler: Sampler, tokens: TokenUpdates, eos_token_ids: Set[int], speculator=None):
        self.sampler, self.tokens = sampler, tokens
        self.eos_token_ids, self.speculator = eos_token_ids, speculator

    def take_prompt_logprobs(self, logits: torch.Tensor, scheduled: Seq[ScheduledSeq],
                             failed: Dict) -> torch.Tensor:
        """Record the prompt log-probabilities that this step's chunks give
        (the logits of position p score the prompt token at p + 1) and return
        the logits of the rows to sample: per entry that needs logits, its
        last token's and its speculative tokens'."""
        row, sample_rows = 0, []
        for item in scheduled:
            count = item.num_logit_rows
            if item.prompt_logits:
                group = item.group
                isolated(group, failed, "computing prompt log-probabilities",
                         lambda: self.tokens.record_prompt_logprobs(group, item, logits[row:row + count]))
            if item.need_logits:
                sample_rows.extend(range(row + count - 1 - item.num_draft_tokens, row + count))
            row += count
        return logits[sample_rows]

    def sample_and_apply(self, logits: torch.Tensor, completing: Seq[ScheduledSeq],
                         update: StepUpdate, failed: Dict) -> List[SequenceGroup]:
        """Sample every completing sequence and apply the tokens; returns the
        groups that changed. A group whose share raises is recorded in
        ``failed`` and left out; the others go on."""
        owners = []   # (group, seq, its sample rows, its entry)
        beams = defaultdict(list)
        row = 0
        for item in completing:
            group, seq = item.group, item.seq
            if seq.constraint is not None and not self._grammar_ready(item, update, failed):
                row += 1 + item.num_draft_tokens
                continue
            if group.is_beam_search:
                beams[group].append((seq, row))
            elif item.num_lookahead:
                owners.append((group, seq, self.speculator.sample_rows(item, row, self._sample_row), item))
            else:
                copies = group.params.best_of if not group.forked else 1
                owners.append((group, seq, [self._sample_row(group, seq, row, seq.index + i)
                                            for i in range(copies)], item))
            row += 1 + item.num_draft_tokens
        touched: Dict[str, SequenceGroup] = {}
        for (group, seq, _, item), samples in zip(owners, self._sample_owners(logits, owners, failed)):
            if group.request_id in failed:
                continue
            if item.num_lookahead:   # the verified tokens, one after another
                work = self.speculator.verify(item, samples, update, self.tokens.apply_samples)
            else:
                work = lambda: self.tokens.apply_samples(group, seq, samples, update)  # noqa: E731
            if isolated(group, failed, "applying its tokens", work, update):
                touched[group.request_id] = group
        for group, seq_rows in beams.items():
            done = []
            if isolated(group, failed, "a beam search step",
                        lambda: done.append(self.tokens.apply_beams(group, seq_rows, logits, update)), update):
                if done[0]:
                    touched[group.request_id] = group
        return [g for g in touched.values() if g.request_id not in failed]

    def _grammar_ready(self, item: ScheduledSeq, update: StepUpdate, failed: Dict) -> bool:
        """Whether a constrained entry's mask is ready. A grammar over its mask
        budget (or whose work failed) fails its request alone; one still at
        work is not sampled in this step, and its positions are computed again
        in the next (``grammar_worker.py``)."""
        state = item.seq.constraint
        if not isolated(item.group, failed, "advancing its grammar", state.check):
            return False
        if state.ready():
            return True
        update.uncomputed[item.seq.seq_id] = 1 + item.num_draft_tokens
        if item.num_lookahead and self.speculator is not None:
            self.speculator.withdraw(item)
        return False

    def _sample_owners(self, logits: torch.Tensor, owners, failed: Dict) -> List[list]:
        """Samples per owner: the whole batch at once; should that raise, each
        owner alone, so that only the owners whose rows raise fail."""
        rows = [r for _, _, owner_rows, _ in owners for r in owner_rows]
        if not rows:
            return []
        try:
            samples = self.sampler(logits, rows)
        except Exception:
            per_owner = []
            for group, _, owner_rows, _ in owners:
                result = []
                isolated(group, failed, "sampling", lambda: result.extend(self.sampler(logits, owner_rows)))
                per_owner.append(result)
            return per_owner
        per_owner, k = [], 0
        for _, _, owner_rows, _ in owners:
            per_owner.append(samples[k:k + len(owner_rows)])
            k += len(owner_rows)
        return per_owner

    def _sample_row(self, group: SequenceGroup, seq: Sequence, row: int, index: int,
                    ahead: Seq[int] = (), constraint=None) -> SampleRow:
        """The sample row of ``seq``'s next position, or, with ``ahead``
        (speculative tokens before it), of the position after those."""
        params = group.params
        position = seq.num_output_tokens + len(ahead)
        constraint = seq.constraint if constraint is None else constraint
        suppress = ()
        if position < params.min_tokens:
            suppress = sorted(self.eos_token_ids | set(params.stop_token_ids))
        key = (params.seed, index, position) if params.seed is not None else None
        if not params.has_logits_processing:
            return SampleRow(row, params, suppress, key, group.wants_logprob, constraint=constraint)
        token_ids = seq.token_ids + list(ahead) if ahead else seq.token_ids
        return SampleRow(row, params, suppress, key, group.wants_logprob, token_ids,
                         seq.num_prompt_tokens, group.bad_words_ids, constraint)
