"""Engine: continuous batching, preemption, parallel sampling, beam search,
prefix sharing, stops and aborts, on a tiny random Llama compared with Hugging Face."""
import pytest
import torch

from pagedbackend import InvalidRequestError, LLM, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm import merge_delta
from pagedbackend.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
# The compiled step has tests of its own (test_model_runner.py); eager keeps these fast.
EAGER = {"compile": False}


def make_prompts(n, seed=0, low=3, high=60):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(100, 40000, (n_tok,), generator=g).tolist() for n_tok in lengths]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return trim_at_eos(out[0, len(prompt):].tolist(), model.generation_config.eos_token_id)


def trim_at_eos(ids, eos):
    eos = {eos} if isinstance(eos, int) else set(eos)
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    prompts = make_prompts(12, seed=1)
    return prompts, [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]


def run(model_dir, prompts, params, **kw):
    llm = LLM(model=str(model_dir), **{**EAGER, **kw})
    outs = llm.generate(prompts, params)
    return llm, outs


def test_greedy_batch_equals_hugging_face(tiny_model_dir, hf_reference):
    prompts, expected = hf_reference
    llm, outs = run(tiny_model_dir, prompts, GREEDY, num_kv_blocks=256, block_size=16)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.get_stats().num_preemptions == 0
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_is_identical_under_forced_preemption(tiny_model_dir, hf_reference, mode):
    prompts, expected = hf_reference
    # 12 sequences of up to ~84 tokens need ~70 blocks of 8; 24 blocks force preemption.
    llm, outs = run(tiny_model_dir, prompts, GREEDY, num_kv_blocks=24, block_size=8,
                    preemption_mode=mode, swap_space_blocks=64 if mode == "swap" else 0)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swap_preemptions > 0
    else:
        assert stats.num_recompute_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.block_manager.num_free_swap_blocks == llm.engine.block_manager.num_swap_blocks


def test_swap_mode_falls_back_to_recompute_when_host_space_is_short(tiny_model_dir, hf_reference):
    prompts, expected = hf_reference
    llm, outs = run(tiny_model_dir, prompts, GREEDY, num_kv_blocks=24, block_size=8,
                    preemption_mode="swap", swap_space_blocks=4)
    stats = llm.engine.get_stats()
    assert stats.num_recompute_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_chunked_prefill_with_a_small_token_budget_gives_the_same_tokens(tiny_model_dir, hf_reference):
    prompts, expected = hf_reference
    llm, outs = run(tiny_model_dir, prompts, GREEDY, num_kv_blocks=256, max_num_batched_tokens=16,
                    max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_seeded_sampling_is_reproducible_and_survives_preemption(tiny_model_dir):
    prompts = make_prompts(8, seed=2)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=16)
    _, a = run(tiny_model_dir, prompts, params, num_kv_blocks=256)
    _, b = run(tiny_model_dir, prompts[::-1], params, num_kv_blocks=256)
    llm, c = run(tiny_model_dir, prompts, params, num_kv_blocks=16, block_size=8)
    assert llm.engine.get_stats().num_preemptions > 0
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]
    assert ids(a) == ids(b)[::-1] == ids(c)
    other = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=99, max_tokens=16)
    _, d = run(tiny_model_dir, prompts, other, num_kv_blocks=256)
    assert ids(d) != ids(a)


def test_parallel_samples_share_the_prompt_blocks(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=64, block_size=16,
                                    enable_prefix_caching=False))
    prompt = make_prompts(1, seed=3, low=40, high=41)[0]   # 40 tokens: 2 full blocks + 8
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    engine.add_request("r", prompt, params)
    engine.step()    # prefill, sample 4 first tokens, fork
    assert engine.block_manager.num_used_blocks == 3          # forked: nothing copied yet
    engine.step()    # each sample writes its 2nd token: the partly filled block is copied 3 times
    assert engine.block_manager.num_used_blocks == 2 + 4
    assert engine.block_manager.num_shared_blocks == 2
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_parallel_sampling_with_a_seed_is_reproducible(tiny_model_dir):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)
    _, a = run(tiny_model_dir, ["Once upon a time"], params, num_kv_blocks=64)
    _, b = run(tiny_model_dir, ["Once upon a time"], params, num_kv_blocks=64)
    texts = [o.token_ids for o in a[0].outputs]
    assert texts == [o.token_ids for o in b[0].outputs]
    assert len(texts) == 3 and len({tuple(t) for t in texts}) == 3


