"""Multi-LoRA in the engine, against Hugging Face PEFT (PeftModel, greedy,
fp32) on random adapters of the tiny random Llama: each adapter alone, steps
that mix three adapters and the base model, preemption, the prefix cache
(no KV shared between adapters, no stale hit after a reload), the adapter
pool (an adapter in use is never evicted) and the host tier."""
import shutil

import pytest
import torch

from pagedbackend import LLM, InvalidRequestError, LoRARequest, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm_engine import LLMEngine
from peft_reference import PeftReference, save_random_adapter

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
SETTINGS = dict(compile=False, num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
# Ranks 4, 8 and 4 (16 pages: all three fit a pool of max_loras=2 x max_lora_rank=8).
ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8, seed=1),
    "beta": dict(r=8, lora_alpha=16, targets=["q_proj", "v_proj"], seed=2),
    "gamma": dict(r=2, lora_alpha=4, seed=3, use_rslora=True, rank_pattern={"down_proj": 4},
                  alpha_pattern={"o_proj": 8}),
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}


def prompts(n, seed=0, low=5, high=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (int(k),), generator=g).tolist()
            for k in torch.randint(low, high, (n,), generator=g)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_random_adapter(tiny_model_dir, root / name, **spec) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def requests(adapters):
    return {name: LoRARequest(name, IDS[name], path) for name, path in adapters.items()}


@pytest.fixture(scope="module")
def peft(tiny_model_dir, adapters):
    return PeftReference(tiny_model_dir, adapters)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), **SETTINGS)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_alone_equals_peft(llm, peft, requests, name):
    batch = prompts(3, seed=IDS[name])
    got = tokens(llm.generate(batch, GREEDY, lora_request=requests[name]))
    assert got == peft.greedy(batch, [name] * 3, MAX_TOKENS)
    assert got != peft.greedy(batch, [None] * 3, MAX_TOKENS)   # the adapter changes the tokens


def test_one_step_mixes_three_adapters_and_the_base_model_as_peft_does(tiny_model_dir, peft, requests):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), **SETTINGS))
    batch, names = prompts(8, seed=11), ["alpha", "beta", "gamma", None] * 2
    for i, (prompt, name) in enumerate(zip(batch, names)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora_request=requests.get(name))
    results = {}

    def collect(outputs):
        for out in outputs:
            results.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    collect(engine.step())
    assert len(engine.scheduler.running) == 8   # every request, all three adapters, one step
    assert {a.name for a in engine.lora.pool.resident} == {"alpha", "beta", "gamma"}
    while engine.has_unfinished_requests():
        collect(engine.step())
    assert [results[f"r{i}"] for i in range(8)] == peft.greedy(batch, names, MAX_TOKENS)
    assert engine.get_stats().lora_requests == {"alpha": 2, "beta": 2, "gamma": 2}


def test_long_prompts_take_the_prefill_path_and_still_equal_peft(llm, peft, requests):
    # alpha's two prompts are not adjacent in the batch (its rows are gathered),
    # gamma's one is (a slice): both at least LARGE_SEGMENT_ROWS rows, so the
    # C kernel leaves them to torch's GEMM; the base prompt is between them.
    batch, names = prompts(4, seed=15, low=70, high=100), ["alpha", None, "alpha", "gamma"]
    got = tokens(llm.generate(batch, GREEDY, lora_request=[requests.get(n) for n in names]))
    assert got == peft.greedy(batch, names, MAX_TOKENS)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_adapters_are_exact_under_preemption(tiny_model_dir, peft, requests, mode):
    batch, names = prompts(8, seed=21, low=20, high=40), ["alpha", "beta", None, "gamma"] * 2
    llm = LLM(model=str(tiny_model_dir), **{**SETTINGS, "num_kv_blocks": 14, "block_size": 8,
                                            "preemption_mode": mode, "swap_space_blocks": 64})
    got = tokens(llm.generate(batch, GREEDY, lora_request=[requests.get(n) for n in names]))
    assert llm.engine.get_stats().num_preemptions > 0
    assert got == peft.greedy(batch, names, MAX_TOKENS)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hits_stay_within_one_adapter(llm, peft, requests):
    prompt = prompts(1, seed=31, low=50, high=51)[0]   # three full blocks of 16
    first = llm.generate([prompt], GREEDY, lora_request=requests["alpha"])[0]
    again = llm.generate([prompt], GREEDY, lora_request=requests["alpha"])[0]
    other = llm.generate([prompt], GREEDY, lora_request=requests["beta"])[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_prompt_tokens == 0 and again.metrics.num_cached_prompt_tokens == 48
    assert other.metrics.num_cached_prompt_tokens == 0 and base.metrics.num_cached_prompt_tokens == 0
    assert [again.outputs[0].token_ids, other.outputs[0].token_ids, base.outputs[0].token_ids] == \
        peft.greedy([prompt] * 3, ["alpha", "beta", None], MAX_TOKENS)


def test_two_adapters_with_the_same_prompt_share_no_kv_block(tiny_model_dir, requests):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), **SETTINGS))
    prompt = prompts(1, seed=41, low=40, high=41)[0]
    groups = [engine.add_request(f"r{i}", prompt, GREEDY, lora_request=requests.get(name))
              for i, name in enumerate(["alpha", "beta", None])]
    engine.step()   # the prompt's full blocks are in the prefix cache from here on
    groups.append(engine.add_request("r3", prompt, GREEDY, lora_request=requests["alpha"]))
    engine.step()
    tables = [set(engine.block_manager.get_block_table(g.seqs[0].seq_id)) for g in groups]
    assert not tables[0] & tables[1] and not tables[0] & tables[2] and not tables[1] & tables[2]
    assert tables[0] & tables[3]   # the same adapter shares the prompt's full blocks


