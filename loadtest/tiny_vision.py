"""Tiny random vision-language checkpoints, saved by transformers itself
with a processor built from SmolLM2's tokenizer plus the family's special
tokens, for the vision tests and ``loadtest.bench vision``.

Each family gets a small config of its own kind (one or two vision layers,
a two-layer text decoder) and a processor whose image size keeps the number
of placeholder tokens per image small. Weights are seeded and drawn wider
than Hugging Face's init so that greedy decoding does not sit on near-ties.
``random_image`` makes the seeded pixels the tests send.
"""
import pathlib

import numpy as np
import torch

from loadtest.tiny_families import TEXT

# A chat template that renders image content parts as the family's
# placeholder, as the families' own templates do.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ IMAGE }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TEXT_SMALL = dict(TEXT, max_position_embeddings=1024)


def _llava(path, tokenizer, seed, text=None, vision=None, std=0.15):
    """``text`` and ``vision``: settings over the tiny ones (the bench's
    wider model); the processor crops to the vision tower's ``image_size``."""
    from transformers import AutoConfig, CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    vision = dict(dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14,
                       projection_dim=32, hidden_act="quick_gelu"), **(vision or {}))
    config = AutoConfig.for_model(
        "llava", text_config=dict(TEXT_SMALL, model_type="llama", vocab_size=len(tokenizer),
                                  tie_word_embeddings=False, **(text or {})),
        vision_config=vision,
        image_token_index=image_token, vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=False)
    model = _seeded(LlavaForConditionalGeneration, config, seed, std)
    side = vision["image_size"]
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE.replace("{{ IMAGE }}", "<image>"))
    return model, processor


# Idefics3's tile tags: <row_i_col_j> for a split image's tiles, <global-img> for its whole view.
IDEFICS3_TAGS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]


def _idefics3(path, tokenizer, seed):
    """SmolVLM-shaped: tiles of 56 pixels (4 x 4 patches of 14, pixel-shuffled
    by 2 into 4 tokens a tile), an image's longest edge resized to 112, so one
    image gives up to 2 x 2 tiles and its global view."""
    from transformers import AutoConfig, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor
    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TAGS})
    config = AutoConfig.for_model(
        "idefics3", text_config=dict(TEXT_SMALL, model_type="llama", vocab_size=len(tokenizer),
                                     tie_word_embeddings=False),
        vision_config=dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2, tie_word_embeddings=False)
    model = _seeded(Idefics3ForConditionalGeneration, config, seed)
    images = Idefics3ImageProcessor(size={"longest_edge": 112}, max_image_size={"longest_edge": 56},
                                    do_image_splitting=True)
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=CHAT_TEMPLATE.replace("{{ IMAGE }}", "<image>"))
    return model, processor


def _gemma3_vision(path, tokenizer, seed):
    """Gemma 3 with a SigLIP tower on 56-pixel images (4 x 4 patches of 14),
    pooled to 4 soft tokens an image; sliding layers of 16 positions beside
    full ones, so an image's span sits inside or across a window."""
    from transformers import (AutoConfig, AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3ImageProcessor,
                              Gemma3Processor)
    tokenizer.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    config = AutoConfig.for_model(
        "gemma3", text_config=dict(TEXT_SMALL, model_type="gemma3_text", vocab_size=len(tokenizer), head_dim=16,
                                   query_pre_attn_scalar=16, sliding_window=16,
                                   layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14),
        mm_tokens_per_image=4, image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id)
    model = _seeded(Gemma3ForConditionalGeneration, config, seed)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 56, "width": 56}),
                                tokenizer=tokenizer, image_seq_length=4,
                                chat_template=CHAT_TEMPLATE.replace("{{ IMAGE }}", "<start_of_image>"))
    return model, processor


QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _qwen2_5_vl(path, tokenizer, seed):
    """Qwen2.5-VL with patches of 8 pixels merged 2 x 2 into one token, windows
    of 32 pixels (2 x 2 merged tokens) in its first vision block and full
    attention in its second, so an image of 64 x 48 (4 x 3 tokens) spans four
    windows, one of them partial; 1 to 25 tokens an image (min/max pixels).
    M-RoPE sections [2, 3, 3] over the text heads' 16 dimensions.

    The image processor is transformers' PIL one (``Qwen2VLImageProcessorPil``):
    the default one needs torchvision, which this environment may lack; the
    processor is the images-only one the engine loads
    (``multimodal.qwen2_5_vl``: transformers' ``Qwen2_5_VLProcessor`` wants a
    video processor, and those need torchvision). Its config names
    ``Qwen2_5_VLProcessor``, as a real checkpoint's does."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pagedbackend.multimodal.qwen2_5_vl import images_processor_class
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_VISION_TOKENS}
    config = AutoConfig.for_model(
        "qwen2_5_vl", text_config=dict(TEXT_SMALL, model_type="qwen2_5_vl_text", vocab_size=len(tokenizer),
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3]}),
        vision_config=dict(model_type="qwen2_5_vl_vision", depth=2, hidden_size=32, intermediate_size=64,
                           num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=32, fullatt_block_indexes=[1], out_hidden_size=TEXT_SMALL["hidden_size"]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    model = _seeded(Qwen2_5_VLForConditionalGeneration, config, seed)
    images = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                      min_pixels=16 * 16, max_pixels=80 * 80)
    processor = images_processor_class()(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE.replace(
        "{{ IMAGE }}", "<|vision_start|><|image_pad|><|vision_end|>"))
    return model, processor


# name -> builder(path, tokenizer, seed) -> (model, processor)
CASES = {"llava": _llava, "idefics3": _idefics3, "gemma3_vision": _gemma3_vision, "qwen2_5_vl": _qwen2_5_vl}


def _seeded(cls, config, seed: int, std: float = 0.15):
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif "norm" in name and name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, std)
    return model


def build_tiny_vision(path, case: str, seed: int = 0, **shape) -> pathlib.Path:
    """Write the checkpoint, processor and tokenizer of ``case`` (a key of ``CASES``) into ``path``;
    ``shape``: the builder's own settings (LLaVA's ``text``, ``vision`` and ``std``)."""
    from transformers import AutoTokenizer

    from pagedbackend.models.default_model import resolve_model_path

    path = pathlib.Path(path)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    model, processor = CASES[case](path, tokenizer, seed, **shape)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    if case == "qwen2_5_vl":   # as a real checkpoint names it (multimodal.qwen2_5_vl loads it images-only)
        config = path / "processor_config.json"
        config.write_text(config.read_text().replace("Qwen2_5_VLImagesProcessor", "Qwen2_5_VLProcessor"))
    return path


def load_hf(path):
    """The saved checkpoint in transformers, fp32, for reference outputs."""
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def random_image(seed: int, width: int = 64, height: int = 48):
    """Seeded random RGB pixels as a PIL image."""
    from PIL import Image
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
