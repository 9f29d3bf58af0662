"""Sliding-window models (Mistral, Qwen2 with windowed layers) generate what
Hugging Face generates (greedy, fp32) on sequences several windows long,
batched, through prefill chunks and decodes; windows are read per layer as
transformers reads them."""
import pytest
import torch

from pagedbackend import LLM, SamplingParams
from pagedbackend.models.llama import sliding_windows

WINDOW = 16
# Prompts from shorter than the window to nearly four windows; with 24 new
# tokens every sequence but the first ends past three windows.
PROMPT_LENGTHS = [5, 29, 47, 61]
NEW_TOKENS = 24


def test_windows_per_layer_are_read_as_transformers_reads_them():
    base = {"num_hidden_layers": 4, "sliding_window": 8}
    assert sliding_windows({**base, "model_type": "mistral"}) == [8] * 4
    assert sliding_windows({**base, "model_type": "mistral", "sliding_window": None}) == [None] * 4
    assert sliding_windows({**base, "model_type": "llama"}) == [None] * 4   # Llama has no window
    # Qwen2: only with use_sliding_window, from max_window_layers on, or as layer_types says.
    assert sliding_windows({**base, "model_type": "qwen2"}) == [None] * 4
    assert sliding_windows({**base, "model_type": "qwen2", "use_sliding_window": True,
                            "max_window_layers": 1}) == [None, 8, 8, 8]
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert sliding_windows({**base, "model_type": "qwen2", "use_sliding_window": True,
                            "layer_types": types}) == [8, None, 8, None]
    with pytest.raises(ValueError, match="layer_types"):
        sliding_windows({**base, "model_type": "qwen2", "use_sliding_window": True,
                         "layer_types": types[:3]})
    with pytest.raises(ValueError, match="sliding_window"):
        sliding_windows({**base, "model_type": "mistral", "sliding_window": 0})


VARIANTS = {
    # every layer windowed
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    # full and windowed layers mixed, as layer_types names them
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def windowed(request, tmp_path_factory, default_model_dir):
    """(name, folder, prompts, Hugging Face's greedy tokens) of a tiny windowed model."""
    from runner_reference import greedy_hf, load_hf, random_prompts
    from tiny_model import build_tiny_llama
    folder = build_tiny_llama(tmp_path_factory.mktemp(request.param), seed=3, num_hidden_layers=3,
                              **VARIANTS[request.param])
    prompts = random_prompts(PROMPT_LENGTHS, 49152, seed=4)
    return request.param, folder, prompts, greedy_hf(load_hf(folder), prompts, NEW_TOKENS)


def generate(folder, prompts, **settings):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    settings = {"compile": False, "block_size": 8, "num_kv_blocks": 96, **settings}
    with LLM(model=str(folder), **settings) as llm:
        outs = llm.generate(prompts, params)
        return llm.engine, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_windowed_models_generate_what_transformers_generates(windowed, backend):
    name, folder, prompts, expected = windowed
    # Prefill chunks of at most 12 tokens under a 40-token budget: prompts go in
    # several chunks beside other sequences' decodes.
    engine, got = generate(folder, prompts, attention_backend=backend, max_num_batched_tokens=40,
                           long_prefill_token_threshold=12)
    assert got == expected
    windows = engine.runner.model.layer_windows
    assert windows == ([WINDOW] * 3 if name == "mistral" else [None, WINDOW, WINDOW])
    # No longer capped at the window: the model's own context.
    assert engine.max_model_len == 512
    assert len({tuple(t) for t in expected}) == len(expected)   # outputs differ: a real check


@pytest.mark.parametrize("windowed", ["qwen2"], indirect=True)   # full and windowed layers, one model
def test_windowed_model_through_the_triton_kernels(windowed):
    from runner_reference import greedy_paged
    from pagedbackend.config import EngineConfig
    from pagedbackend.worker.model_runner import ModelRunner
    _, folder, prompts, expected = windowed
    runner = ModelRunner(EngineConfig(model=str(folder), block_size=8, num_kv_blocks=48, dtype="float32",
                                      device="cpu", attention_backend="triton", compile=False))
    # Two sequences, 40 and 53 positions at the end: past two windows, few interpreted launches.
    got = greedy_paged(runner, prompts[1:3], max_new_tokens=6)
    assert got == [tokens[:6] for tokens in expected[1:3]]