def test_best_of_returns_the_n_most_likely_candidates(tiny_model_dir):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=5, max_tokens=8)
    _, outs = run(tiny_model_dir, ["Hello"], params, num_kv_blocks=64)
    got = outs[0].outputs
    assert len(got) == 2 and got[0].cumulative_logprob >= got[1].cumulative_logprob


@pytest.mark.parametrize("width,n", [(2, 2), (4, 2), (3, 3)])
def test_beam_search_equals_hugging_face(tiny_model_dir, hf_model, width, n):
    prompts = make_prompts(3, seed=4, low=5, high=30)
    params = SamplingParams(n=n, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=10)
    llm, outs = run(tiny_model_dir, prompts, params, num_kv_blocks=128, block_size=8)
    eos = hf_model.generation_config.eos_token_id
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n,
                                    do_sample=False, max_new_tokens=10, early_stopping=False,
                                    length_penalty=1.0,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected = [trim_at_eos(r[len(prompt):].tolist(), eos) for r in ref]
        assert [o.token_ids for o in out.outputs] == expected
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("early_stopping,length_penalty", [(True, 1.0), ("never", 1.0), ("never", 2.0),
                                                             (False, 0.5)])
def test_beam_search_stopping_rules_equal_hugging_face(tiny_model_dir, hf_model, early_stopping, length_penalty):
    prompts = make_prompts(3, seed=5, low=5, high=30)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=12,
                            early_stopping=early_stopping, length_penalty=length_penalty)
    llm, outs = run(tiny_model_dir, prompts, params, num_kv_blocks=128, block_size=8)
    eos = hf_model.generation_config.eos_token_id
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=2,
                                    do_sample=False, max_new_tokens=12, early_stopping=early_stopping,
                                    length_penalty=length_penalty,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert [o.token_ids for o in out.outputs] == [trim_at_eos(r[len(prompt):].tolist(), eos) for r in ref]


def test_beam_search_shares_blocks_and_frees_dropped_beams(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=64, block_size=8,
                                    enable_prefix_caching=False))
    prompt = make_prompts(1, seed=5, low=20, high=21)[0]  # 3 blocks (8 + 8 + 4)
    engine.add_request("b", prompt, SamplingParams(n=4, use_beam_search=True, temperature=0.0,
                                                   max_tokens=12, ignore_eos=True))
    peak_shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        bm = engine.block_manager
        peak_shared = max(peak_shared, bm.num_shared_blocks)
        live = engine.groups["b"].seqs if "b" in engine.groups else []
        if len(live) == 4:
            # 4 beams never hold 4 private copies of the prompt: its full blocks stay shared.
            assert bm.num_used_blocks < 4 * len(bm.get_block_table(live[0].seq_id))
    assert peak_shared >= 2
    assert engine.block_manager.num_used_blocks == 0


def test_mixed_decoding_batches_different_algorithms_in_one_step(tiny_model_dir, hf_reference):
    prompts, expected = hf_reference
    llm = LLM(model=str(tiny_model_dir), compile=False, num_kv_blocks=256)
    params = [GREEDY, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10),
              SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=10), GREEDY]
    outs = llm.generate([prompts[0], prompts[1], prompts[2], prompts[3]], params)
    assert outs[0].outputs[0].token_ids == expected[0]
    assert outs[3].outputs[0].token_ids == expected[3]
    assert len(outs[1].outputs) == 2 and len(outs[2].outputs) == 2


def test_prefix_cache_skips_the_shared_prefix(tiny_model_dir):
    prefix = make_prompts(1, seed=6, low=80, high=81)[0]
    prompts = [prefix + tail for tail in make_prompts(6, seed=7, low=5, high=20)]
    llm, cached = run(tiny_model_dir, prompts[:1], GREEDY, num_kv_blocks=256)
    outs = llm.generate(prompts, GREEDY)
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits >= 5 * 80 // 16 * 16
    _, uncached = run(tiny_model_dir, prompts, GREEDY, num_kv_blocks=256, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in uncached]


def test_stop_string_spanning_tokens_ends_the_output(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), compile=False, num_kv_blocks=64)
    free = llm.generate(["The weather"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    text = free.outputs[0].text
    # A stop string made of the end of one token and the start of the next.
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in free.outputs[0].token_ids]
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    cut = text.find(stop)
    out = llm.generate(["The weather"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                       stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    kept = llm.generate(["The weather"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                        stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[:cut + len(stop)]


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), compile=False, num_kv_blocks=64)
    free = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    stop_id = ids[5]
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))
    first = ids.index(stop_id)
    assert out[0].outputs[0].token_ids == ids[:first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop_id
    assert free.outputs[0].finish_reason == "length" and len(ids) == 12
    later = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=first + 2,
                                                   stop_token_ids=[ids[first]]))
    assert len(later[0].outputs[0].token_ids) >= first + 2


