"""vLLM's prompt dicts: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``,
with ``"multi_modal_data": {"image": image or [images]}`` (PIL images)."""
from typing import List, Tuple, Union

from ..errors import InvalidRequestError

PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")
MODALITIES = ("image",)


def split_prompt(prompt: dict) -> Tuple[Union[str, List[int]], List[object]]:
    """The text (or token ids) of a prompt dict and its images (PIL images, in order; empty: none)."""
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise InvalidRequestError(f"prompt has unknown key {unknown[0]!r}; a prompt dict takes "
                                  f"{', '.join(PROMPT_KEYS)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError("a prompt dict takes exactly one of prompt and prompt_token_ids")
    text = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if "prompt" in prompt and not isinstance(text, str):
        raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
    if "prompt_token_ids" in prompt and not isinstance(text, (list, tuple)):
        raise InvalidRequestError(f"prompt_token_ids must be a list of token ids, got {type(text).__name__}")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict):
        raise InvalidRequestError(f"multi_modal_data must be a dict of modality -> items, got {type(data).__name__}")
    unknown = sorted(set(data) - set(MODALITIES))
    if unknown:
        raise InvalidRequestError(f"multi_modal_data has modality {unknown[0]!r}; served: {', '.join(MODALITIES)}")
    images = data.get("image")
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    from PIL import Image
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"multi_modal_data image {i} is a {type(image).__name__}, not a PIL image")
    return (text if isinstance(text, str) else list(text)), images
