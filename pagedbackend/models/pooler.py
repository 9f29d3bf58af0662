"""Poolers: one vector per prompt from its hidden states after the final norm.

LAST takes the last token's (decoders trained for embeddings: Qwen3-Embedding,
e5-mistral), CLS the first token's, MEAN the average over every prompt token.
A prompt may arrive in several chunks (chunked prefill): the accumulator
takes each chunk's rows in order and keeps only what its pooler needs (one
row, or a running sum), so memory does not grow with the prompt.
"""
from typing import Optional

import torch

from ..pooling_params import POOLING_TYPES


class PoolAccumulator:
    """The pooled state of one prompt, fed chunk by chunk."""

    def __init__(self, pooling_type: str):
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"unknown pooling type {pooling_type!r}; known: {', '.join(POOLING_TYPES)}")
        self.pooling_type = pooling_type
        self.value: Optional[torch.Tensor] = None   # float32 [hidden]
        self.num_tokens = 0                         # rows taken so far

    def add(self, rows: torch.Tensor, start_pos: int) -> None:
        """Take the hidden states ``rows`` [n, hidden] of positions
        ``start_pos`` .. ``start_pos + n - 1``; chunks arrive in order. LAST
        may start past a cached prefix; MEAN and CLS need every position."""
        if self.pooling_type != "LAST" and start_pos != self.num_tokens:
            raise ValueError(f"chunk starts at position {start_pos}, but {self.num_tokens} positions were pooled "
                             f"(every position must be computed, none taken from a cache)")
        rows = rows.float()
        if self.pooling_type == "LAST":
            self.value = rows[-1].clone()
        elif self.pooling_type == "CLS":
            if start_pos == 0:
                self.value = rows[0].clone()
        else:
            total = rows.sum(dim=0)
            self.value = total if self.value is None else self.value + total
        self.num_tokens = start_pos + rows.shape[0]

    def result(self, dimensions: Optional[int] = None, normalize: bool = True) -> torch.Tensor:
        """The pooled vector: the mean taken, cut to ``dimensions`` (Matryoshka),
        then L2-normalised when ``normalize``."""
        if self.value is None:
            raise ValueError("nothing was pooled")
        vector = self.value / self.num_tokens if self.pooling_type == "MEAN" else self.value
        if dimensions is not None:
            vector = vector[:dimensions]
        if normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        return vector