def test_a_reloaded_adapter_gets_no_stale_prefix_hit(tiny_model_dir, tmp_path):
    folder = tmp_path / "reloaded"
    old = save_random_adapter(tiny_model_dir, tmp_path / "v1", r=4, lora_alpha=8, seed=51)
    new = save_random_adapter(tiny_model_dir, tmp_path / "v2", r=4, lora_alpha=8, seed=52)
    shutil.copytree(old, folder)
    request = LoRARequest("reloaded", 7, str(folder))
    llm = LLM(model=str(tiny_model_dir), **SETTINGS)
    prompt = prompts(1, seed=53, low=40, high=41)[0]
    before = llm.generate([prompt], GREEDY, lora_request=request)[0]
    shutil.rmtree(folder)
    shutil.copytree(new, folder)
    llm.engine.add_lora(request, replace=True)
    after = llm.generate([prompt], GREEDY, lora_request=request)[0]
    assert after.metrics.num_cached_prompt_tokens == 0
    assert after.outputs[0].token_ids == PeftReference(tiny_model_dir, {"reloaded": new}).greedy(
        [prompt], ["reloaded"], MAX_TOKENS)[0] != before.outputs[0].token_ids
    llm.engine.add_lora(request, replace=True)   # the same weights again: their blocks still serve
    assert llm.generate([prompt], GREEDY, lora_request=request)[0].metrics.num_cached_prompt_tokens == 32


def test_the_pool_never_evicts_an_adapter_that_a_running_request_uses(tiny_model_dir, peft, requests):
    # 8 pages: alpha (4) and gamma (4) fit together, beta (8) only alone.
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), **{**SETTINGS, "max_loras": 1}))
    batch, names = prompts(9, seed=61), ["alpha", "beta", "gamma"] * 3
    for i, (prompt, name) in enumerate(zip(batch, names)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora_request=requests[name])
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        resident = set(engine.lora.pool.resident)
        assert all(g.lora in resident for g in engine.scheduler.running)
        engine.lora.pool.check()
    assert engine.lora.pool.evictions > 0
    assert [results[f"r{i}"] for i in range(9)] == peft.greedy(batch, names, MAX_TOKENS)


def test_the_host_tier_reads_an_evicted_adapter_again(tiny_model_dir, peft, requests):
    llm = LLM(model=str(tiny_model_dir), **{**SETTINGS, "max_loras": 1, "max_cpu_loras": 1})
    batch = prompts(2, seed=71)
    for name in ("alpha", "beta", "alpha"):   # beta (rank 8) takes the whole pool: alpha leaves both tiers
        assert tokens(llm.generate(batch, GREEDY, lora_request=requests[name])) == \
            peft.greedy(batch, [name] * 2, MAX_TOKENS)
    stats = llm.engine.get_stats()
    assert stats.lora_host_evictions >= 1 and stats.lora_loads == 3


def test_a_step_without_adapters_calls_no_lora_op(llm, requests):
    def lora_calls(lora_request):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompts(2, seed=81), SamplingParams(temperature=0.0, max_tokens=2),
                         lora_request=lora_request)
        return sum(e.count for e in prof.key_averages() if e.key == "pagedbackend::lora_add_")
    assert lora_calls(None) == 0
    assert lora_calls(requests["alpha"]) > 0


def test_adapter_requests_are_refused_with_the_reason(tiny_model_dir, llm, requests, adapters, tmp_path):
    plain = LLM(model=str(tiny_model_dir), compile=False, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        plain.generate([[5, 6, 7]], GREEDY, lora_request=requests["alpha"])
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is adapter 'alpha', not 'other'"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("other", 1, adapters["beta"]))
    big = save_random_adapter(tiny_model_dir, tmp_path / "big", r=16, lora_alpha=16, seed=91)
    with pytest.raises(InvalidRequestError, match="rank 16 of model.layers.0.* exceeds max_lora_rank=8"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("big", 9, big))
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("settings, message", [
    ({"tensor_parallel_size": 2}, "enable_lora does not support tensor_parallel_size > 1"),
    ({"quantization": "w8a8"}, "enable_lora does not combine with quantization=w8a8"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras \\(2\\) must be an integer >= max_loras \\(4\\)"),
    ({"max_lora_rank": 0}, "max_lora_rank must be an integer >= 1"),
])
def test_lora_settings_that_cannot_serve_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(enable_lora=True, **settings)


def test_enable_lora_takes_vllm_backends_string():
    assert EngineConfig(enable_lora="true").enable_lora is True
    assert EngineConfig(enable_lora="False").enable_lora is False
