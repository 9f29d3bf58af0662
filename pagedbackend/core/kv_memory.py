"""KV-cache memory arithmetic shared by the cache's sizing (worker), the
contiguous-reservation baselines (scheduler) and the accounting tool.

Reservation schemes (the paper's Orca baselines, Sec. 6.1, and paged
allocation; lengths are final sequence lengths, prompt + output):

- ``max``    Orca (Max): every request reserves ``max_len`` positions.
- ``pow2``   Orca (Pow2): the next power of two of its final length, capped at
             ``max_len``.
- ``oracle`` Orca (Oracle): exactly its final length (knows the future).
- ``paged``  PagedAttention: ``ceil(length / block_size) * block_size``.
"""
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

from .kv_groups import blocks_held, kv_layout

SCHEMES = ("max", "pow2", "oracle", "paged")


@dataclass(frozen=True)
class KVModel:
    """The model dimensions that size one token's K and V state;
    ``layer_windows``: each layer's sliding window (None: full attention),
    empty when no layer has one; ``scale_bytes``: bytes beside each head's
    row of one token (an int8 cache's float16 scales, ``kv_cache_dtype``)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    layer_windows: Tuple[Optional[int], ...] = ()
    scale_bytes: int = 0

    @property
    def row_bytes(self) -> int:
        """One token's one KV head of K (or V): its values and their scale."""
        return self.head_dim * self.dtype_bytes + self.scale_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head.
        return 2 * self.layers * self.kv_heads * self.row_bytes

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def windowed_blocks(self, length: int, block_size: int) -> int:
        """Blocks one sequence of ``length`` computed positions holds when its
        windowed layers' blocks go back to the pool as they leave the window,
        summed over the KV groups (``core.kv_groups``; each block holds one
        group's layers)."""
        layout = kv_layout(self.layer_windows or [None] * self.layers)
        return sum(blocks_held(length, g.window, block_size) for g in layout.groups)

    def windowed_block_bytes(self, block_size: int) -> int:
        """Bytes of one block when the layers are in KV groups: K and V of one group's layers."""
        layout = kv_layout(self.layer_windows or [None] * self.layers)
        return 2 * layout.slots * self.kv_heads * self.row_bytes * block_size


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def check_block_size(block_size) -> None:
    check_positive_int("block size", block_size)
    if block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two, got {block_size}")


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def reserved_positions(scheme: str, length: int, max_len: int,
                       block_size: Optional[int] = None) -> int:
    """Positions ``scheme`` reserves for one sequence of final ``length``."""
    check_positive_int("max_len", max_len)
    check_positive_int("length", length)
    if length > max_len:
        raise ValueError(f"length {length} exceeds max_len {max_len}")
    if scheme == "max":
        return max_len
    if scheme == "pow2":
        return min(next_power_of_two(length), max_len)
    if scheme == "oracle":
        return length
    if scheme == "paged":
        if block_size is None:
            raise ValueError("the paged scheme needs a block_size")
        check_block_size(block_size)
        return math.ceil(length / block_size) * block_size
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
