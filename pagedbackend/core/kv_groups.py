"""KV groups: a model's layers grouped by attention kind, each group with a
block table of its own per sequence over one shared block pool.

A full-attention layer needs every position's K/V for as long as its sequence
lives; a layer with a sliding window of N needs only the last N. Layers of
one kind share block tables, so a windowed group can give back a block once
every position in it has left the window while a full-attention group keeps
it (vLLM v1's hybrid KV-cache manager does the same).

Pages stay uniform so that one pool serves every group: a block holds the
K/V of ``slots`` layers for ``block_size`` positions, and group ``g`` keeps
its layer ``layers[j]`` in slot ``j`` of the blocks it holds. ``slots`` is
the layer count of the smallest kind; the other kinds are split into groups
of that many layers (the last one possibly shorter: its blocks leave slots
unused). A model whose layers all attend alike has one group of every layer,
exactly the cache layout without groups.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class KVGroup:
    """Layers whose K/V share one block table per sequence."""
    window: Optional[int]      # sliding window in positions; None: full attention
    layers: Tuple[int, ...]    # model layers, layers[j] in cache slot j of the group's blocks


@dataclass(frozen=True)
class KVLayout:
    """The KV groups of a model and where each layer's K/V live."""
    groups: Tuple[KVGroup, ...]
    slots: int                      # layers per block (page)
    layer_group: Tuple[int, ...]    # per model layer: its group
    layer_slot: Tuple[int, ...]     # per model layer: its slot in a block

    @property
    def windows(self) -> List[Optional[int]]:
        """Each group's sliding window (None: full attention)."""
        return [g.window for g in self.groups]

    @property
    def frees_blocks(self) -> bool:
        """Whether some group gives blocks back as they leave its window."""
        return any(w is not None for w in self.windows)


def kv_layout(layer_windows: Sequence[Optional[int]], free_out_of_window: bool = True) -> KVLayout:
    """Group layers by sliding window (None: full attention), full attention
    first, then by window. ``free_out_of_window=False``: one group of every
    layer that keeps every block (windowed layers still attend to their
    window only; vLLM's ``disable_hybrid_kv_cache_manager``)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    for w in layer_windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"a sliding window must be a positive number of positions or None, got {w!r}")
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    if len(kinds) == 1 or not free_out_of_window:
        window = kinds[0] if len(kinds) == 1 and free_out_of_window else None
        layers = tuple(range(len(layer_windows)))
        return KVLayout((KVGroup(window, layers),), len(layers), (0,) * len(layers), layers)
    by_kind = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    slots = min(len(layers) for layers in by_kind.values())
    groups: List[KVGroup] = []
    for kind in kinds:
        layers = by_kind[kind]
        groups += [KVGroup(kind, tuple(layers[i:i + slots])) for i in range(0, len(layers), slots)]
    layer_group, layer_slot = [0] * len(layer_windows), [0] * len(layer_windows)
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            layer_group[layer], layer_slot[layer] = g, slot
    return KVLayout(tuple(groups), slots, tuple(layer_group), tuple(layer_slot))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def skipped_blocks(num_computed: int, window: Optional[int], block_size: int) -> int:
    """Leading blocks of a sequence that no query sees any more once
    ``num_computed`` positions are computed: the next query (at position
    ``num_computed``) sees keys from ``num_computed - window + 1`` on."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def blocks_held(num_tokens: int, window: Optional[int], block_size: int) -> int:
    """Blocks one group holds for a sequence of ``num_tokens`` computed positions."""
    return cdiv(num_tokens, block_size) - skipped_blocks(num_tokens, window, block_size)


def step_blocks(window: Optional[int], block_size: int, step_tokens: int) -> Optional[int]:
    """The most blocks a windowed group holds for one sequence during a step
    of at most ``step_tokens`` new positions: its window before the step and
    the step's own slots (None for full attention: no bound)."""
    if window is None:
        return None
    return cdiv(window - 1 + step_tokens, block_size) + 1
