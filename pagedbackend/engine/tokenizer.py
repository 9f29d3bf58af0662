"""The engine's text side: the tokenizer and the ids that end a sequence.

Only the engine loads a tokenizer; the model runner and tensor-parallel
workers deal in token ids alone, except that ``quantization=w8a8`` tokenises
its calibration text once at load (``quant.smooth``).
"""
import json
import pathlib
import threading
from typing import Set


def load_tokenizer(model_path: pathlib.Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


class TokenizerLoad:
    """A tokenizer loading in a thread, so that it (most of it importing
    transformers) loads beside the weights; ``result()`` waits for it and
    returns it, or raises the load's error."""

    def __init__(self, model_path: pathlib.Path):
        self._value, self._error = None, None

        def run():
            try:
                self._value = load_tokenizer(model_path)
            except BaseException as exc:   # raised again in result()
                self._error = exc
        self._thread = threading.Thread(target=run, name="pagedbackend-load", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def eos_token_ids(model_path: pathlib.Path, tokenizer) -> Set[int]:
    """EOS ids named by config.json, the tokenizer and generation_config.json."""
    hf_config = json.loads((model_path / "config.json").read_text())
    # A multimodal checkpoint (Gemma 3, Mistral 3) names them in its text decoder's config.
    text_config = hf_config.get("text_config") or {}
    values = [hf_config.get("eos_token_id"), text_config.get("eos_token_id"), tokenizer.eos_token_id]
    generation_config = model_path / "generation_config.json"
    if generation_config.is_file():
        values.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    ids: Set[int] = set()
    for value in values:
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    return {int(i) for i in ids}
