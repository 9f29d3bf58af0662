"""Beam search over a group's sequences: one step scores every live beam's
next token (``sample/beam_search.BeamSearchState`` picks the continuations),
then re-parents the sequences to match. A beam chosen twice is forked (the
child shares its parent's blocks), one not chosen is freed; the block
changes go to the scheduler in the step's ``StepUpdate``."""
from typing import List, Optional, Set, Tuple

import torch

from ..core.scheduler import StepUpdate
from ..core.sequence import Sequence, SequenceGroup


def beam_step(group: SequenceGroup, seq_rows: List[Tuple[Sequence, int]], logits: torch.Tensor,
              eos_token_ids: Set[int], update: StepUpdate) -> Optional[bool]:
    """Advance ``group``'s beams by one token; ``seq_rows`` pairs each beam
    computed this step with its row of ``logits``. Returns None when some
    beams are still being recomputed (nothing advances), True when the search
    is done (every live beam freed, ``group.seqs`` empty), else False."""
    live = group.seqs
    if len(seq_rows) < len(live):
        # Some beams are still being recomputed after a preemption: hold the
        # ones that are done by recomputing their last token next step.
        update.uncomputed.update((seq.seq_id, 1) for seq, _ in seq_rows)
        return None
    row_of = {seq.seq_id: row for seq, row in seq_rows}
    rows = [row_of[s.seq_id] for s in live]
    params = group.params
    beam_logits = logits[rows]
    if live[0].num_output_tokens < params.min_tokens:
        beam_logits[:, sorted(eos_token_ids | set(params.stop_token_ids))] = float("-inf")
    logprobs = torch.log_softmax(beam_logits, dim=-1)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
    result = group.beam.step([s.token_ids for s in live], [s.cumulative_logprob for s in live],
                             logprobs, live[0].num_output_tokens, group.max_tokens, stop_ids)
    if result.done:
        update.freed.extend(live)
        group.seqs = []
        return True
    group.seqs = _reparent(live, result.continuations, update)
    return False


def _reparent(live: List[Sequence], continuations, update: StepUpdate) -> List[Sequence]:
    """The next beams, one per ``(parent index, token, score)`` continuation,
    each with its token appended and its score set."""
    used = set()
    next_beams = []
    for parent_idx, _, _ in continuations:
        parent = live[parent_idx]
        if parent.seq_id in used:
            child = parent.fork(len(next_beams))
            update.forks.append((parent, child))
            next_beams.append(child)
        else:
            used.add(parent.seq_id)
            next_beams.append(parent)
    update.freed.extend(seq for seq in live if seq.seq_id not in used)
    for seq, (_, token, score) in zip(next_beams, continuations):
        seq.token_ids.append(token)
        seq.cumulative_logprob = score
    return next_beams
