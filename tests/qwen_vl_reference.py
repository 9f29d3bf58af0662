"""Hugging Face's side of the Qwen2.5-VL tests: the tiny checkpoint's
processor and model (``loadtest.tiny_vision``), chat prompts with image
parts, greedy tokens by ``generate`` (cached per prompt and images)."""
import torch

from loadtest.tiny_vision import load_hf, random_image
from pagedbackend import SamplingParams
from pagedbackend.multimodal.qwen2_5_vl import load_images_processor

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)   # to EOS, as generate
# (seed, width, height): 64 x 48 is 3 x 4 merged tokens in four windows (two
# partial); the others are of other sizes and aspect ratios.
IMAGES = {1: (64, 48), 2: (40, 96), 3: (96, 40), 4: (80, 64), 5: (64, 48), 6: (64, 48)}


def image(seed: int):
    return random_image(seed, *IMAGES[seed])


class QwenReference:
    def __init__(self, folder):
        self.folder = folder
        self.processor = load_images_processor(folder)
        self.model = load_hf(folder)
        self._greedy = {}

    def chat(self, text: str, num_images: int) -> str:
        parts = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
        return self.processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)

    def inputs(self, text: str, seeds=()):
        return self.processor(text=text, images=[image(s) for s in seeds] or None, return_tensors="pt")

    def greedy(self, text: str, seeds=()) -> list:
        key = (text, tuple(seeds))
        if key not in self._greedy:
            inputs = self.inputs(text, seeds)
            with torch.no_grad():
                out = self.model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
            self._greedy[key] = out[0, inputs["input_ids"].shape[1]:].tolist()
        return self._greedy[key]


def request(text: str, seeds=()):
    """vLLM's prompt dict (a plain string without images)."""
    return {"prompt": text, "multi_modal_data": {"image": [image(s) for s in seeds]}} if seeds else text


def tokens_of(outputs) -> list:
    return [list(o.outputs[0].token_ids) for o in outputs]
