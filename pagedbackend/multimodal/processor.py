"""A prompt with images to token ids and image items, by the model folder's
own processor (transformers' ``AutoProcessor``: resize, crop or split, and
placeholder expansion), so the ids are exactly those the family's Hugging
Face model takes. Runs in the calling thread (any but the engine's: the
Triton model hands image requests to a worker pool); one call at a time
per processor, since a fast tokenizer may not be shared between threads."""
import logging
import pathlib
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import InvalidRequestError
from .inputs import MultiModalItem, image_hash

DEFAULT_IMAGE_LIMIT = 4   # images per prompt unless limit_mm_per_prompt says otherwise
# A folder's image processor is in one of these (transformers' AutoProcessor reads them).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
logger = logging.getLogger("pagedbackend")


class MultiModalProcessor:
    """``process(text, images)`` -> ``(token ids, items)`` for a model whose
    ``vision`` is a ``models.vision.VisionEncoder`` and whose placeholder
    token is ``image_token_id``."""

    def __init__(self, folder, vision, image_token_id: int, limits: Optional[Dict[str, int]] = None,
                 load: Optional[Callable] = None):
        """``load(folder)``: the family's own processor loader (None: transformers' ``AutoProcessor``)."""
        from transformers import AutoProcessor
        try:
            self.processor = (load or AutoProcessor.from_pretrained)(str(folder))
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{folder}: a vision-language model needs its processor "
                             f"(processor_config.json / preprocessor_config.json): {exc}") from exc
        self.vision = vision
        self.image_token_id = image_token_id
        limits = dict(limits or {})
        unknown = sorted(set(limits) - {"image"})
        if unknown:
            raise ValueError(f"limit_mm_per_prompt names modality {unknown[0]!r}; served: image")
        self.max_images = limits.get("image", DEFAULT_IMAGE_LIMIT)
        self._lock = threading.Lock()

    def process(self, text, images: Sequence) -> Tuple[List[int], List[MultiModalItem]]:
        if not isinstance(text, str):
            raise InvalidRequestError("a prompt with images must be text (prompt), not token ids: the "
                                      "processor expands each image's placeholder")
        if len(images) > self.max_images:
            raise InvalidRequestError(f"{len(images)} images in one prompt; the limit is {self.max_images} "
                                      "(engine setting limit_mm_per_prompt)")
        try:
            with self._lock:
                out = self.processor(text=text, images=list(images), return_tensors="pt")
        except InvalidRequestError:
            raise
        except (ValueError, TypeError, OSError) as exc:   # placeholders and images disagree, and the like
            raise InvalidRequestError(f"the model's processor refused the prompt and its images: {exc}") from exc
        ids = out["input_ids"][0].tolist()
        per_image = self.vision.split_images(out)
        if len(per_image) != len(images):
            raise InvalidRequestError(f"{len(images)} images, but the processor made {len(per_image)}")
        hashes = [image_hash(image) for image in images]
        return ids, items_at_placeholders(ids, self.image_token_id, per_image,
                                          [self.vision.num_embeds(d) for d in per_image], hashes)


def items_at_placeholders(ids: Sequence[int], token: int, per_image: List[Dict[str, torch.Tensor]],
                          counts: List[int], hashes: List[str]) -> List[MultiModalItem]:
    """One item per image: the next ``count`` placeholder positions in order
    are its embedding rows; its span runs from the first to the last, and
    other tokens inside it (tile separators) get ``embed_mask`` False."""
    positions = [i for i, t in enumerate(ids) if t == token]
    if len(positions) != sum(counts):
        raise InvalidRequestError(f"the prompt holds {len(positions)} image placeholder tokens; its "
                                  f"{len(counts)} images take {sum(counts)} (one placeholder per image in the prompt)")
    items, used = [], 0
    for data, count, digest in zip(per_image, counts, hashes):
        mine = positions[used:used + count]
        used += count
        offset, length = mine[0], mine[-1] + 1 - mine[0]
        mask = None if length == count else tuple(ids[offset + i] == token for i in range(length))
        items.append(MultiModalItem("image", digest, offset, length, mask, data))
    return items


def processor_for(runner, config, folder) -> Optional[MultiModalProcessor]:
    """The image processor of a vision-language model (one whose runner's
    model has a ``vision`` encoder); None for a text model."""
    model = getattr(runner, "model", None)
    vision = getattr(model, "vision", None)
    if vision is None:
        return None
    if not any((pathlib.Path(folder) / name).is_file() for name in PROCESSOR_FILES):
        # A checkpoint folder without its processor (Gemma 3 served as text before it took images).
        logger.warning("pagedbackend: %s has no image processor (%s): it serves text only, images are "
                       "refused", folder, " / ".join(PROCESSOR_FILES))
        return None
    return MultiModalProcessor(folder, vision, model.image_token_id, config.limit_mm_per_prompt,
                               getattr(model, "load_processor", None))
