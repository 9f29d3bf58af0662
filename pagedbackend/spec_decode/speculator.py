"""Speculative decoding as the engine step meets it: how many tokens to propose in a
step, proposing them into the scheduled entries, and verifying them against
the target model's logits.

Verification. The target computes, in one forward pass, the sequence's last
token and its ``m`` drafts, which gives ``m + 1`` rows of logits; each row is
sampled exactly as a plain decode step would sample that position (the same
penalties over the tokens before it, the same min_tokens rule, the same
seeded noise, keyed by the output position; under a structured-output
constraint the grammar's mask at that position). Drafts are accepted while
they equal the token sampled at their position; the first sampled token that
differs (or the token after the last draft) is kept as well. As proposals are
deterministic, this is speculative rejection sampling with a one-point draft
distribution q: a draft x is kept with probability p(x) = min(1, p(x)/q(x)),
and otherwise the token comes from p without x, renormalised: the residual
(p - q)+. Outputs follow the target distribution exactly; greedy and seeded
requests give the very tokens of non-speculative decoding.

Adaptive rule. A step proposes nothing while more than
``disable_by_batch_size`` sequences decode (verifying costs compute that a
full batch does not have to spare; a draft model's rounds cost nearly as much
as a target step on a CPU, so its default limit is 2 streams, the lookups'
8). The n-gram and suffix proposers size each draft from its match (as many
tokens as the match is long, up to ``num_speculative_tokens``): copied text
gets a full draft at once, a chance match a short one. A draft model
proposes at most one token more than it had accepted at its previous
verification (at least one), so a sequence whose drafts keep failing costs
one extra position a step, and one whose drafts are accepted grows to the
limit.

Suffix speculation remembers finished requests' outputs per tenant
(``remember``): a question asked again is drafted from its earlier answer.
"""
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from ..config import EngineConfig, SpeculativeConfig
from ..core.scheduled import ScheduledSeq, SchedulerOutput, StepUpdate
from ..models.default_model import resolve_model_path
from .proposers import DraftModelProposer, NgramProposer, SuffixProposer, draft_runner


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters."""
    num_drafts: int = 0              # verifications with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: List[int] = field(default_factory=list)   # accepted at draft position i

    def copy_to(self, stats) -> None:
        """Into the engine's statistics (``EngineStats.spec_*``)."""
        stats.spec_num_drafts = self.num_drafts
        stats.spec_num_draft_tokens = self.num_draft_tokens
        stats.spec_num_accepted_tokens = self.num_accepted_tokens
        stats.spec_accepted_per_pos = list(self.accepted_per_pos)


