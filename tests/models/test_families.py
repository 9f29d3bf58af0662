"""Every served model family generates, token for token, what Hugging Face
``generate`` does (greedy, fp32) on a tiny random checkpoint saved by
transformers: through shuffled paged blocks with prefills and decodes mixed,
and through the engine batched with other sequences, with prefix caching,
under preemption (recompute and swap) and with n > 1."""
import json
import shutil

import pytest
import torch

from loadtest.tiny_families import CASES, WINDOW, load_hf
from pagedbackend import LLM, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.core.kv_groups import kv_layout
from pagedbackend.models import model_args
from pagedbackend.kernels.packed_linear import PackedLinear
from pagedbackend.worker.model_runner import ModelRunner
from runner_reference import greedy_hf, greedy_paged, random_prompts

VOCAB = 49152
# Prompt lengths per case (default: around block boundaries of 16; with 16 new
# tokens the longer ones end past three sliding windows of 16). Dynamic NTK
# prompts stay within max_position_embeddings (32) and generation crosses it;
# LongRoPE prompts pass original_max_position_embeddings (32), so HF takes the
# long factors, as the engine does serving 128 positions.
RUNNER_LENGTHS = {"llama-dynamic": [1, 7, 17, 30], "phi3-longrope": [33, 40, 57]}
# Engine prompts: a shared prefix, then tails of 3-8 tokens and 10 new ones (past three windows).
PREFIX = {"llama-dynamic": 20}
NEW_TOKENS = 10


def make_runner(folder, **overrides):
    settings = dict(model=str(folder), block_size=16, num_kv_blocks=48, dtype="float32", device="cpu",
                    attention_backend="torch", compile=False)
    return ModelRunner(EngineConfig(**{**settings, **overrides}))


def hf_greedy_until_eos(hf, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(2) + 1] if 2 in tokens else tokens   # EOS is 2 in every case


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tiny_family):
    """(case, folder, HF model) of each case, built once."""
    case = request.param
    folder = tiny_family(case)
    return case, folder, load_hf(folder, case)


def test_runner_generates_what_transformers_generates(family):
    case, folder, hf = family
    prompts = random_prompts(RUNNER_LENGTHS.get(case, [1, 7, 17, 33, 50]), VOCAB, seed=1)
    expected = greedy_hf(hf, prompts)
    assert len({tuple(e) for e in expected}) == len(expected)   # outputs differ: a real check
    # The reference twin of the attention kernels here; the engine's test runs sdpa (auto on CPU).
    assert greedy_paged(make_runner(folder), prompts) == expected


def engine_prompts(case):
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, VOCAB, (PREFIX.get(case, 36),), generator=g).tolist()
    return [prefix + torch.randint(3, VOCAB, (3 + i,), generator=g).tolist() for i in range(6)]


def pool_for(folder):
    """Device and host blocks of 8 that force both kinds of preemption. 7
    sequences of up to ~54 positions need ~45 blocks of 8 per KV group: 14
    per group force preemption; swap takes the 6 host blocks per group first,
    then falls back to recompute. A model whose every layer is windowed gives
    blocks back as the windows move on: 12 and 4 blocks force both there."""
    windows = kv_layout(model_args(json.loads((folder / "config.json").read_text())).layer_windows).windows
    if None not in windows:
        return 12, 4
    return 14 * len(windows), 6 * len(windows)


def test_engine_batch_with_prefix_cache_preemption_and_n_generates_what_transformers_does(family):
    case, folder, hf = family
    prompts = engine_prompts(case)
    expected = [hf_greedy_until_eos(hf, p, NEW_TOKENS) for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    two = SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS)   # forks share the prompt's blocks
    blocks, host_blocks = pool_for(folder)
    llm = LLM(model=str(folder), compile=False, block_size=8, num_kv_blocks=blocks, preemption_mode="swap",
              swap_space_blocks=host_blocks)
    first = llm.generate(prompts[:1], greedy)   # leaves the shared prefix in the prefix cache
    outs = llm.generate(prompts, [greedy] * 5 + [two])
    stats = llm.engine.get_stats()
    assert first[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in outs[:5]] == expected[:5]
    assert [o.token_ids for o in outs[5].outputs] == [expected[5]] * 2
    assert stats.prefix_cache_hits > 0
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.engine.block_manager.check_invariants()
    # A family with sliding windows runs on KV groups whose windowed tables give blocks back.
    windowed = WINDOW in llm.engine.runner.model.layer_windows
    assert llm.engine.block_manager.windows == llm.engine.runner.kv_layout.windows
    assert (WINDOW in llm.engine.block_manager.windows) == windowed


