"""kv_cache_dtype through the engine: the default model's greedy tokens with
a bfloat16 or int8 cache against its float32 cache, and the block moves
(copy-on-write, swap, prefix hits, windowed KV groups) with an int8 cache,
whose scales travel inside the rows they scale."""
import pytest
import torch

from pagedbackend import LLM, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm import merge_delta
from pagedbackend.engine.llm_engine import LLMEngine
from greedy import default_model_greedy
from loadtest.bench.kv_cache_dtype import PROMPTS



@pytest.fixture(scope="module")
def float32_tokens(default_model_dir):
    return default_model_greedy(PROMPTS, 32, dtype="float32")


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_default_model_keeps_its_greedy_tokens_with_a_smaller_cache(float32_tokens, kv_cache_dtype):
    tokens = default_model_greedy(PROMPTS, 32, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    same = sum(a == b for a, b in zip(tokens, float32_tokens))
    equal_tokens = sum(a == b for got, ref in zip(tokens, float32_tokens) for a, b in zip(got, ref))
    # Measured (docs/kv_cache_dtype.md): bfloat16 30 prompts of 32 (981 tokens
    # of 1024, 2-core Xeon), int8 30 (992 tokens, 2-core EPYC): a near-tie
    # falls the other way in a few; float32 int8 scales per 32 channels instead
    # of float16 ones per 16 kept 29 (Xeon), one scale per row 18.
    # fp8 at scale 1 (three or two mantissa bits) keeps far fewer: e4m3 11 (653
    # tokens), e5m2 fewer (506 tokens); the bar of 30 is not met.
    assert same >= {"bfloat16": 30, "int8": 30, "fp8_e4m3": 10, "fp8_e5m2": 5}[kv_cache_dtype], \
        [i for i, (a, b) in enumerate(zip(tokens, float32_tokens)) if a != b]
    assert equal_tokens >= {"fp8_e4m3": 620, "fp8_e5m2": 480}.get(kv_cache_dtype, 0.95 * 32 * 32)


def _tiny_llm(folder, kv="int8", **settings):
    return LLM(model=str(folder), compile=False, dtype="float32", kv_cache_dtype=kv, **settings)


def _tokens(outs):
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.mark.parametrize("mode,kv", [("recompute", "int8"), ("swap", "int8"), ("swap", "fp8_e4m3"),
                                     ("swap", "fp8_e5m2")])
def test_a_quantised_cache_gives_the_same_tokens_under_preemption(tiny_model_dir, mode, kv):
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 20 + 5 * i)) for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = _tiny_llm(tiny_model_dir, kv, num_kv_blocks=256, block_size=8)
    expected = _tokens(roomy.generate(prompts, params))
    tight = _tiny_llm(tiny_model_dir, kv, num_kv_blocks=20, block_size=8, preemption_mode=mode,
                      swap_space_blocks=64 if mode == "swap" else 0)
    got = _tokens(tight.generate(prompts, params))
    if mode == "swap":   # the swapped rows come back byte for byte, scales with them
        assert got == expected
    else:   # a recomputed prompt attends to its fresh K/V, which its decodes read rounded: near-ties may turn
        same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g[0], e[0]))
        assert same >= 0.8 * 24 * len(prompts) and [g[0][:8] for g in got] == [e[0][:8] for e in expected]
    stats = tight.engine.get_stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert tight.engine.runner.kv_cache.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
                                                  "fp8_e5m2": torch.float8_e5m2}[kv]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_a_quantised_cache_copies_on_write_for_parallel_samples(tiny_model_dir, kv):
    # Three greedy samples of one prompt fork its blocks and copy the partly
    # filled one as each writes its next token: each must read back its own
    # rows (values and scales) and so give what one sample gives alone.
    prompt = list(range(300, 340))   # 40 tokens: 2 full blocks of 16 and 8 in a third
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, dtype="float32",
                                    kv_cache_dtype=kv, num_kv_blocks=64, enable_prefix_caching=False))
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True))
    merged = {}
    for out in engine.step():
        merge_delta(merged, out)
    for out in engine.step():   # each sample writes its second token: the partly filled block is copied
        merge_delta(merged, out)
    assert engine.block_manager.num_used_blocks == 2 + 3
    while engine.has_unfinished_requests():
        for out in engine.step():
            merge_delta(merged, out)
    alone = _tiny_llm(tiny_model_dir, kv, num_kv_blocks=64, enable_prefix_caching=False)
    expected = _tokens(alone.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                                                               ignore_eos=True)))[0][0]
    assert [o.token_ids for o in merged["r"].outputs] == [expected] * 3


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_a_quantised_cache_serves_prefix_hits_with_the_same_tokens(tiny_model_dir, kv):
    prefix = list(range(500, 548))   # three full blocks of 16
    prompts = [prefix + [600 + i, 700 + i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cold = _tokens(_tiny_llm(tiny_model_dir, kv, num_kv_blocks=128, enable_prefix_caching=False).generate(
        prompts[:1], params))
    # A prefix hit reads the prefix's K/V through the cache (rounded), as a
    # prompt does whose second chunk follows its 48-token first one; a whole
    # prefill attends to them as computed (the tiny model's near-flat logits
    # turn on that difference in fp8).
    chunked = _tokens(_tiny_llm(tiny_model_dir, kv, num_kv_blocks=128, enable_prefix_caching=False,
                                long_prefill_token_threshold=48).generate(prompts[1:], params))
    llm = _tiny_llm(tiny_model_dir, kv, num_kv_blocks=128)
    first = _tokens(llm.generate(prompts[:1], params))
    rest = _tokens(llm.generate(prompts[1:], params))
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert first == cold and rest == chunked


def test_int8_cache_with_windowed_kv_groups_under_swap(tmp_path):
    from runner_reference import random_prompts
    from tiny_model import build_tiny_llama
    folder = build_tiny_llama(tmp_path, seed=5, num_hidden_layers=3, model_type="qwen2",
                              use_sliding_window=True, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    prompts = random_prompts([9, 30, 52, 70], 49152, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs, llms = {}, {}
    for blocks, mode in ((160, "recompute"), (36, "swap")):
        llms[mode] = _tiny_llm(folder, block_size=8, num_kv_blocks=blocks, preemption_mode=mode,
                               swap_space_blocks=80, max_num_batched_tokens=48, long_prefill_token_threshold=16)
        outs[mode] = _tokens(llms[mode].generate(prompts, params))
    assert len(llms["swap"].engine.runner.kv_layout.groups) == 3
    assert llms["swap"].engine.get_stats().num_swap_preemptions > 0
    assert outs["swap"] == outs["recompute"]


def test_int8_cache_under_speculative_verification_gives_plain_decoding_tokens(default_model_dir):
    # n-gram drafts of a repetitive answer, verified as query chunks that read
    # the int8 cache, against one token a step read by the C decode kernel.
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire."
    prompt = f"<|im_start|>user\nRepeat this sentence three times: {text}<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        with LLM(model="default", compile=False, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=64,
                 speculative_config=spec) as llm:
            outs[spec is None] = llm.generate([prompt], params)[0].outputs[0].token_ids
            stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0
    assert outs[False] == outs[True]


def test_the_same_kv_cache_bytes_hold_more_blocks_in_a_smaller_dtype(tiny_model_dir):
    blocks, caches = {}, {}
    for kv in ("auto", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, dtype="float32",
                                        kv_cache_dtype=kv, kv_cache_bytes=16 * 2 ** 20, swap_space_blocks=4))
        runner = engine.runner
        blocks[kv], caches[kv] = runner.num_kv_blocks, runner.kv_cache
        assert runner.swap_cache.dtype == runner.kv_cache.dtype   # swapped blocks take the same bytes
        assert runner.kv_cache.nbytes <= 16 * 2 ** 20 < runner.kv_cache.nbytes + runner.kv_bytes_per_block
        assert engine.block_manager.num_total_blocks == blocks[kv]
    assert (caches["auto"].dtype, caches["bfloat16"].dtype, caches["int8"].dtype) == (
        torch.float32, torch.bfloat16, torch.int8)
    head_dim = caches["auto"].shape[-1]   # 64: an int8 row is 64 values and 4 float16 scales
    assert caches["int8"].shape[-1] == head_dim + head_dim // 8
    assert blocks["bfloat16"] / blocks["auto"] == pytest.approx(2, rel=0.01)
    assert blocks["int8"] / blocks["bfloat16"] == pytest.approx(128 / 72, rel=0.01)
    for kv in ("fp8_e4m3", "fp8_e5m2"):   # one byte a value, no scales in the row
        assert caches[kv].shape[-1] == head_dim and caches[kv].element_size() == 1
        assert blocks[kv] / blocks["bfloat16"] == pytest.approx(2, rel=0.01)


# Floors of tokens equal (of 8 prompts x 16) for bfloat16 / int8 and for fp8,
# below what was measured (docs/kv_cache_dtype.md): Gemma 3 128 / 128 and
# 127-128; Qwen3-MoE 128 and 99 / 38-57, its logits flat (a median gap of
# 0.27 between the two likeliest tokens, SmolLM2's 1.3) and its routing turning
# on near-ties, so a rounding parts the greedy tokens sooner.
FAMILY_FLOORS = {"gemma3_text": (0.9, 0.75), "qwen3_moe": (0.6, 0.2)}


@pytest.mark.parametrize("family", sorted(FAMILY_FLOORS))
def test_a_windowed_and_a_moe_family_run_every_cache_dtype_and_keep_most_greedy_tokens(tmp_path, family):
    # Gemma 3's sliding layers (windows of 16, which every sequence here runs
    # past) beside its full ones; Qwen3-MoE's experts. Tiny random
    # checkpoints on the engine's CPU path (the C kernels), as
    # `bench kv_cache_dtype --model` measures them.
    from loadtest.bench.kv_cache_dtype import QUALITY, bench_quality, tiny_checkpoint
    result = bench_quality(PROMPTS[:8], 16, 96, QUALITY, tiny_checkpoint(family, tmp_path))
    assert result["longest_sequence"] > 16 and result["text_tokens"] > 6 * 16
    close, fp8 = FAMILY_FLOORS[family]
    for kv in QUALITY:
        row = result[kv]
        assert row["tokens"] == 8 * 16 and 0 < row["perplexity"] < float("inf")
        floor, ppl = (close, 1.0) if kv in ("auto", "bfloat16", "int8") else (fp8, 5.0)
        assert row["tokens_equal"] >= floor * row["tokens"], (kv, row)
        assert abs(row["perplexity_change_pct"]) < ppl, (kv, row)
