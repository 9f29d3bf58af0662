"""The embedding rows of images inside one step: for each entry whose new
tokens cover part of an image's placeholder span, the image's embeddings
(from the encoder cache, or its vision encoder now) at the flat batch's
rows of those placeholders. A span may reach over several prefill chunks:
each chunk takes the rows of its own positions."""
from typing import List, Optional, Sequence, Tuple

import torch

from pagedbackend.core.scheduled import SeqEntry
from pagedbackend.multimodal.encoder_cache import EncoderCache


class ImageRows:
    def __init__(self, vision, cache_bytes: int, device: torch.device):
        self.vision = vision
        self.cache = EncoderCache(cache_bytes)
        self.device = device
        self.encoded_images = 0   # vision encoder runs (a cached image costs none)

    def embeddings(self, item) -> torch.Tensor:
        """The image's rows ``[num_embeds, hidden]``, from the cache or computed now."""
        rows = self.cache.get(item.hash)
        if rows is None:
            data = {name: t.to(self.device) for name, t in item.data.items()}
            rows = self.vision(data)
            if rows.shape[0] != item.num_embeds:
                raise ValueError(f"the vision encoder gave {rows.shape[0]} rows for an image with "
                                 f"{item.num_embeds} placeholders")
            self.encoded_images += 1
            self.cache.put(item.hash, rows)
        return rows

    def rows(self, entries: Sequence[SeqEntry]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(flat batch rows, their embeddings)`` of the step's image
        placeholders; None when the step computes none."""
        index: List[int] = []
        parts: List[torch.Tensor] = []
        row = 0
        for entry in entries:
            lo, hi = entry.start_pos, entry.start_pos + len(entry.token_ids)
            for item in entry.mm_items:
                a, b = max(lo, item.offset), min(hi, item.end)
                if a >= b:
                    continue
                mask = item.embed_mask
                if mask is None:
                    positions, first = list(range(a, b)), a - item.offset
                    picked = slice(first, first + len(positions))
                else:
                    positions = [p for p in range(a, b) if mask[p - item.offset]]
                    first = sum(mask[:a - item.offset])
                    picked = slice(first, first + len(positions))
                if not positions:
                    continue
                index.extend(row + p - lo for p in positions)
                parts.append(self.embeddings(item)[picked])
            row += len(entry.token_ids)
        if not index:
            return None
        return torch.tensor(index, dtype=torch.long, device=self.device), torch.cat(parts)