def test_cumulative_logprob_is_computed_only_for_requests_that_ask(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    plain = engine.add_request("plain", "Hi", params)
    asked = engine.add_request("asked", "Hi", params, cumulative_logprob=True)
    assert asked.wants_logprob
    merged = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            merge_delta(merged, delta)
    outputs = {request_id: out.outputs[0] for request_id, out in merged.items()}
    with_logprobs = LLM(model=str(tiny_model_dir), compile=False, num_kv_blocks=64).generate(
        ["Hi"], SamplingParams(temperature=0.0, max_tokens=6, logprobs=0))[0].outputs[0]

    assert outputs["plain"].cumulative_logprob is None and not plain.wants_logprob
    assert outputs["asked"].token_ids == outputs["plain"].token_ids == with_logprobs.token_ids
    expected = sum(top[t].logprob for t, top in zip(with_logprobs.token_ids, with_logprobs.logprobs))
    assert expected < 0 and abs(outputs["asked"].cumulative_logprob - expected) < 1e-4


def test_logprobs_are_returned_for_each_token(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), compile=False, num_kv_blocks=64)
    out = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    tokenizer = llm.get_tokenizer()
    for tok, top in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and next(iter(top)) == tok       # the sampled token first, as vLLM
        assert top[tok].rank == 1 and max(e.logprob for e in top.values()) == top[tok].logprob
        assert sorted(e.rank for e in top.values()) == [1, 2, 3]
        assert all(e.decoded_token == tokenizer.decode([t]) for t, e in top.items())
    assert abs(sum(top[t].logprob for t, top in zip(out.token_ids, out.logprobs))
               - out.cumulative_logprob) < 1e-4


def test_abort_mid_generation_returns_every_block(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=64))
    engine.add_request("a", "A long story", SamplingParams(max_tokens=200, n=2, temperature=1.0))
    engine.add_request("b", "Short", SamplingParams(max_tokens=4, temperature=0.0))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    final = engine.abort_request("a")
    assert final.finished and all(o.finish_reason == "abort" for o in final.outputs)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_a_request_that_cannot_fit_is_rejected_while_others_finish(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), compile=False, num_kv_blocks=8, block_size=16)
    assert llm.engine.max_model_len == 96   # capped: one sequence must fit the 8-block pool
    with pytest.raises(InvalidRequestError, match="KV blocks"):   # 3 prompt + 2 x 4 output blocks
        llm.generate([list(range(100, 140))], SamplingParams(n=2, temperature=0.8, max_tokens=40))
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="not an integer in the vocabulary"):
        llm.generate([[5, 10 ** 6]], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], GREEDY)
    outs = llm.generate(["fine", "also fine"], SamplingParams(max_tokens=5, temperature=0.0))
    assert all(len(o.outputs[0].token_ids) == 5 or o.outputs[0].finish_reason == "stop" for o in outs)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_online_engine_is_built_in_the_thread_that_steps_it(tiny_model_dir, monkeypatch):
    """Loading and stepping in one thread keeps one OpenMP team (see
    ``async_engine``'s docstring). A subclass records where the real engine's
    constructor and steps ran."""
    import threading

    from pagedbackend.engine import async_engine
    where = {"init": set(), "step": set()}

    class Recorded(LLMEngine):
        def __init__(self, *args, **kwargs):
            where["init"].add(threading.get_ident())
            super().__init__(*args, **kwargs)

        def core_step(self):
            where["step"].add(threading.get_ident())
            return super().core_step()

    monkeypatch.setattr(async_engine, "LLMEngine", Recorded)
    engine = async_engine.AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False,
                                                      num_kv_blocks=64))
    try:
        assert len(list(engine.add_request("t", "Tell me", GREEDY))) > 1
        assert where["init"] == where["step"] == {engine._thread.ident}
        assert engine._thread.ident != threading.get_ident()
    finally:
        engine.shutdown()


def test_online_engine_that_cannot_load_raises_in_the_caller(tmp_path):
    from pagedbackend import AsyncLLMEngine
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    before = threading_count()
    with pytest.raises(Exception) as raised:
        AsyncLLMEngine(EngineConfig(model=str(tmp_path), compile=False, num_kv_blocks=8))
    with pytest.raises(type(raised.value)):   # the same error as the offline engine's
        LLMEngine(EngineConfig(model=str(tmp_path), compile=False, num_kv_blocks=8))
    assert threading_count() == before   # no engine thread left behind


