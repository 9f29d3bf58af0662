"""Speculative decoding on the paged KV cache (spec_decode/speculator.py).

Greedy and seeded outputs with every method are token for token those of
plain decoding (and greedy those of Hugging Face) on the default model's real
weights, also under forced preemption (recompute and swap), with parallel
samples, stop strings, max_tokens inside an accepted run and a JSON schema;
unseeded sampling keeps the target distribution (a chi-square test); the block
manager's invariants hold after every step of a fuzzed mix with
cancellations, and nothing leaks."""
import json
import math
import random
from collections import Counter

import jsonschema
import pytest

from kv_tags import TaggingRunner
from pagedbackend import LLM, LLMEngine, SamplingParams
from pagedbackend.config import EngineConfig, SpeculativeConfig
from pagedbackend.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow

CODE = "def add(a, b):\n    return a + b\n\ndef subtract(a, b):\n    return a - b\n\ndef multiply(a, b):\n    return a * b\n"
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire."
PROMPTS = [f"Rename the function add to plus in this code and return all of it:\n{CODE}",
           f"Repeat this sentence three times: {TEXT}",
           "Write a short poem about the sea."]
# The draft methods keep speculating above their default batch limit (2): these tests check
# tokens and counters over batches of three to six sequences.
METHODS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
           "suffix": {"method": "suffix"},
           "self_int4": {"method": "self_int4", "num_speculative_tokens": 3, "disable_by_batch_size": 0},
           "draft_model": {"method": "draft_model", "model": "default", "quantization": "int8",
                           "num_speculative_tokens": 3, "disable_by_batch_size": 0}}
MAX_TOKENS = 40


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def generate(prompts, params, **settings):
    """(outputs, engine statistics) of one LLM on the default model."""
    settings = {"num_kv_blocks": 128, "compile": False, **settings}
    with LLM(model="default", **settings) as llm:
        outputs = llm.generate(prompts, params)
        return outputs, llm.engine.get_stats()


def token_ids(outputs):
    return [[o.token_ids for o in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def greedy_reference(default_model_dir):
    """Plain greedy tokens of PROMPTS, and for each of them whether every
    token is Hugging Face's greedy choice (its argmax given the tokens before
    it, up to float ties: within 1e-4 of the largest logit, relative)."""
    import torch
    from transformers import AutoModelForCausalLM
    prompts = [chat(p) for p in PROMPTS]
    outputs, _ = generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    hf_greedy = []
    for out in outputs:
        tokens = out.outputs[0].token_ids
        ids = torch.tensor([out.prompt_token_ids + tokens])
        with torch.inference_mode():
            logits = model(ids).logits[0, len(out.prompt_token_ids) - 1:-1]
        best = logits.max(dim=-1).values
        chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        hf_greedy.append(bool((chosen >= best - 1e-4 * best.abs()).all()))
    return prompts, token_ids(outputs), hf_greedy


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_tokens_equal_plain_decoding_and_hugging_face(greedy_reference, method):
    prompts, plain, hf_greedy = greedy_reference
    outputs, stats = generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                              speculative_config=METHODS[method])
    assert all(hf_greedy)
    assert token_ids(outputs) == plain
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1]
    # Fewer steps than tokens: speculation did carry several tokens a step.
    assert stats.num_steps < len(prompts) * MAX_TOKENS


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "self_int4"])
def test_greedy_tokens_survive_forced_preemption(greedy_reference, method, mode):
    prompts, plain, _ = greedy_reference
    # Two greedy candidates per prompt (copy-on-write of the shared prompt):
    # six sequences need about 48 blocks of 8; 22 force preemption.
    outputs, stats = generate(prompts, SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                              num_kv_blocks=22, block_size=8, preemption_mode=mode, swap_space_blocks=64,
                              watermark=0.0, speculative_config=METHODS[method])
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    if mode == "swap":
        assert stats.num_swap_preemptions > 0
    assert token_ids(outputs) == [ids * 2 for ids in plain]