def test_a_bfloat16_checkpoint_is_served_in_float32_with_bfloat16_held_weights(tiny_family, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = shutil.copytree(tiny_family("gemma3"), tmp_path / "bf16")
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    runner = make_runner(folder, linear_backend="packed")
    assert {p.dtype for p in runner.model.parameters()} == {runner.kv_cache.dtype} == {torch.float32}
    # its linear layers and LM head are held in bfloat16 (the same float32 sums, half the bytes)
    held = [m.packed.dtype for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert len(held) > 4 and set(held) == {torch.bfloat16}
    prompts = random_prompts([5, 20], VOCAB, seed=3)
    assert greedy_paged(runner, prompts) == greedy_hf(load_hf(folder, "gemma3"), prompts)


def test_longrope_serving_at_most_the_original_length_uses_the_short_factors(tiny_family):
    folder = tiny_family("phi3-longrope")
    prompts = random_prompts([1, 7, 15], VOCAB, seed=2)   # with 16 new tokens: within 32 positions
    runner = make_runner(folder, max_model_len=32)
    assert greedy_paged(runner, prompts) == greedy_hf(load_hf(folder, "phi3-longrope"), prompts)


@pytest.mark.parametrize("case, windows", [
    ("gemma3_text", [WINDOW, None, WINDOW, None]), ("gemma3", [WINDOW, None]), ("qwen3", [None, WINDOW]),
    ("smollm3", [None, WINDOW, None, WINDOW]), ("phi3", [WINDOW, WINDOW]), ("granite", [None, None])])
def test_each_layer_says_its_sliding_window(tiny_family, case, windows):
    runner = make_runner(tiny_family(case), num_kv_blocks=4)
    assert runner.model.layer_windows == windows
    assert [layer.self_attn.attn.sliding_window for layer in runner.model.layers] == windows


def test_nope_layers_have_no_rope_and_gemma_layer_types_their_own(tiny_family):
    smollm3 = make_runner(tiny_family("smollm3"), num_kv_blocks=4).model
    assert [layer.self_attn.rope for layer in smollm3.layers] == [0, None, 0, None]
    gemma = make_runner(tiny_family("gemma3_text"), num_kv_blocks=4).model
    assert [layer.self_attn.rope for layer in gemma.layers] == [0, 1, 0, 1]
    assert [params["rope_theta"] for params in gemma.args.ropes] == [10000.0, 1e6]


def test_a_multimodal_checkpoint_served_as_text_says_what_it_skipped(tiny_family, caplog):
    parts = ["multimodal projector", "vision tower"]
    with caplog.at_level("INFO", logger="pagedbackend"):
        runner = make_runner(tiny_family("mistral3"), num_kv_blocks=4)
    said = [r.getMessage() for r in caplog.records if "are not loaded" in r.getMessage()]
    assert sorted(runner.model.skipped) == parts
    assert [part for part in parts if any(f"of the {part} are not loaded" in line for line in said)] == parts


def test_gemma3s_multimodal_checkpoint_loads_its_vision_encoder_too(tiny_family):
    """Its tower and projector load (SigLIP's unused pooling head aside), with
    the checkpoint's values: nothing is skipped."""
    from safetensors.torch import load_file
    folder = tiny_family("gemma3")
    model = make_runner(folder, num_kv_blocks=4).model
    assert not model.skipped and model.image_token_id == 262144
    saved = load_file(str(folder / "model.safetensors"))
    tower = {n.removeprefix("model."): t for n, t in saved.items() if "vision_tower.encoder" in n}
    assert tower and all(torch.equal(model.vision.get_parameter(n), t) for n, t in tower.items())


def test_two_tensor_parallel_ranks_generate_what_transformers_does(tiny_family):
    """Phi-3's fused q/k/v and gate/up tensors, split into each rank's heads
    and features, with partial RoPE, over two gloo ranks."""
    case = "phi3"
    folder = tiny_family(case)
    prompts = engine_prompts(case)[:3]
    expected = [hf_greedy_until_eos(load_hf(folder, case), p, NEW_TOKENS) for p in prompts]
    with LLM(model=str(folder), compile=False, tensor_parallel_size=2, device="cpu",
             attention_backend="torch") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_gemma3_folder_without_its_image_processor_serves_text_and_refuses_images(tiny_family):
    from pagedbackend.errors import InvalidRequestError
    from loadtest.tiny_vision import random_image
    with LLM(model=str(tiny_family("gemma3")), compile=False, block_size=8, num_kv_blocks=32) as llm:
        with pytest.raises(InvalidRequestError, match="takes no image input"):
            llm.generate({"prompt": "look <start_of_image>", "multi_modal_data": {"image": random_image(0)}},
                         SamplingParams(max_tokens=2))
        assert len(llm.generate("a text prompt", SamplingParams(max_tokens=3, temperature=0.0))[0]
                   .outputs[0].token_ids) == 3
