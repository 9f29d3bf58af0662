"""The text decoder inside a multimodal checkpoint (``*ForConditionalGeneration``):
its config and weights. A family served as text only (Mistral 3) skips the
vision tower and projector, counted and named in a log line at load; one
that takes images (LLaVA, Gemma 3, Idefics3) routes them to its encoder."""
import torch

from pagedbackend.models.model_args import refuse

# The parts of a multimodal checkpoint beside its text decoder.
_VISION_PARTS = {"vision_tower": "vision tower", "multi_modal_projector": "multimodal projector"}


def text_decoder_tensor(owner, name: str, tensor: torch.Tensor):
    """The tensors of a ``*ForConditionalGeneration`` checkpoint, renamed to
    the text decoder's (both the saved ``language_model.model.`` layout and
    transformers 5's ``model.language_model.``); vision parts skipped and counted."""
    for old, new in (("language_model.model.", ""), ("model.language_model.", ""),
                     ("language_model.lm_head.", "lm_head.")):
        if name.startswith(old):
            yield new + name[len(old):], tensor
            return
    part = name.removeprefix("model.").split(".")[0]
    if part in _VISION_PARTS:
        owner.skipped[_VISION_PARTS[part]] += 1
        return
    yield name, tensor


def wrapped_text_config(cfg: dict, text_types) -> dict:
    """The text decoder's config of a multimodal one; the wrapper decides
    whether the LM head is tied (transformers ties it by the top-level field)."""
    text = dict(cfg.get("text_config") or {})
    if text.get("model_type") not in text_types:
        raise refuse("text_config.model_type", text.get("model_type"),
                     f"served text decoders: {', '.join(text_types)}")
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
    return text