def threading_count() -> int:
    import threading
    return sum(t.name == "pagedbackend-engine" for t in threading.enumerate())


def test_online_engine_streams_deltas_that_add_up_to_the_offline_text(tiny_model_dir):
    import asyncio

    from pagedbackend import AsyncLLMEngine
    config = EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=64)
    offline = LLM(model=str(tiny_model_dir), compile=False, num_kv_blocks=64).generate(["Tell me"], GREEDY)[0].outputs[0]
    engine = AsyncLLMEngine(config)
    try:
        async def collect():
            text, ids, count = "", [], 0
            async for delta in engine.add_request("s", "Tell me", GREEDY):
                text += delta.outputs[0].text
                ids += delta.outputs[0].token_ids
                count += 1
            return text, ids, count
        text, ids, count = asyncio.run(collect())
        assert (text, ids) == (offline.text, offline.token_ids) and count > 1
        stream = engine.add_request("x", "Tell me", SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))
        next(stream)
        engine.abort("x")
        assert list(stream)[-1].outputs[0].finish_reason == "abort"
        for _ in range(100):
            if engine.stats().num_used_blocks == 0:
                break
            import time
            time.sleep(0.02)
        assert engine.stats().num_used_blocks == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("scheme", ["max", "pow2", "oracle"])
def test_reservation_baselines_reserve_what_the_accounting_module_says(tiny_model_dir, scheme):
    from pagedbackend.accounting import reserved_positions
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=128, block_size=16,
                                    kv_reservation=scheme, enable_prefix_caching=False,
                                    max_model_len=512))
    prompt = list(range(100, 137))   # 37 tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=54, temperature=0.0, ignore_eos=True))
    engine.step()
    reserved = reserved_positions(scheme, 37 + 54, 512)
    assert engine.block_manager.num_used_blocks == -(-reserved // 16)
    stats = engine.get_stats()
    assert stats.stored_positions == 37 and stats.allocated_slots == -(-reserved // 16) * 16
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_paged_mode_holds_only_the_blocks_its_tokens_fill(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=128, block_size=16,
                                    enable_prefix_caching=False))
    engine.add_request("r", list(range(100, 137)), SamplingParams(max_tokens=54, temperature=0.0))
    engine.step()
    assert engine.block_manager.num_used_blocks == 3   # 37 prompt positions
    assert engine.get_stats().stored_positions == 37


@pytest.mark.parametrize("settings,named", [
    (dict(kv_reservation="contiguous"), "kv_reservation must be one of"),
    (dict(block_size=24), "block_size must be a power of two"),
    (dict(dtype="float64"), "dtype must be one of auto, float32, float16, bfloat16"),
    (dict(preemption_mode="pause"), "preemption_mode must be one of recompute, swap"),
    (dict(attention_backend="flash"), "attention_backend must be one of"),
    (dict(watermark=1.0), r"watermark must be in \[0, 1\)"),
    (dict(native_ops="0"), "native_ops must be true or false"),
    (dict(cpp_wrapper=None), "cpp_wrapper must be true or false"),
    (dict(int8_bf16="auto"), "int8_bf16 must be true, false or None"),
    (dict(tp_timeout_s=0), "tp_timeout_s must be > 0 seconds"),
    (dict(tp_rendezvous_s=-1.0), "tp_rendezvous_s must be > 0 seconds"),
    (dict(tp_local_size=0), "tp_local_size must be >= 1"),
])
def test_engine_settings_are_checked_once_in_the_config_naming_the_field(settings, named):
    """EngineConfig is the one place the engine checks its settings: a bad
    one is refused before any model loads, naming the field."""
    with pytest.raises(ValueError, match=named):
        EngineConfig(**settings)


def test_engine_settings_unknown_names_are_refused():
    with pytest.raises(TypeError, match="unknown engine setting"):
        EngineConfig.from_kwargs(blocksize=16)


def test_an_engine_failure_reaches_every_open_stream_and_refuses_new_requests(tiny_model_dir):
    """A device fault cannot be caused on purpose here, so the runner's forward is
    replaced by one that raises (the only stand-in in this file)."""
    from pagedbackend.engine import AsyncLLMEngine, EngineDeadError
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=64))
    try:
        def broken(entries):
            raise RuntimeError("device lost")
        engine.engine.runner.execute_model = broken
        stream = engine.add_request("f", "Hello", GREEDY)
        final = list(stream)[-1]
        assert final.finished and "device lost" in final.error
        with pytest.raises(EngineDeadError, match="engine has failed"):
            engine.add_request("g", "Hello", GREEDY)
        assert not engine.is_alive()
    finally:
        engine.shutdown()


