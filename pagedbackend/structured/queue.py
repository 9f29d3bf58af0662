"""The engine's entry into structured outputs: the grammar compiler and the
grammar workers it holds, and the requests whose grammar still compiles,
held back from the scheduler until it is done (``take_compiled``, before
each engine step schedules), and the grammars' masks readied before the
forward pass (``before_forward``)."""
from typing import List, Sequence, Tuple

from ..config import EngineConfig
from ..core.scheduled import ScheduledSeq
from ..core.sequence import SequenceGroup
from .compiler import GrammarCompiler
from .grammar_worker import GrammarBudget, GrammarWorkers

FIRST_COMPILE_WAIT_S = 0.05   # with nothing else to run, how long a step waits for a compile
GRAMMAR_WAIT_S = 0.02   # a step that would sample nothing waits this long for a grammar's mask


class StructuredQueue:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, eos_token_ids):
        self.config = config
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids, config.structured_cache_bytes)
        self.workers = GrammarWorkers(vocab_size)
        self.compiling: List[SequenceGroup] = []   # in arrival order

    def add(self, group: SequenceGroup) -> None:
        """Hold a constrained request until its grammar (``group.grammar``) has compiled."""
        self.compiling.append(group)

    def remove(self, group: SequenceGroup) -> None:
        if group in self.compiling:
            self.compiling.remove(group)

    def take_compiled(self, idle: bool) -> Tuple[List[SequenceGroup], List[Tuple[SequenceGroup, str]]]:
        """The held requests whose grammar has compiled, each sequence with its
        grammar state (its first mask filled on a worker), and those whose
        grammar was refused, with the reason. ``idle``: nothing else runs, so
        wait a little for the first compile rather than spin."""
        if not self.compiling:
            return [], []
        if idle and not self.compiling[0].grammar.done():
            self.compiling[0].grammar.wait(FIRST_COMPILE_WAIT_S)
        ready, refused, waiting = [], [], []
        cfg = self.config
        for group in self.compiling:
            grammar = group.grammar
            if not grammar.done():
                waiting.append(group)
                continue
            if grammar.error() is not None:
                refused.append((group, str(grammar.error())))
                continue
            group.metrics.grammar_compile_time = grammar.seconds
            budget = GrammarBudget(grammar.label, cfg.structured_mask_token_s, cfg.structured_mask_total_s)
            group.seqs[0].constraint = self.workers.start(grammar.matcher, budget, self.grammars.stop_token_ids)
            ready.append(group)
        self.compiling[:] = waiting   # in place: the engine reads it (statistics)
        return ready, refused

    @staticmethod
    def before_forward(scheduled: Sequence[ScheduledSeq]) -> None:
        """Before the forward pass: masks of speculative positions are filled
        beside it. When every entry to sample waits for its grammar's mask,
        wait a little for one rather than run a step that samples nothing."""
        waiting = 0
        for item in scheduled:
            state = item.seq.constraint
            if state is not None and item.need_logits:
                state.prepare_drafts(item.draft_token_ids)
                waiting += not state.ready()
        if waiting and waiting == len(scheduled):
            next(i.seq.constraint for i in scheduled if not i.seq.constraint.ready()).wait(GRAMMAR_WAIT_S)
