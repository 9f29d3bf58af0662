"""What a step computes, as the scheduler hands it to the model runner and
the engine: one entry per sequence (``SeqEntry``, and the scheduler's
``ScheduledSeq`` which adds the request it belongs to), the step's batch and
block mappings (``SchedulerOutput``), and what sampling decided
(``StepUpdate``) for the scheduler to apply to the blocks; and what the
scheduler asks of the engine's features before each step (``SchedulerInputs``).
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .sequence import Sequence, SequenceGroup

BlockMapping = List[Tuple[int, int]]


@dataclass
class SeqEntry:
    """One sequence's share of a step, as the model runner reads it.

    ``token_ids``: tokens whose K/V are computed now, the first at position
    ``start_pos`` (the tokens before it are cached); ``block_table``: physical
    blocks covering at least ``start_pos + len(token_ids)`` positions. Logits
    come back for every row with ``prompt_logits``, else, with
    ``need_logits``, for the last ``1 + num_draft_tokens`` rows: the last
    verified token's and one per speculative token that ends ``token_ids``.
    ``block_tables``: every KV group's table, ``block_table`` (group 0's)
    first, for a model with several groups (``core.kv_groups``).
    ``lora``: the pages of the adapter its rows run with (``lora.manager.StepLoRA``;
    None: the base model). ``return_hidden``: every row's hidden state after
    the final norm comes back too (a pooling request's prefill).
    """
    token_ids: List[int]
    start_pos: int
    block_table: List[int]
    need_logits: bool = True
    prompt_logits: bool = False
    num_draft_tokens: int = 0
    block_tables: Optional[List[List[int]]] = None
    lora: Optional[object] = None
    return_hidden: bool = False
    token_type_start: Optional[int] = None   # an encoder's pair: where segment 1 starts
    mm_items: tuple = ()   # the prompt's images (multimodal.inputs.MultiModalItem), for worker.image_rows

    @property
    def num_logit_rows(self) -> int:
        if self.prompt_logits:
            return len(self.token_ids)
        return 1 + self.num_draft_tokens if self.need_logits else 0


@dataclass
class ScheduledSeq(SeqEntry):
    """A ``SeqEntry`` of the scheduler's batch, with its sequence.

    ``num_new_tokens`` verified tokens are computed, from
    ``seq.num_computed_tokens``; ``num_lookahead`` slots after them are held
    for speculative tokens, which the engine proposes into
    ``draft_token_ids`` (at most that many) before the forward pass."""
    group: SequenceGroup = None
    seq: Sequence = None
    num_new_tokens: int = 0
    num_lookahead: int = 0
    draft_token_ids: List[int] = field(default_factory=list)

    def set_drafts(self, draft_token_ids: List[int]) -> None:
        """Append proposed tokens (at most ``num_lookahead``) to the computed ones."""
        drafts = list(draft_token_ids)[:self.num_lookahead]
        self.token_ids = self.token_ids[:self.num_new_tokens] + drafts
        self.draft_token_ids = drafts
        self.num_draft_tokens = len(drafts)


@dataclass
class SchedulerOutput:
    scheduled: List[ScheduledSeq] = field(default_factory=list)
    copy_pairs: BlockMapping = field(default_factory=list)
    swap_out_pairs: BlockMapping = field(default_factory=list)
    swap_in_pairs: BlockMapping = field(default_factory=list)
    # The disk tier (core/tier_moves.py): blocks to copy out before anything
    # overwrites them (TierSave), and (block id, key) payloads to load into blocks.
    tier_saves: list = field(default_factory=list)
    tier_loads: List[Tuple[int, bytes]] = field(default_factory=list)
    preempted: List[SequenceGroup] = field(default_factory=list)
    rejected: List[Tuple[SequenceGroup, str]] = field(default_factory=list)
    num_batched_tokens: int = 0       # verified tokens plus the slots held for speculative ones

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepUpdate:
    """What sampling decided for the sequences of one step, for
    ``Scheduler.update_from_output``: new sequences that share a parent's
    blocks (parallel samples, beams), sequences that are done (their blocks go
    back), groups that are finished, and per sequence how many of the
    positions computed this step do not count as computed (a beam held while
    its siblings are recomputed: 1; speculative tokens that were rejected)."""
    forks: List[Tuple[Sequence, Sequence]] = field(default_factory=list)   # (parent, child)
    freed: List[Sequence] = field(default_factory=list)
    finished: List[SequenceGroup] = field(default_factory=list)
    uncomputed: Dict[int, int] = field(default_factory=dict)              # seq id -> positions


@dataclass(frozen=True)
class SchedulerInputs:
    """What the scheduler asks of the engine's features, given at
    construction; each is asked afresh before every step (None: the feature
    is off).

    - ``lookahead(num_decoding)``: speculative slots per decoding sequence for
      the coming step, given how many sequences decode (``spec_decode``);
    - ``prefill_caps(scheduler)``: prompt tokens each sequence computes in the
      coming step, by sequence id, when sized by time (``prefill_share.py``;
      None from it: the configured chunk; a sequence it does not name gets
      ``MIN_CHUNK``);
    - ``adapter_room(group, running)``: whether a group's adapter fits the
      adapter pool beside those of the running groups (``LoRAManager.fits``).
    """
    lookahead: Optional[Callable[[int], int]] = None
    prefill_caps: Optional[Callable[[object], Optional[Dict[int, int]]]] = None
    adapter_room: Optional[Callable[[SequenceGroup, List[SequenceGroup]], bool]] = None
