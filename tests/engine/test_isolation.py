"""Isolation between requests, checked with content versions: every KV slot
is tagged with what was written into it (the writer's cache salt and the
tokens its K/V were computed from), copies and swaps move the tags with the
blocks, and before each step every sequence must find its own tag in every
slot it reads. A block handed to another request too early, a copy-on-write
that did not happen, a swap that came back to the wrong block or a prefix hit
across cache salts would each break it. Run on the real engine and model
runner (tiny random Llama), with prefix sharing, parallel samples, beams,
cancellations and preemption by recompute and by swap."""
import random

import pytest

from kv_tags import TaggingRunner
from pagedbackend import SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm_engine import LLMEngine
from pagedbackend.worker.model_runner import ModelRunner


def make_engine(model_dir, **overrides):
    config = EngineConfig(**{**dict(model=str(model_dir), block_size=8, num_kv_blocks=26, max_num_seqs=8,
                                    max_num_batched_tokens=96, long_prefill_token_threshold=32,
                                    device="cpu", attention_backend="torch", compile=False), **overrides})
    runner = TaggingRunner(ModelRunner(config))
    return LLMEngine(config, runner=runner), runner


FAMILIES = [[(7 * i + 3) % 900 + 50 for i in range(40)], [(11 * i + 5) % 900 + 50 for i in range(24)]]


def random_request(rng: random.Random, i: int):
    prompt = list(rng.choice(FAMILIES))[:rng.randint(9, 40)] + [rng.randint(50, 950) for _ in range(rng.randint(1, 6))]
    kind = rng.choice(["greedy", "sample", "beam", "greedy"])
    salt = rng.choice([None, None, "tenant-a", "tenant-b"])
    max_tokens = rng.randint(8, 30)
    if kind == "sample":
        params = SamplingParams(n=2, temperature=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)
    elif kind == "beam":
        params = SamplingParams(n=1, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=max_tokens,
                                ignore_eos=True, cache_salt=salt)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)
    return prompt, params


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_no_request_reads_kv_that_another_request_wrote(tiny_model_dir, mode):
    engine, runner = make_engine(tiny_model_dir, preemption_mode=mode,
                                 swap_space_blocks=64 if mode == "swap" else 0)
    rng = random.Random(3)
    live, submitted, preemptions = [], 0, 0
    for step in range(160):
        if submitted < 40 and rng.random() < 0.7:
            prompt, params = random_request(rng, submitted)
            engine.add_request(f"r{submitted}", prompt, params)
            live.append(f"r{submitted}")
            submitted += 1
        if live and rng.random() < 0.08:   # a client that goes away
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        engine.block_manager.check_invariants()
        preemptions = engine.scheduler.num_swap_preemptions + engine.scheduler.num_recompute_preemptions
    while engine.has_unfinished_requests():
        engine.step()
        engine.block_manager.check_invariants()
    assert preemptions > 0, "the pool was never short: the test did not exercise preemption"
    if mode == "swap":
        assert engine.scheduler.num_swap_preemptions > 0
    assert engine.block_manager.prefix_hits > 0, "no prefix was ever shared"
    assert runner.reads_checked > 1000
    assert engine.check_idle() == []


def test_requests_with_different_cache_salts_share_no_block(tiny_model_dir):
    engine, _ = make_engine(tiny_model_dir, num_kv_blocks=64)
    prompt = FAMILIES[0]
    params = lambda salt: SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, cache_salt=salt)  # noqa: E731
    a = engine.add_request("a", prompt, params("tenant-a"))
    b = engine.add_request("b", prompt, params("tenant-b"))
    engine.step()
    table = lambda g: set(engine.block_manager.get_block_table(g.seqs[0].seq_id))  # noqa: E731
    assert not table(a) & table(b)
    while engine.has_unfinished_requests():
        engine.step()
    # a's blocks stay cached after it ends: the same salt hits them, another salt or none does not
    same = engine.add_request("a2", prompt, params("tenant-a"))
    other = engine.add_request("c", prompt, params("tenant-c"))
    unsalted = engine.add_request("d", prompt, params(None))
    engine.step()
    assert same.metrics.num_cached_prompt_tokens > 0
    assert other.metrics.num_cached_prompt_tokens == 0 and unsalted.metrics.num_cached_prompt_tokens == 0
    assert not table(same) & (table(other) | table(unsalted))
