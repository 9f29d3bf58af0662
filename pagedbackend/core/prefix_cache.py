"""Hash chain over full KV blocks for automatic prefix caching.

A full block is identified by ``hash(parent block's hash, its token ids, extra
keys)``, so equal hashes mean equal whole prefixes, not just equal blocks.
SHA-256 keeps collisions out of reach; the block pool compares content on every
hit anyway, so even a colliding hash function could only cost hits, never
return wrong K/V.
"""
import hashlib
from array import array
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence

HashFn = Callable[[Optional[bytes], Sequence[int], bytes], bytes]


def hash_block(parent_hash: Optional[bytes], token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    h = hashlib.sha256()
    h.update(parent_hash or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_key)
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"",
                 hash_fn: HashFn = hash_block, start: int = 0,
                 parent_hash: Optional[bytes] = None, limit: Optional[int] = None,
                 block_keys: Optional[Mapping[int, bytes]] = None) -> List[bytes]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on,
    chained from ``parent_hash`` (the hash of block ``start - 1``).
    ``block_keys``: more extra key for some block indexes (the content hash
    of an image whose placeholders start there: ``multimodal.inputs.block_keys``)."""
    n_full = len(token_ids) // block_size
    if limit is not None:
        n_full = min(n_full, limit)
    hashes = []
    for i in range(start, n_full):
        key = extra_key + block_keys[i] if block_keys and i in block_keys else extra_key
        parent_hash = hash_fn(parent_hash, token_ids[i * block_size:(i + 1) * block_size], key)
        hashes.append(parent_hash)
    return hashes


@dataclass
class CachedPrefix:
    """A prompt's cached prefix: ``blocks`` whole blocks, their ``hashes``,
    and per KV group the cached blocks it maps (from the group's first
    needed one: a windowed group needs only those in the window)."""
    blocks: int
    hashes: List[bytes]
    mapped: List[list]

    @property
    def revived(self) -> int:
        """Cached blocks that are free now: mapping them takes them from the free queue."""
        return sum(1 for blocks in self.mapped for b in blocks if b.ref_cnt == 0)


def longest_cached_prefix(managers: Sequence, hashes: Sequence[bytes], token_ids: Sequence[int],
                          block_size: int) -> CachedPrefix:
    """The longest prefix of ``hashes``' blocks that every KV group's manager
    (``core.group_manager``) can take from the cache: a full-attention group
    needs every block of it, a windowed group those in the window of the
    first uncomputed position. Any prefix of a full group's hit is a hit, a
    windowed group's is not, so the windowed groups search again until all
    agree (as vLLM's hybrid coordinator does)."""
    hit = len(hashes)
    windowed = [m for m in managers if m.window is not None]
    for manager in managers:
        if manager.window is None:
            hit = manager.longest_hit(hashes, token_ids, hit)
    changed = bool(windowed)
    while changed and hit:
        changed = False
        for manager in windowed:
            shorter = manager.longest_hit(hashes, token_ids, hit)
            changed, hit = changed or shorter < hit, shorter
    mapped = [[m.lookup(hashes, token_ids, i) for i in range(m.first_needed(hit * block_size), hit)]
              for m in managers]
    return CachedPrefix(hit, list(hashes[:hit]), mapped)