@pytest.mark.parametrize("method", ["ngram", "self_int4"])
def test_seeded_parallel_samples_equal_plain_decoding(method):
    prompts = [chat(p) for p in PROMPTS[:2]]
    # Penalties see the drafts before each verified position as generated tokens.
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True,
                            presence_penalty=0.3, frequency_penalty=0.2)
    plain, _ = generate(prompts, params)
    spec, stats = generate(prompts, params, speculative_config=METHODS[method])
    assert token_ids(spec) == token_ids(plain)
    assert stats.spec_num_accepted_tokens > 0


def test_stop_string_and_max_tokens_inside_an_accepted_run_end_where_plain_decoding_ends():
    prompt = chat(f"Repeat this sentence three times: {TEXT}")
    reasons = []
    for params in (SamplingParams(max_tokens=60, temperature=0.0, stop=["cat sleeps"]),
                   SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)):
        plain, _ = generate([prompt], params)
        spec, stats = generate([prompt], params, speculative_config=METHODS["ngram"])
        assert stats.spec_num_accepted_tokens > 0
        assert [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in spec[0].outputs] == \
            [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in plain[0].outputs]
        reasons.append(spec[0].outputs[0].finish_reason)
    assert reasons == ["stop", "length"]


def test_a_json_schema_constrains_verified_tokens_as_it_does_plain_ones():
    schema = {"type": "object", "properties": {"sentence": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["sentence", "count"]}
    prompt = chat(f"Return JSON with the sentence '{TEXT}' and how many times it appears.")
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs={"json": schema})
    plain, _ = generate([prompt], params)
    spec, stats = generate([prompt], params, speculative_config=METHODS["self_int4"])
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert stats.spec_num_accepted_tokens > 0
    jsonschema.validate(json.loads(spec[0].outputs[0].text), schema)


def _chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of the two-sample chi-square test that ``a`` and ``b`` come
    from one distribution (categories with fewer than 10 counts pooled;
    Wilson-Hilferty approximation of the chi-square tail)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest = (total_a - sum(a[k] for k in keys), total_b - sum(b[k] for k in keys))
    cells = [(a[k], b[k]) for k in keys] + ([rest] if sum(rest) else [])
    stat = 0.0
    for x, y in cells:
        expected_a = (x + y) * total_a / (total_a + total_b)
        expected_b = (x + y) * total_b / (total_a + total_b)
        stat += (x - expected_a) ** 2 / expected_a + (y - expected_b) ** 2 / expected_b
    dof = len(cells) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_unseeded_samples_follow_the_target_distribution():
    # A repeated pattern: n-gram drafts are proposed at every position, and
    # at temperature 1.3 they are accepted only part of the time.
    prompt = chat("Count with me: one two three four five, one two three four five, one two three")
    params = SamplingParams(n=250, temperature=1.3, top_k=6, max_tokens=4, ignore_eos=True)
    settings = dict(num_kv_blocks=512, max_num_seqs=256, seed=1)
    spec_config = {**METHODS["ngram"], "prompt_lookup_min": 1, "disable_by_batch_size": 0}
    plain, _ = generate([prompt] * 4, params, **settings)
    spec, stats = generate([prompt] * 4, params, speculative_config=spec_config, **{**settings, "seed": 2})
    assert 0.1 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.95
    for position in (1, 2, 3):   # every position after the first is verified from drafts
        counts = [Counter(tuple(o.token_ids[:position + 1]) for out in outs for o in out.outputs)
                  for outs in (plain, spec)]
        assert _chi_square_p(*counts) > 0.001, (position, counts[0].most_common(5), counts[1].most_common(5))


