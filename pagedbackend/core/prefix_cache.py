"""Hash chain over full KV blocks for automatic prefix caching.

A full block is identified by ``hash(parent block's hash, its token ids, extra
keys)``, so equal hashes mean equal whole prefixes, not just equal blocks.
SHA-256 keeps collisions out of reach; the block pool compares content on every
hit anyway, so even a colliding hash function could only cost hits, never
return wrong K/V.
"""
import hashlib
from array import array
from typing import Callable, List, Optional, Sequence

HashFn = Callable[[Optional[bytes], Sequence[int], bytes], bytes]


def hash_block(parent_hash: Optional[bytes], token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    h = hashlib.sha256()
    h.update(parent_hash or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_key)
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"",
                 hash_fn: HashFn = hash_block, start: int = 0,
                 parent_hash: Optional[bytes] = None, limit: Optional[int] = None) -> List[bytes]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on,
    chained from ``parent_hash`` (the hash of block ``start - 1``)."""
    n_full = len(token_ids) // block_size
    if limit is not None:
        n_full = min(n_full, limit)
    hashes = []
    for i in range(start, n_full):
        parent_hash = hash_fn(parent_hash, token_ids[i * block_size:(i + 1) * block_size], extra_key)
        hashes.append(parent_hash)
    return hashes