def first_token_steps(model_dir, policy: str, num_kv_blocks: int):
    """Low-priority requests fill the pool; high-priority ones arrive every 3
    steps. Returns (steps from arrival to first token of each high one, every
    request's greedy tokens)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), compile=False, num_kv_blocks=num_kv_blocks,
                                    block_size=8, max_num_seqs=16, scheduling_policy=policy))
    prompts = make_prompts(10, seed=9, low=20, high=40)
    low = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, priority=10)
    high = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, priority=0)
    for i in range(6):
        engine.add_request(f"low{i}", prompts[i], low)
    arrived, first, tokens, step = {}, {}, {}, 0
    while engine.has_unfinished_requests() or len(arrived) < 4:
        if step % 3 == 0 and step >= 6 and len(arrived) < 4:
            name = f"high{len(arrived)}"
            engine.add_request(name, prompts[6 + len(arrived)], high)
            arrived[name] = step
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.request_id in arrived and out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = step - arrived[out.request_id]
        step += 1
        assert step < 2000
    return first, tokens, engine


def test_priority_requests_start_sooner_under_a_full_pool_and_everyone_finishes_unchanged(tiny_model_dir):
    fcfs_first, fcfs_tokens, _ = first_token_steps(tiny_model_dir, "fcfs", 30)
    prio_first, prio_tokens, engine = first_token_steps(tiny_model_dir, "priority", 30)
    _, reference, _ = first_token_steps(tiny_model_dir, "fcfs", 400)   # no pressure, no preemption
    assert len(prio_first) == len(fcfs_first) == 4
    assert sum(prio_first.values()) * 3 <= sum(fcfs_first.values()), (prio_first, fcfs_first)
    assert engine.scheduler.num_recompute_preemptions > 0
    assert prio_tokens == reference and fcfs_tokens == reference   # every request finished, same greedy tokens
    assert engine.check_idle() == []


def hf_prompt_logprobs(model, prompt):
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("caching,threshold", [(True, 0), (False, 0), (True, 7)])
def test_prompt_logprobs_equal_hugging_face_with_caching_and_chunked_prefill(tiny_model_dir, hf_model, caching,
                                                                             threshold):
    prompts = make_prompts(3, seed=21, low=20, high=50)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=64, block_size=8,
                                    enable_prefix_caching=caching, long_prefill_token_threshold=threshold))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    got = {}

    def run():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    assert out.request_id not in got, "prompt log-probabilities sent twice"
                    got[out.request_id] = out.prompt_logprobs
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    run()
    # The first prompt again: with caching on its blocks are cached now, and it
    # must still be scored whole (a cached prefix has no logits).
    engine.add_request("r3", prompts[0], params)
    run()
    assert sorted(got) == ["r0", "r1", "r2", "r3"]
    for i, prompt in enumerate(prompts + prompts[:1]):
        expected = hf_prompt_logprobs(hf_model, prompt)
        entries = got[f"r{i}"]
        assert len(entries) == len(prompt) and entries[0] is None
        for p in range(1, len(prompt)):
            token, row = prompt[p], expected[p - 1]
            mine = entries[p]
            assert list(mine)[0] == token
            assert abs(mine[token].logprob - float(row[token])) < 1e-4
            # the rank, up to tokens within float error of the prompt token's log-probability
            value = float(row[token])
            assert int((row > value + 1e-4).sum()) + 1 <= mine[token].rank <= int((row > value - 1e-4).sum()) + 1
            top = row.topk(3).indices.tolist()
            assert [t for t in mine if t != token] == [t for t in top if t != token][:len(mine) - 1]
            assert all(abs(mine[t].logprob - float(row[t])) < 1e-4 for t in mine)
    assert engine.block_manager.num_used_blocks == 0


def test_prompt_logprobs_zero_gives_the_prompt_token_alone_and_others_pay_nothing(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), compile=False, num_kv_blocks=64))
    prompt = make_prompts(1, seed=2, low=12, high=13)[0]
    engine.add_request("with", prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    engine.add_request("without", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert all(len(step) == 1 for step in outs["with"][-1].prompt_logprobs[1:])
    assert all(o.prompt_logprobs is None for o in outs["without"])