@pytest.mark.timeout(300)   # a sequence whose computed count ran past its tokens would never finish
def test_block_invariants_hold_through_a_fuzzed_mix_with_cancellations():
    rng = random.Random(5)
    words = "red green blue cat dog sun moon tree river stone one two three four five".split()
    config = EngineConfig(model="default", num_kv_blocks=26, block_size=8, max_num_seqs=6, compile=False,
                          preemption_mode="swap", swap_space_blocks=24, watermark=0.0,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                              "prompt_lookup_min": 1, "disable_by_batch_size": 0})
    # Every slot a step reads must hold K/V of the reader's own verified
    # tokens: never a rejected draft's, never another request's.
    runner = TaggingRunner(ModelRunner(config))
    engine = LLMEngine(config, runner=runner)
    for i in range(30):
        phrase = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
        params = SamplingParams(n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 0.0, 0.8]), seed=i,
                                max_tokens=rng.randint(3, 60), ignore_eos=True,
                                cache_salt=rng.choice([None, "tenant-a"]))
        engine.add_request(f"r{i}", chat(f"Repeat after me: {phrase}. {phrase}. {phrase}."), params)
        for _ in range(rng.randint(0, 4)):
            engine.step()
            engine.block_manager.check_invariants()
        if rng.random() < 0.2:
            engine.abort_request(f"r{rng.randrange(i + 1)}")
    while engine.has_unfinished_requests():
        engine.step()
        engine.block_manager.check_invariants()
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.num_preemptions > 0 and stats.aborted_requests > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens and runner.reads_checked > 0
    assert engine.check_idle() == []
    assert not engine.speculator.proposer._index and not engine.speculator._next


@pytest.mark.parametrize("value, words", [
    ({"method": "eagle"}, ["method", "ngram"]),
    ({"method": "draft_model"}, ["model", "draft_model"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens"]),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, ["prompt_lookup_min"]),
    ({"method": "ngram", "lookahead": 3}, ["unknown", "lookahead"]),
    ('{"method": ', ["JSON"]),
    ({"method": "ngram", "disable_by_batch_size": -1}, ["disable_by_batch_size"]),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, ["suffix_decoding_max_tree_depth"]),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, ["suffix_decoding_min_token_prob"]),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, ["suffix_decoding_max_cached_requests"]),
])
def test_a_bad_speculative_config_is_refused_naming_the_field(value, words):
    with pytest.raises(ValueError) as refused:
        EngineConfig(speculative_config=value)
    assert all(w in str(refused.value) for w in words), str(refused.value)


def test_speculative_config_comes_as_json_text_from_config_pbtxt():
    from pagedbackend.config import engine_config
    config = engine_config({"speculative_config": {"string_value": '{"method": "ngram", "num_speculative_tokens": 2}'}},
                           environ={})
    assert config.speculative_config == SpeculativeConfig("ngram", num_speculative_tokens=2)
    assert engine_config({"speculative_config": ""}, environ={}).speculative_config is None


def test_verification_through_the_triton_lang_kernels_gives_plain_greedy_tokens(tiny_model_dir):
    # The draft is the tiny model itself at int8 (a random model's int4 twin
    # agrees with it too rarely); target and draft attend with the
    # Triton-lang kernels (interpreted on CPU), as on a GPU.
    prompt = [(37 * i + 11) % 900 + 50 for i in range(21)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    settings = dict(model=str(tiny_model_dir), num_kv_blocks=16, block_size=16, compile=False,
                    attention_backend="triton", device="cpu")
    with LLM(**settings) as llm:
        plain = llm.generate([prompt], params)[0].outputs[0].token_ids
    draft = {"method": "draft_model", "model": str(tiny_model_dir), "quantization": "int8", "num_speculative_tokens": 3}
    with LLM(**settings, speculative_config=draft) as llm:
        spec = llm.generate([prompt], params)[0].outputs[0].token_ids
        stats = llm.engine.get_stats()
    assert spec == plain
    assert stats.spec_num_accepted_tokens > 0 and stats.num_steps < 1 + len(plain)


def test_proposals_stop_above_the_methods_batch_limit():
    from pagedbackend.spec_decode.speculator import Speculator
    limits = {m: SpeculativeConfig(m, model="m").disable_by_batch_size
              for m in ("ngram", "suffix", "draft_model", "self_int4")}
    assert limits == {"ngram": 8, "suffix": 8, "draft_model": 2, "self_int4": 2}
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=3), proposer=None)
    assert [speculator.lookahead(n) for n in (1, 8, 9, 32)] == [3, 3, 0, 0]
    never = Speculator(SpeculativeConfig("ngram", disable_by_batch_size=0), proposer=None)
    assert never.lookahead(256) == 3
