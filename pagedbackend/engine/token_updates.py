"""The engine core's side of sampled tokens: append each sample to its
sequence (parallel samples fork on the first one), apply the stops decided
by tokens (the grammar's end, end of sequence, stop tokens, the length), end
finished groups, and report each touched request as a ``CoreOutput``. The
block changes go to the scheduler in the step's ``StepUpdate``; text, stop
strings and deltas are the output processor's (``output_processor.py``)."""
import dataclasses
import time
from typing import Set, List, Optional, Tuple

import torch

from ..core.scheduler import ScheduledSeq, StepUpdate
from ..core.sequence import GroupStatus, Sequence, SequenceGroup
from ..sample.sampler import LOGPROB_FLOOR
from .beam import beam_step
from .core_outputs import CoreOutput, SeqFinish, SeqStep
from .outputs import EngineStats


class TokenUpdates:
    def __init__(self, eos_token_ids: Set[int], max_model_len: int, stats: EngineStats):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stats = stats   # the engine's counters: generated tokens, finished requests

    # ------------------------------------------------------------ samples
    def apply_samples(self, group: SequenceGroup, seq: Sequence, samples, update: StepUpdate) -> None:
        """Append ``samples`` (one per candidate on a group's first token, else
        one) to ``seq`` and its forks; a sequence that stops is freed, and a
        group with none left finishes."""
        self._mark_token_time(group)
        new_seqs = [seq]
        if not group.forked:
            # Parallel sampling: every candidate shares the prompt's blocks.
            for i in range(1, len(samples)):
                child = seq.fork(i)
                if seq.constraint is not None:   # each candidate follows the grammar on its own
                    child.constraint = seq.constraint.fork()
                update.forks.append((seq, child))
                new_seqs.append(child)
            group.seqs = list(new_seqs)
            group.forked = True
        for s, sample in zip(new_seqs, samples):
            top = None if sample.top_logprobs is None else (sample.rank, sample.top_logprobs)
            s.append_token(sample.token_id, sample.logprob, top)
            self.stats.generation_tokens += 1
            self._check_stop(group, s, sample.token_id)
            if s.constraint is not None and s.finished:
                s.constraint.close()
            elif s.constraint is not None:   # accepted, and the next mask filled, on a grammar worker
                s.constraint.advance(sample.token_id)
            if s.finished:
                update.freed.append(s)
                group.seqs.remove(s)
                group.finished_seqs.append(s)
        if not group.seqs:
            self.finish_group(group, update)

    def apply_beams(self, group: SequenceGroup, seq_rows: List[Tuple[Sequence, int]], logits: torch.Tensor,
                    update: StepUpdate) -> bool:
        """One beam-search step of ``group`` (``beam.beam_step``); True when the search has finished."""
        num_beams = len(group.seqs)
        done = beam_step(group, seq_rows, logits, self.eos_token_ids, update)
        if done is None:   # held while some beams are recomputed
            return False
        self._mark_token_time(group)
        self.stats.generation_tokens += num_beams
        if done:
            self.finish_group(group, update)
        return done

    @staticmethod
    def _mark_token_time(group: SequenceGroup) -> None:
        now = time.time()
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token_id: int) -> None:
        """Set ``seq``'s finish reason if its new token ends it (stop strings
        are found on the text, by the output processor)."""
        params = group.params
        if seq.constraint is not None and seq.constraint.ends_with(token_id):   # the grammar took its end
            seq.finish_reason = "stop"
            return
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
                return
            if token_id in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token_id
                return
        if seq.num_output_tokens >= group.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def stop_seq(self, group: SequenceGroup, end: SeqFinish) -> Optional[Sequence]:
        """End the sequence that a stop string ended (``end``, from the output
        processor; none without ``stop_reason``) unless the core ended it meanwhile. A group left with no
        sequence finishes. Returns the sequence, whose blocks the caller frees."""
        seq = next((s for s in group.seqs if s.seq_id == end.seq_id), None) if end.stop_reason is not None else None
        if seq is None:
            return None
        seq.finish_reason, seq.stop_reason = "stop", end.stop_reason
        if seq.constraint is not None:
            seq.constraint.close()
        group.seqs.remove(seq)
        group.finished_seqs.append(seq)
        if not group.seqs:
            self.finish_group(group)
        return seq

    def finish_group(self, group: SequenceGroup, update: Optional[StepUpdate] = None) -> None:
        group.status = GroupStatus.FINISHED
        group.metrics.finished_time = time.time()
        if update is not None:
            update.finished.append(group)
        self.stats.finished_requests += 1

    # ------------------------------------------------------------ prompt log-probabilities
    @staticmethod
    def record_prompt_logprobs(group: SequenceGroup, item: ScheduledSeq, logits: torch.Tensor) -> None:
        """Add the prompt log-probabilities that the logits of one chunk
        (``item``, one row per position) give to ``group.prompt_logprobs``:
        per position ``{id: (logprob, rank)}``, the prompt token first, then
        the top ones (the output processor adds their text)."""
        prompt, have = group.prompt_token_ids, len(group.prompt_logprobs)
        # Row j is position start + j; it scores the token at start + j + 1.
        first = have - 1 - item.start_pos
        count = min(len(prompt) - have, logits.shape[0] - first)
        if first < 0 or count <= 0:
            return
        logprobs = torch.log_softmax(logits[first:first + count].float(), dim=-1).clamp_(min=LOGPROB_FLOOR)
        targets = torch.tensor(prompt[have:have + count], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > chosen).sum(dim=1) + 1
        k = group.params.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k else None
        for j, token in enumerate(prompt[have:have + count]):
            entries = {token: (float(chosen[j]), int(ranks[j]))}
            if top is not None:
                for rank, (value, other) in enumerate(zip(top.values[j].tolist(), top.indices[j].tolist()), 1):
                    if other != token:
                        entries[other] = (value, rank)
            group.prompt_logprobs.append(entries)

    # ------------------------------------------------------------ reports
    @staticmethod
    def report(group: SequenceGroup, error: Optional[str] = None, refused: bool = False) -> CoreOutput:
        """``group``'s news since its last report (``CoreOutput``)."""
        steps = []
        for seq in sorted(group.seqs + group.finished_seqs, key=lambda s: s.index):
            new_ids, new_logprobs = seq.take_new()
            steps.append(SeqStep(seq.seq_id, seq.index, new_ids, new_logprobs, seq.finish_reason, seq.stop_reason))
        prompt_logprobs = None
        if group.prompt_logprobs is not None and not group.needs_prompt_logits and not group.prompt_logprobs_sent:
            prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
        finished = group.is_finished or error is not None
        beams = None
        if finished and group.is_beam_search and group.beam is not None and group.beam.finished:
            beams = group.beam.best(group.params.n)
        return CoreOutput(group.request_id, group.prompt, group.prompt_token_ids, group.params, group.wants_logprob,
                          steps, finished, dataclasses.replace(group.metrics), prompt_logprobs, beams,
                          error, refused, group.is_beam_search, group.embedding)
