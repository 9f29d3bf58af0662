"""Qwen2.5-VL's processor for images only: transformers' ``Qwen2_5_VLProcessor``
(placeholder expansion, ``image_grid_thw``) without its video processor.

The checkpoint's own processor class needs a video processor, and
transformers' video processors need torchvision; serving takes images only,
so this one has just the image processor (``AutoImageProcessor``: the
torchvision one where torchvision is installed, else its PIL twin, which
computes the same patches) and the tokenizer. Token ids and tensors are
those of ``Qwen2_5_VLProcessor`` for the same images."""
import functools


@functools.lru_cache(maxsize=None)
def images_processor_class():
    """The class (built on first use: transformers loads only then)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2_5_VLImagesProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return Qwen2_5_VLImagesProcessor


def load_images_processor(folder):
    """The images-only processor of a Qwen2.5-VL model folder."""
    return images_processor_class().from_pretrained(str(folder))
