"""One image of a prompt, after its processor: where its placeholder span
lies, which positions of the span take its embedding rows, its content hash
and the tensors its vision tower takes."""
import hashlib
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """An image of one prompt. ``offset``/``length``: its placeholder span in
    the prompt's token ids; ``embed_mask``: per position of the span, whether
    it takes the next embedding row (None: every position does; a family
    whose span interleaves text tokens, such as tile separators, sets it);
    ``data``: the processor's tensors of this image alone (``pixel_values``
    and the like), as the family's ``VisionEncoder`` takes them."""
    modality: str
    hash: str
    offset: int
    length: int
    embed_mask: Optional[Tuple[bool, ...]]
    data: Dict[str, torch.Tensor]

    @property
    def num_embeds(self) -> int:
        return self.length if self.embed_mask is None else sum(self.embed_mask)

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_hash(image) -> str:
    """The content hash of a decoded image (a PIL image): its mode, size and
    pixels, so that the same picture sent twice, however encoded, hashes alike."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def block_keys(items, block_size: int) -> Dict[int, bytes]:
    """The prefix cache's extra key per block index: each image's hash joins
    the block where its placeholder span starts; later blocks chain from it,
    so blocks after an image are told apart by the image too."""
    keys: Dict[int, bytes] = {}
    for item in items:
        index = item.offset // block_size
        keys[index] = keys.get(index, b"") + bytes.fromhex(item.hash)
    return keys
