"""Grammar work off the engine step: each constrained sequence's matcher
accepts the sampled tokens and fills its next token mask on worker threads
while the step goes on. A sequence whose mask is not ready when its logits
are is not sampled in that step (its last token is computed again in the
next), so a slow grammar delays only its own request. xgrammar releases the
GIL in its matcher calls, so the work runs beside the forward pass.

The work of some grammars grows with every token (an ambiguous grammar of
nested repetitions, ``root ::= (((("a")*)*)*)*``: its Earley parser keeps
more states after each token, and at 500 levels one token's mask took 0.5 s
by the seventh token and 14 s by the tenth). So each request has a budget of
mask time (``GrammarBudget``): one xgrammar call (accepting a token, filling
a mask) may take at most ``token_s``, all of them ``total_s``; past either
the request ends with an error naming its grammar, alone. A call cannot be
interrupted: its thread finishes it and the result is dropped.
"""
import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, List, Optional, Sequence

import torch

from pagedbackend.errors import GRAMMAR_DEAD_END, InvalidRequestError

WORKERS = 4   # threads; one held by an overrunning call leaves the others serving


class GrammarBudgetError(RuntimeError):
    """A request's grammar took more mask time than its budget allows."""


class GrammarBudget:
    """A request's mask time, shared by its sequences; ``label`` names its grammar."""

    def __init__(self, label: str, token_s: float, total_s: float):
        self.label, self.token_s, self.total_s = label, token_s, total_s
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def over(self, running_s: float = 0.0) -> Optional[str]:
        """Why the budget is spent (a call running for ``running_s`` counted), or None."""
        if running_s > self.token_s:
            return (f"one token's grammar work took more than {self.token_s:g} s (engine setting "
                    f"structured_mask_token_s)")
        if self.seconds + running_s > self.total_s:
            return (f"the grammar's token masks took more than {self.total_s:g} s in all (engine setting "
                    f"structured_mask_total_s)")
        return None

    def error(self, why: str) -> GrammarBudgetError:
        return GrammarBudgetError(f"structured_outputs: {why}; the request was ended. Grammar: {self.label}")


