"""What a request needs of the KV pool and of a step's sequence slots: the
admission check (nothing that can never run is queued), the default
``max_tokens``, and the sizes the fairness rules compare (``Scheduler``).
Pure arithmetic over the configuration and the block manager's pool size.
"""
from typing import Optional

from ..config import EngineConfig
from .block_manager import BlockManager
from .kv_memory import reserved_positions
from .sequence import SequenceGroup


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Capacity:
    def __init__(self, config: EngineConfig, bm: BlockManager, max_model_len: int):
        self.config, self.bm, self.max_model_len = config, bm, max_model_len

    @property
    def usable_blocks(self) -> int:
        return self.bm.num_total_blocks - self.bm.watermark_blocks

    def reserve_tokens(self, final_len: int) -> int:
        """Positions a contiguous-reservation baseline (``kv_reservation``)
        holds for a request from admission on; 0 when paged."""
        scheme = self.config.kv_reservation
        return 0 if scheme == "paged" else reserved_positions(scheme, final_len, self.max_model_len)

    def max_blocks(self, prompt_len: int, max_tokens: int, width: int) -> int:
        """KV blocks a request needs, alone in the pool, to finish: its prompt's
        blocks (shared by every candidate) plus each candidate's blocks for its
        output, one more each for a copied partial block; in every KV group,
        a windowed one holding at most its window and a step per candidate."""
        bs = self.bm.block_size
        paged = cdiv(prompt_len, bs) + width * (cdiv(max_tokens, bs) + 1)
        paged = sum(paged if bound is None else min(paged, width * bound) for bound in self.bm.group_step_blocks())
        return max(paged, cdiv(self.reserve_tokens(prompt_len + max_tokens), bs))

    def max_tokens_that_fit(self, prompt_len: int, width: int, limit: int) -> int:
        """The most tokens (at most ``limit``) each of ``width`` candidates may
        generate after a ``prompt_len`` prompt with the whole request still
        fitting the pool alone: the default ``max_tokens`` of a request that
        sets none (0 when not even one token fits)."""
        low, high = 0, limit
        while low < high:   # max_blocks grows with max_tokens
            mid = (low + high + 1) // 2
            if self.max_blocks(prompt_len, mid, width) <= self.usable_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def admission_error(self, prompt_len: int, max_tokens: int, width: int) -> Optional[str]:
        """Why a request can never run, or None: the one admission check, used
        at submission (so nothing that cannot run is ever queued)."""
        if width > self.config.max_num_seqs:
            return (f"the request needs {width} sequences at once (n / best_of) but "
                    f"max_num_seqs is {self.config.max_num_seqs}")
        need = self.max_blocks(prompt_len, max_tokens, width)
        if need > self.usable_blocks:
            return (f"request needs up to {need} KV blocks (prompt {prompt_len} tokens, "
                    f"max_tokens {max_tokens}, {width} candidate(s), block size "
                    f"{self.bm.block_size}) but the pool offers {self.usable_blocks}")
        return None

    @staticmethod
    def max_live_seqs(group: SequenceGroup) -> int:
        return len(group.seqs) if group.forked else group.params.best_of

    @property
    def share(self) -> int:
        """Sequences one request may decode per step while others are present."""
        return max(1, self.config.max_num_seqs // 2)

    def step_slots(self, group: SequenceGroup) -> int:
        """Sequence slots a group takes per step when others share the steps."""
        width = self.max_live_seqs(group)
        return width if group.is_beam_search else min(width, self.share)

    def eventual_blocks(self, group: SequenceGroup) -> int:
        return self.max_blocks(len(group.prompt_token_ids), group.max_tokens, group.params.best_of)
