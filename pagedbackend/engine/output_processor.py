"""From the engine core's reports to what a request sees, after the step and
off it: detokenise each sequence's new tokens, find stop strings, format
log-probabilities with their text, and build the per-request output deltas
(text that might still become a stop string is held back).

The output processor keeps its own state per request (the text so far, what
was sent) and reads only the reports (``core_outputs.CoreOutput``), so it
may run in another thread than the core. A stop string ends a sequence the
core still runs: its tokens past the stop are dropped here and the core is
told (``SeqFinish``) to free it. A request whose output cannot be built
fails alone: it gets its final output with the error and the core is told.
"""
import dataclasses
import logging
import time
from typing import Dict, List, Optional, Set, Tuple

from .core_outputs import CoreOutput, SeqFinish, SeqStep
from .detokenizer import decode_new_text, find_stop_string
from .outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput

logger = logging.getLogger("pagedbackend")


class SeqText:
    """One sequence as the output processor sees it: its tokens, its text and
    the incremental detokeniser's offsets (``detokenizer.py``), what was sent."""

    def __init__(self, prompt_token_ids: List[int], index: int):
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_text = ""
        self.prefix_offset = self.read_offset = 0
        self.num_sent_tokens = self.num_sent_chars = 0
        self.logprobs: List[Dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Request:
    def __init__(self):
        self.seqs: Dict[int, SeqText] = {}   # by sequence id


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Set[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._requests: Dict[str, _Request] = {}
        # Requests whose final output was sent while the core still runs them.
        self._closed: Set[str] = set()

    def process(self, reports: List[CoreOutput]) -> Tuple[List[RequestOutput], List[SeqFinish]]:
        """The outputs of a step's reports, in order, and what the core must end."""
        outputs, finishes = [], []
        for report in reports:
            try:
                out = self._process(report, finishes)
            except Exception as exc:   # this request alone
                message = f"request {report.request_id} failed while applying its tokens: " \
                          f"{type(exc).__name__}: {exc}"
                logger.error("%s", message, exc_info=True)
                self._requests.pop(report.request_id, None)
                if not report.finished:
                    self._closed.add(report.request_id)
                finishes.append(SeqFinish(report.request_id, error=message))
                out = self._error_output(report, message, False)
            if out is not None:
                outputs.append(out)
        return outputs, finishes

    def _process(self, report: CoreOutput, finishes: List[SeqFinish]) -> Optional[RequestOutput]:
        rid = report.request_id
        if rid in self._closed:   # its final output is out; the core catches up
            dropped = sum(len(step.new_token_ids) for step in report.seqs)
            if dropped:
                finishes.append(SeqFinish(rid, dropped=dropped))
            if report.finished:
                self._closed.discard(rid)
            return None
        if report.error is not None:
            self._requests.pop(rid, None)
            return self._error_output(report, report.error, report.refused)
        if report.embedding is not None:   # an embedding request: its one output
            return EmbeddingRequestOutput(rid, report.prompt, report.prompt_token_ids,
                                          EmbeddingOutput(report.embedding), True, report.metrics)
        request = self._requests.get(rid)
        if request is None:
            request = self._requests[rid] = _Request()
        for step in report.seqs:
            seq = request.seqs.get(step.seq_id)
            if seq is None:
                seq = request.seqs[step.seq_id] = SeqText(report.prompt_token_ids, step.index)
            if not seq.finished:
                self._apply(report, seq, step, finishes)
            elif step.new_token_ids:   # the core ran on past its stop string
                finishes.append(SeqFinish(rid, step.seq_id, dropped=len(step.new_token_ids)))
        finished = report.finished or all(s.finished for s in request.seqs.values())
        if finished:
            del self._requests[rid]
            if not report.finished:
                self._closed.add(rid)
        return self._output(report, request, finished)

    # ------------------------------------------------------------ tokens to text
    def _apply(self, report: CoreOutput, seq: SeqText, step: SeqStep, finishes: List[SeqFinish]) -> None:
        """Add ``step``'s tokens to ``seq``'s text, one at a time, until a stop string ends it."""
        params, beams = report.params, report.is_beam_search
        wants_top = params.logprobs is not None
        for i, token in enumerate(step.new_token_ids):
            seq.token_ids.append(token)
            if step.new_logprobs:
                logprob, top = step.new_logprobs[i]
                seq.cumulative_logprob += logprob
                if wants_top and top is not None:
                    seq.logprobs.append(self._logprobs(token, logprob, *top))
            if beams:   # beams are decoded whole at the end
                continue
            new_text = decode_new_text(self.tokenizer, seq, params.skip_special_tokens)
            last = i == len(step.new_token_ids) - 1
            core_stop = step.finish_reason == "stop" and last
            if not core_stop and params.stop_list and seq.num_output_tokens >= params.min_tokens:
                stop = find_stop_string(seq, len(new_text), params.stop_list, params.include_stop_str_in_output)
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    dropped = len(step.new_token_ids) - 1 - i
                    if step.finish_reason is None:   # the core still runs it
                        finishes.append(SeqFinish(report.request_id, step.seq_id, stop, dropped=dropped))
                    elif dropped:
                        finishes.append(SeqFinish(report.request_id, step.seq_id, dropped=dropped))
                    return
        if step.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = step.finish_reason, step.stop_reason

    def _logprobs(self, token: int, logprob: float, rank: int, top: Dict[int, float]) -> Dict[int, Logprob]:
        """A sample's log-probabilities as vLLM's Logprob entries, with rank and
        text: the sampled token first, then the top ones by rank."""
        decode = self.tokenizer.decode
        entries = {token: Logprob(logprob, rank, decode([token]))}
        for r, (other, value) in enumerate(top.items(), start=1):
            if other != token:
                entries[other] = Logprob(value, r, decode([other]))
        return entries

    # ------------------------------------------------------------ outputs
    def _output(self, report: CoreOutput, request: _Request, finished: bool) -> Optional[RequestOutput]:
        """The request's output: a delta per sequence when it streams deltas,
        else the whole result once finished (None before)."""
        params = report.params
        seqs = sorted(request.seqs.values(), key=lambda s: s.index)
        if not report.is_beam_search and params.best_of == params.n:
            outputs = [self._delta(report, s) for s in seqs]
        elif not finished:
            return None
        elif report.beams is not None:
            outputs = [self._beam_output(report, i, h) for i, h in enumerate(report.beams)]
        else:
            if params.best_of > params.n:
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)
            outputs = [self._delta(report, s, index=i) for i, s in enumerate(seqs[:params.n])]
        metrics = report.metrics
        if finished and metrics.finished_time is None:   # ended here, by a stop string
            metrics = dataclasses.replace(metrics, finished_time=time.time())
        return RequestOutput(report.request_id, report.prompt, report.prompt_token_ids, outputs, finished,
                             metrics, prompt_logprobs=self._prompt_logprobs(report.prompt_logprobs))

    def _prompt_logprobs(self, raw: Optional[list]) -> Optional[list]:
        if raw is None:
            return None
        decode = self.tokenizer.decode
        return [None if entries is None else {t: Logprob(lp, rank, decode([t])) for t, (lp, rank) in entries.items()}
                for entries in raw]

    @staticmethod
    def _error_output(report: CoreOutput, message: str, refused: bool) -> RequestOutput:
        """The final output of a request that ends with an error (finish reason
        ``abort``); ``refused``: it never ran (``RequestOutput.refused``)."""
        return RequestOutput(report.request_id, report.prompt, report.prompt_token_ids,
                             [CompletionOutput(0, "", [], finish_reason="abort")], True,
                             report.metrics, error=message, refused=refused)

    @staticmethod
    def _delta(report: CoreOutput, seq: SeqText, index: Optional[int] = None) -> CompletionOutput:
        """New tokens and text since the last delta. Text that might still turn
        into a stop string is held back until it cannot."""
        text = seq.output_text
        end = len(text)
        params = report.params
        if not seq.finished and params.stop_list and not params.include_stop_str_in_output:
            end = max(seq.num_sent_chars, end - (max(len(s) for s in params.stop_list) - 1))
        new_text = text[seq.num_sent_chars:end]
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_sent_tokens:]
        seq.num_sent_chars = end
        seq.num_sent_tokens = seq.num_output_tokens
        top = None if params.logprobs is None else (seq.logprobs[-len(new_ids):] if new_ids else [])
        return CompletionOutput(seq.index if index is None else index, new_text, new_ids,
                                seq.cumulative_logprob if report.wants_logprob else None, top,
                                seq.finish_reason, seq.stop_reason, seq.num_output_tokens)

    def _beam_output(self, report: CoreOutput, index: int, hyp) -> CompletionOutput:
        ids = hyp.token_ids[len(report.prompt_token_ids):]
        params = report.params
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        stop_ids = self.eos_token_ids | set(params.stop_token_ids)
        reason = "stop" if ids and ids[-1] in stop_ids and not params.ignore_eos else "length"
        return CompletionOutput(index, text, ids, hyp.cumulative_logprob, None, reason, None, len(ids))
