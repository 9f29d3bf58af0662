"""The SigLIP families' vision encoders (models/vision: Idefics3's tiles and
connector, Gemma 3's tower and projector) give Hugging Face's image features
(``get_image_features`` on the same pixel_values) on tiny random checkpoints
saved by transformers, for images of several aspect ratios in one prompt,
split per image as the processor laid them out."""
import json

import pytest
import torch
from safetensors.torch import load_file

from loadtest.tiny_vision import build_tiny_vision, load_hf, random_image
from pagedbackend.models.vision.gemma3 import Gemma3VisionEncoder
from pagedbackend.models.vision.idefics3 import Idefics3VisionEncoder, pixel_shuffle, tiles_per_image

# width x height: wide, tall, small (upscaled to the same tiles as the others)
SIZES = [(64, 48), (40, 96), (30, 30)]


@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model_dir):
    folders = {}

    def folder(case):
        if case not in folders:
            path = build_tiny_vision(tmp_path_factory.mktemp(case), case)
            from transformers import AutoProcessor
            folders[case] = (path, json.loads((path / "config.json").read_text()), load_hf(path),
                             AutoProcessor.from_pretrained(path))
        return folders[case]
    return folder


def vision_tensors(path, prefixes):
    """The checkpoint's tower and projector tensors, named without ``model.``."""
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        name = name.removeprefix("model.")
        if name.startswith(prefixes):
            yield name, tensor


def images():
    return [random_image(10 + i, w, h) for i, (w, h) in enumerate(SIZES)]


def test_idefics3_encoder_gives_transformers_image_features(built):
    path, cfg, hf, processor = built("idefics3")
    encoder = Idefics3VisionEncoder(cfg["vision_config"], cfg["scale_factor"], cfg["text_config"]["hidden_size"],
                                    cfg["image_token_id"], torch.float32)
    encoder.load_weights(vision_tensors(path, ("vision_model.", "connector.")))
    processed = processor(text="a <image> b <image> c <image>", images=images(), return_tensors="pt")
    per_image = encoder.split_images(processed)
    # wide 64x48 -> 2x2 tiles, tall 40x96 -> 2 rows x 1 col, small -> 2x2; each + its global view
    assert [image["pixel_values"].shape[0] for image in per_image] == [5, 3, 5]
    ours = [encoder(image) for image in per_image]
    assert [rows.shape[0] for rows in ours] == [encoder.num_embeds(image) for image in per_image] == [20, 12, 20]
    # as many rows as the prompt has <image> placeholders
    assert sum(r.shape[0] for r in ours) == int((processed["input_ids"] == cfg["image_token_id"]).sum())
    with torch.no_grad():
        expected = hf.get_image_features(processed["pixel_values"], processed["pixel_attention_mask"]).pooler_output
    torch.testing.assert_close(torch.cat(ours), torch.cat(list(expected)), atol=1e-5, rtol=1e-5)


def test_idefics3_padded_tiles_take_transformers_positions_and_mask(built):
    """A tile whose pixels are partly padding (the processor's
    pixel_attention_mask): its padded patches are hidden from attention and
    its real ones spread over the position grid, as in transformers."""
    path, cfg, hf, processor = built("idefics3")
    encoder = Idefics3VisionEncoder(cfg["vision_config"], cfg["scale_factor"], cfg["text_config"]["hidden_size"],
                                    cfg["image_token_id"], torch.float32)
    encoder.load_weights(vision_tensors(path, ("vision_model.", "connector.")))
    processed = processor(text="x <image>", images=[random_image(3, 64, 48)], return_tensors="pt")
    pixels, mask = processed["pixel_values"].clone(), processed["pixel_attention_mask"].clone()
    mask[0, 1, 30:, :] = 0      # the second tile: its lower rows of patches padding
    mask[0, 2, :, 20:] = 0      # the third: its right columns
    pixels[0, 1, :, 30:, :] = 0
    pixels[0, 2, :, :, 20:] = 0
    image = encoder.split_images({**processed, "pixel_values": pixels, "pixel_attention_mask": mask})[0]
    ours = encoder(image)
    with torch.no_grad():
        expected = hf.get_image_features(pixels, mask).pooler_output[0]
    full = encoder(encoder.split_images(processed)[0])
    assert not torch.allclose(ours[4:12], full[4:12], atol=1e-3)   # the padding changed those tiles
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_idefics3_tiles_per_image_read_from_the_tags():
    img, fake, glob, row11, row12 = 9, 8, 7, 5, 6
    ids = [1, fake, row11, img, img, fake, row12, img, img, 3, fake, glob, img, img, fake,   # 2 tiles + global
           4, fake, glob, img, img, fake]                                                  # unsplit: global
    assert tiles_per_image(ids, img) == [3, 1]
    assert tiles_per_image([1, 2, 3], img) == []


def test_pixel_shuffle_folds_each_2x2_group_of_patches_into_one_token():
    x = torch.arange(16.0).view(1, 16, 1)       # a 4x4 grid of one feature each
    out = pixel_shuffle(x, 2)
    assert out.shape == (1, 4, 4)
    assert out[0, 0].tolist() == [0.0, 1.0, 4.0, 5.0]      # the top-left 2x2 group
    assert out[0, 3].tolist() == [10.0, 11.0, 14.0, 15.0]


def test_gemma3_encoder_gives_transformers_image_features(built):
    path, cfg, hf, processor = built("gemma3_vision")
    encoder = Gemma3VisionEncoder(cfg["vision_config"], cfg["mm_tokens_per_image"], cfg["text_config"]["hidden_size"],
                                  torch.float32)
    encoder.load_weights(vision_tensors(path, ("vision_tower.", "multi_modal_projector.")))
    processed = processor(text="a <start_of_image> b <start_of_image> c <start_of_image>", images=images(),
                          return_tensors="pt")
    per_image = encoder.split_images(processed)
    assert len(per_image) == 3 and all(encoder.num_embeds(image) == 4 for image in per_image)
    ours = torch.cat([encoder(image) for image in per_image])
    with torch.no_grad():
        expected = hf.get_image_features(processed["pixel_values"]).pooler_output
    torch.testing.assert_close(ours, expected.reshape(ours.shape), atol=1e-5, rtol=1e-5)
    # the three images give three different sets of rows
    assert not torch.allclose(ours[:4], ours[4:8], atol=1e-3)


def test_vision_checkpoint_missing_a_tensor_is_named(built):
    path, cfg, _, _ = built("gemma3_vision")
    encoder = Gemma3VisionEncoder(cfg["vision_config"], cfg["mm_tokens_per_image"], cfg["text_config"]["hidden_size"],
                                  torch.float32)
    tensors = [(n, t) for n, t in vision_tensors(path, ("vision_tower.", "multi_modal_projector."))
               if n != "vision_tower.post_layernorm.weight"]
    with pytest.raises(ValueError, match="post_layernorm.weight"):
        encoder.load_weights(tensors)
