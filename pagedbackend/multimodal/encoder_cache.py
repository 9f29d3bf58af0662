"""Image embeddings kept by content hash, so that a second request with the
same image (or the next prefill chunk of a span) does not run the vision
tower again. Bounded in bytes, least recently used out first; an entry
larger than the whole budget is computed and not kept."""
from collections import OrderedDict
from typing import Optional

import torch


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Optional[torch.Tensor]:
        rows = self._entries.get(key)
        if rows is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return rows

    def put(self, key: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if key in self._entries or size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._entries[key] = rows
        self.bytes += size

    def __len__(self) -> int:
        return len(self._entries)
