"""From sampled tokens to what a request sees: append each sample to its
sequence (parallel samples fork on the first one), detokenise, check the
stops, end finished groups, and build the per-request output deltas (text
that might still become a stop string is held back). The block changes go to
the scheduler in the step's ``StepUpdate``; nothing here touches blocks."""
import dataclasses
import time
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..core.scheduler import ScheduledSeq, StepUpdate
from ..core.sequence import GroupStatus, Sequence, SequenceGroup
from ..sample.sampler import LOGPROB_FLOOR
from .beam import beam_step
from .detokenizer import decode_new_text, find_stop_string
from .outputs import CompletionOutput, EngineStats, Logprob, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Set[int], max_model_len: int, stats: EngineStats):
        self.tokenizer = tokenizer
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
            s.append_token(sample.token_id, sample.logprob, self._logprobs(sample))
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

    def _mark_token_time(self, group: SequenceGroup) -> None:
        now = time.time()
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now

    def _logprobs(self, sample) -> Optional[Dict[int, Logprob]]:
        """The sample's top log-probabilities as vLLM's Logprob entries, with
        rank and text; None when the request did not ask for them."""
        if sample.top_logprobs is None:
            return None
        # The sampled token first, then the top ones by rank, as vLLM lists them.
        entries = {sample.token_id: Logprob(sample.logprob, sample.rank,
                                            self.tokenizer.decode([sample.token_id]))}
        for rank, (token, logprob) in enumerate(sample.top_logprobs.items(), start=1):
            if token != sample.token_id:
                entries[token] = Logprob(logprob, rank, self.tokenizer.decode([token]))
        return entries

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token_id: int) -> None:
        """Detokenise ``seq``'s new token and set its finish reason if it stops."""
        params = group.params
        new_text = decode_new_text(self.tokenizer, seq, params.skip_special_tokens)
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
            if params.stop_list:
                stop = find_stop_string(seq, len(new_text), params.stop_list,
                                        params.include_stop_str_in_output)
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if seq.num_output_tokens >= group.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def finish_group(self, group: SequenceGroup, update: StepUpdate) -> None:
        group.status = GroupStatus.FINISHED
        group.metrics.finished_time = time.time()
        update.finished.append(group)
        self.stats.finished_requests += 1

    # ------------------------------------------------------------ prompt log-probabilities
    def record_prompt_logprobs(self, group: SequenceGroup, item: ScheduledSeq, logits: torch.Tensor) -> None:
        """Add the prompt log-probabilities that the logits of one chunk
        (``item``, one row per position) give to ``group.prompt_logprobs``."""
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
        decode = self.tokenizer.decode
        for j, token in enumerate(prompt[have:have + count]):
            entries = {token: Logprob(float(chosen[j]), int(ranks[j]), decode([token]))}
            if top is not None:
                for rank, (value, other) in enumerate(zip(top.values[j].tolist(), top.indices[j].tolist()), 1):
                    if other != token:
                        entries[other] = Logprob(value, rank, decode([other]))
            group.prompt_logprobs.append(entries)

    # ------------------------------------------------------------ outputs
    def output(self, group: SequenceGroup, finished: bool) -> Optional[RequestOutput]:
        """The group's output: a delta per sequence when it streams deltas,
        else the whole result once finished (None before)."""
        if group.streams_deltas:
            seqs = sorted(group.seqs + group.finished_seqs, key=lambda s: s.index)
            outputs = [self._delta(group, s) for s in seqs]
        elif not finished:
            return None
        elif group.is_beam_search and group.beam.finished:
            outputs = [self._beam_output(group, i, h) for i, h in enumerate(group.beam.best(group.params.n))]
        else:
            seqs = group.finished_seqs + group.seqs
            if group.params.best_of > group.params.n:
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)
            outputs = [self._delta(group, s, index=i) for i, s in enumerate(seqs[:group.params.n])]
        prompt_logprobs = None
        if group.prompt_logprobs is not None and not group.needs_prompt_logits and not group.prompt_logprobs_sent:
            prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                             finished, dataclasses.replace(group.metrics), prompt_logprobs=prompt_logprobs)

    def error_output(self, group: SequenceGroup, message: str, refused: bool = False) -> RequestOutput:
        """The final output of a request that ends with an error (finish reason
        ``abort``); ``refused``: it never ran (``RequestOutput.refused``)."""
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             [CompletionOutput(0, "", [], finish_reason="abort")], True,
                             dataclasses.replace(group.metrics), error=message, refused=refused)

    def _delta(self, group: SequenceGroup, seq: Sequence, index: Optional[int] = None) -> CompletionOutput:
        """New tokens and text since the last delta. Text that might still turn
        into a stop string is held back until it cannot."""
        text = seq.output_text
        end = len(text)
        params = group.params
        if not seq.finished and params.stop_list and not params.include_stop_str_in_output:
            end = max(seq.num_sent_chars, end - (max(len(s) for s in params.stop_list) - 1))
        new_text = text[seq.num_sent_chars:end]
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_sent_tokens:]
        seq.num_sent_chars = end
        seq.num_sent_tokens = seq.num_output_tokens
        top = None if params.logprobs is None else (seq.logprobs[-len(new_ids):] if new_ids else [])
        return CompletionOutput(seq.index if index is None else index, new_text, new_ids,
                                seq.cumulative_logprob if group.wants_logprob else None, top,
                                seq.finish_reason, seq.stop_reason, seq.num_output_tokens)

    def _beam_output(self, group: SequenceGroup, index: int, hyp) -> CompletionOutput:
        ids = hyp.token_ids[len(group.prompt_token_ids):]
        text = self.tokenizer.decode(ids, skip_special_tokens=group.params.skip_special_tokens)
        stop_ids = self.eos_token_ids | set(group.params.stop_token_ids)
        reason = "stop" if ids and ids[-1] in stop_ids and not group.params.ignore_eos else "length"
        return CompletionOutput(index, text, ids, hyp.cumulative_logprob, None, reason, None, len(ids))