def make_speculator(config: EngineConfig, target, compile_in_background: bool = False) -> Optional["Speculator"]:
    """The speculator ``config.speculative_config`` asks for (None: off); a
    draft model is loaded here, its KV cache mirroring ``target``'s blocks."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return Speculator(spec, NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
    if spec.method == "suffix":
        return Speculator(spec, SuffixProposer(spec))
    own = spec.method == "self_int4"
    quantization = "int4" if own else spec.quantization
    draft = dataclasses.replace(
        config, model=config.model if own else str(resolve_model_path(spec.model)), quantization=quantization,
        num_kv_blocks=target.num_kv_blocks, max_model_len=target.max_model_len, swap_space_blocks=0,
        linear_backend="auto" if quantization in ("int4", "w8a8") else config.linear_backend,
        speculative_config=None, enable_lora=False)   # drafts come from the base model
    return Speculator(spec, DraftModelProposer(draft_runner(draft, target, compile_in_background)))


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer):
        self.config, self.proposer = config, proposer
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._next: Dict[int, int] = {}   # per sequence: tokens to propose next time

    def lookahead(self, num_decoding: int) -> int:
        """Speculative slots per decoding sequence for the coming step."""
        limit = self.config.disable_by_batch_size
        if limit and num_decoding > limit:
            return 0
        return self.config.num_speculative_tokens

    def propose(self, scheduled: Sequence[ScheduledSeq]) -> None:
        """Fill the drafts of every entry that holds speculative slots."""
        requests, own_size = [], getattr(self.proposer, "sizes_drafts", False)
        for item in scheduled:
            if item.num_lookahead and not item.seq.finished:
                wanted = self.config.num_speculative_tokens if own_size else \
                    self._next.get(item.seq.seq_id, self.config.num_speculative_tokens)
                requests.append((item, min(item.num_lookahead, wanted)))
        if not requests:
            return
        for (item, _), drafts in zip(requests, self.proposer.propose(requests)):
            item.set_drafts(drafts)

    def accept(self, item: ScheduledSeq, sampled: List[int]) -> int:
        """How many of ``item``'s drafts are kept, given the token sampled at
        each of its positions (one more than there are drafts)."""
        drafts = item.draft_token_ids
        accepted, limit = 0, min(len(drafts), len(sampled) - 1)   # a grammar may verify fewer
        while accepted < limit and sampled[accepted] == drafts[accepted]:
            accepted += 1
        if drafts:
            st = self.stats
            st.num_drafts += 1
            st.num_draft_tokens += len(drafts)
            st.num_accepted_tokens += accepted
            for i in range(accepted):
                st.accepted_per_pos[i] += 1
            self.proposer.accepted(item, accepted)
        if not getattr(self.proposer, "sizes_drafts", False):
            self._next[item.seq.seq_id] = max(1, min(self.config.num_speculative_tokens, accepted + 1))
        return accepted

    def sample_rows(self, item: ScheduledSeq, row: int, sample_row) -> list:
        """One sample row per position of a speculative entry (its first at
        ``row`` of the step's logits), each sampled as a plain decode step
        would sample that position: ``sample_row(group, seq, row, index,
        tokens ahead, mask)``. Under a grammar, drafts the grammar refuses are
        not verified."""
        seq, drafts = item.seq, item.draft_token_ids
        masks = seq.constraint.draft_masks(drafts) if seq.constraint is not None else None
        positions = len(masks) if masks is not None else len(drafts) + 1
        return [sample_row(item.group, seq, row + j, seq.index, drafts[:j], masks[j] if masks is not None else None)
                for j in range(positions)]

    def verify(self, item: ScheduledSeq, samples, update: StepUpdate, apply_samples) -> Callable[[], None]:
        """Verify ``item``'s drafts against the samples of its positions: the
        positions of rejected drafts go back (``update.uncomputed``); returns
        the work that applies the kept tokens one after another with
        ``apply_samples(group, seq, [sample], update)`` (a stop inside the run
        ends it there)."""
        seq = item.seq
        accepted = self.accept(item, [s.token_id for s in samples])
        update.uncomputed[seq.seq_id] = item.num_draft_tokens - accepted

        def apply_kept() -> None:
            for sample in samples[:accepted + 1]:
                apply_samples(item.group, seq, [sample], update)
                if seq.finished:
                    return
        return apply_kept

    def withdraw(self, item: ScheduledSeq) -> None:
        """An entry that was not sampled in its step (its grammar's mask was
        not ready): none of its drafts stand, and nothing is counted."""
        self.proposer.accepted(item, 0)

    # ------------------------------------------------------------ the engine step's hooks
    def before_forward(self, sched: SchedulerOutput, stats) -> None:
        """After scheduling: a draft model's blocks follow the target's copies,
        and drafts are proposed into the scheduled entries (timed into
        ``stats.propose_seconds``)."""
        if sched.copy_pairs:
            self.proposer.copy_blocks(sched.copy_pairs)
        if sched.scheduled:
            start = time.perf_counter()
            self.propose(sched.scheduled)
            stats.propose_seconds += time.perf_counter() - start

    def after_step(self, finished_groups, gone_seqs) -> None:
        """Requests that finished (a proposer may draft from earlier answers)
        and sequences that are gone (what was kept for them is forgotten)."""
        remember = getattr(self.proposer, "remember", None)
        if remember is not None:
            for group in finished_groups:
                remember(group)
        for seq in gone_seqs:
            self._next.pop(seq.seq_id, None)
            self.proposer.release(seq.seq_id)