class FixedMask:
    """A row's allowed tokens, filled ahead of time: the grammar's mask at a
    speculative position, which the matcher reaches only by accepting the
    drafts before it. Fills a bitmask row as a matcher does."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.mask


class GrammarWorkers:
    """The threads that run every sequence's grammar work."""

    def __init__(self, vocab_size: int, threads: int = WORKERS):
        self.vocab_size = vocab_size
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="pagedbackend-grammar-mask")

    def start(self, make_matcher: Callable, budget: GrammarBudget,
              stop_token_ids: Iterable[int]) -> "GrammarState":
        """A sequence's grammar state; its matcher is made and its first mask
        filled on a worker."""
        state = GrammarState(self, budget, stop_token_ids)
        state._queue(("start", make_matcher))
        return state

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One sequence's matcher and the mask of its next position. Work is
    queued (``advance``, ``prepare_drafts``) and runs in order on a worker;
    the state is ``ready`` once the mask is filled for the last token given."""

    def __init__(self, workers: GrammarWorkers, budget: GrammarBudget, stop_token_ids: Iterable[int]):
        self._workers, self.budget = workers, budget
        self.stop_token_ids = frozenset(stop_token_ids)
        self.matcher = None
        self.mask = torch.empty((1, (workers.vocab_size + 31) // 32), dtype=torch.int32)
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._ops: "collections.deque" = collections.deque()
        self._running = False
        self._started: Optional[float] = None   # when the call running now began
        self._advancing = 0                     # queued or running ops that change the mask
        self._error: Optional[BaseException] = None
        self._closed = False
        self._drafts = None                     # (drafts, [FixedMask per position]) once filled

    # ------------------------------------------------------------ engine side
    def ready(self) -> bool:
        """The mask of the next position is filled (and nothing failed)."""
        with self._lock:
            return self._advancing == 0 and self._error is None

    def wait(self, timeout: float) -> None:
        """Wait until no work is queued or running, at most ``timeout`` seconds."""
        self._idle.wait(timeout)

    def check(self) -> None:
        """Raise what ended this sequence's grammar: a call that failed (a
        token outside the mask) or a spent budget."""
        with self._lock:
            error, started = self._error, self._started
        if error is not None:
            raise error
        why = self.budget.over(time.monotonic() - started if started is not None else 0.0)
        if why is not None:
            raise self.budget.error(why)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The sampler's view: copy the ready mask into ``bitmask[row]``."""
        bitmask[row] = self.mask[0]

    def ends_with(self, token_id: int) -> bool:
        """Whether sampling ``token_id`` ends the output: the grammar allows a
        stop token only where it is complete, and accepting one terminates it."""
        return token_id in self.stop_token_ids

    def advance(self, token_id: int) -> None:
        """Accept a sampled token, then fill the next mask (on a worker)."""
        self._queue(("accept", token_id))

    def prepare_drafts(self, drafts: Sequence[int]) -> None:
        """Fill the masks of speculative positions (``draft_masks``) on a
        worker, beside the forward pass; nothing when the state is not ready."""
        if drafts and self.ready():
            self._queue(("drafts", list(drafts)))

    def draft_masks(self, drafts: Sequence[int]) -> List[object]:
        """Masks of a speculative entry's positions: this one, then after each
        draft the grammar accepts, as far as filled for these drafts (position
        0 alone when the drafts' masks are not filled yet). Call when ready."""
        prepared = self._drafts
        if prepared is None:
            return [self]
        masks = [self]
        for j, fixed in enumerate(prepared[1][1:], start=1):
            if list(prepared[0][:j]) != list(drafts[:j]):
                break
            masks.append(fixed)
        return masks

    def fork(self) -> "GrammarState":
        """A copy for a parallel sample (the state must be ready); same budget."""
        child = GrammarState(self._workers, self.budget, self.stop_token_ids)
        child.matcher = self.matcher.fork()
        child.mask = self.mask.clone()
        return child

    def close(self) -> None:
        """Drop queued work: the sequence is finished or gone."""
        with self._lock:
            self._closed = True
            self._ops.clear()
            self._advancing = 0

    # ------------------------------------------------------------ worker side
    def _queue(self, op: tuple) -> None:
        with self._lock:
            if self._closed:
                return
            self._ops.append(op)
            if op[0] != "drafts":
                self._advancing += 1
                self._drafts = None
            if self._running:
                return
            self._running = True
            self._idle.clear()
        self._workers.pool.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if self._closed or self._error is not None or not self._ops:
                    self._running = False
                    self._idle.set()
                    return
                op = self._ops.popleft()
                self._started = started = time.monotonic()
            error = None
            try:
                self._run(op)
            except Exception as exc:
                error = exc
            elapsed = time.monotonic() - started
            self.budget.add(elapsed)
            why = self.budget.over(elapsed)
            with self._lock:
                self._started = None
                if op[0] != "drafts" and self._advancing:
                    self._advancing -= 1
                if error is None and why is not None:
                    error = self.budget.error(why)
                if error is not None and self._error is None:
                    self._error = error

    def _run(self, op: tuple) -> None:
        kind = op[0]
        if kind == "start":
            self.matcher = op[1]()
            self._fill_next(self.mask)
        elif kind == "accept":
            if not self.matcher.accept_token(op[1]):
                raise RuntimeError(f"token {op[1]} was sampled outside the structured-output grammar's mask")
            if not self.matcher.is_terminated() and not self._more_accepts():
                self._fill_next(self.mask)
        else:
            self._drafts = self._fill_drafts(op[1])

    def _more_accepts(self) -> bool:
        """Another token is queued already: its accept fills the mask instead."""
        with self._lock:
            return any(queued[0] == "accept" for queued in self._ops)

    def _fill(self, mask: torch.Tensor, row: int = 0) -> None:
        self.matcher.fill_next_token_bitmask(mask, row)

    def _fill_next(self, mask: torch.Tensor) -> None:
        """The next position's mask; one that allows no token (the grammar needs
        text that no token of the vocabulary continues, such as a character
        the tokenizer cannot write) ends the request as its own fault."""
        self._fill(mask)
        if not bool(mask[0].any()):
            raise InvalidRequestError(f"{GRAMMAR_DEAD_END}: no token of the model's vocabulary continues the "
                                      "grammar here (it needs text this tokenizer cannot write)")

    def _fill_drafts(self, drafts: List[int]):
        """The masks after each draft the grammar accepts, up to the first it
        refuses or a stop token; the matcher ends as it began."""
        masks = torch.empty((len(drafts) + 1, self.mask.shape[1]), dtype=torch.int32)
        masks[0] = self.mask[0]
        filled = steps = 0
        try:
            for token in drafts:
                if not self.matcher.accept_token(token):
                    break
                steps += 1
                if self.matcher.is_terminated():
                    break
                filled += 1
                self._fill(masks, filled)
        finally:
            if steps:
                self.matcher.rollback(steps)
        return drafts, [FixedMask(masks[i]) for i in range(filled + 1)]
