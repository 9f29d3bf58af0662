"""KV groups through the engine: a model with full-attention and
sliding-window layers keeps a block table per group, gives windowed blocks
back as they leave the window, and still generates what Hugging Face
generates: batched, with prefix caching, under preemption (recompute and
swap), with n > 1; the ledger reports the blocks really held, and every block
is back in the pool at the end."""
import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm import merge_delta
from pagedbackend.engine.llm_engine import LLMEngine

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
PROMPT_LENGTHS = [9, 30, 52, 70]
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, default_model_dir):
    """A tiny Qwen2 with two windowed layers around a full one, its prompts and HF's tokens."""
    from runner_reference import greedy_hf, load_hf, random_prompts
    from tiny_model import build_tiny_llama
    folder = build_tiny_llama(tmp_path_factory.mktemp("mixed"), seed=5, num_hidden_layers=3, model_type="qwen2",
                              use_sliding_window=True, sliding_window=WINDOW, layer_types=LAYER_TYPES)
    prompts = random_prompts(PROMPT_LENGTHS, 49152, seed=6)
    return folder, prompts, greedy_hf(load_hf(folder), prompts, NEW_TOKENS)


def engine_for(folder, **settings) -> LLMEngine:
    base = dict(model=str(folder), block_size=8, num_kv_blocks=120, compile=False, dtype="float32",
                max_num_batched_tokens=48, long_prefill_token_threshold=16)
    return LLMEngine(EngineConfig(**{**base, **settings}))


def run(engine: LLMEngine, prompts, params=GREEDY):
    """Every request to the end; the tokens per request (per sample) and the
    most one-layer blocks the pool held after any step."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    merged, peak = {}, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            merge_delta(merged, delta)
        peak = max(peak, engine.block_manager.num_used_blocks * engine.runner.kv_layout.slots)
    assert engine.scheduler.idle_leaks() == [] and engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
    assert all(merged[str(i)].finished for i in range(len(prompts)))
    return [[o.token_ids for o in merged[str(i)].outputs] for i in range(len(prompts))], peak


def test_windowed_layers_get_their_own_groups_and_blocks_of_one_layer(mixed):
    folder, _, _ = mixed
    runner = engine_for(folder).runner
    layout = runner.kv_layout
    assert [g.window for g in layout.groups] == [None, WINDOW, WINDOW]
    assert [g.layers for g in layout.groups] == [(1,), (0,), (2,)]
    assert runner.kv_cache.shape[1] == layout.slots == 1   # a block holds one layer's K/V
    kept = engine_for(folder, disable_hybrid_kv_cache_manager=True).runner
    assert len(kept.kv_layout.groups) == 1 and kept.kv_cache.shape[1] == 3
    assert kept.kv_bytes_per_block == 3 * runner.kv_bytes_per_block


def test_groups_hold_fewer_blocks_and_generate_what_transformers_generates(mixed):
    folder, prompts, expected = mixed
    freed, freed_peak = run(engine_for(folder), prompts)
    kept, kept_peak = run(engine_for(folder, disable_hybrid_kv_cache_manager=True), prompts)
    assert [t[0] for t in freed] == [t[0] for t in kept] == expected
    assert freed_peak < kept_peak


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_windowed_groups_under_preemption(mixed, mode):
    folder, prompts, expected = mixed
    # 36 blocks of one layer for four sequences of up to 90 positions: they must take turns.
    engine = engine_for(folder, num_kv_blocks=36, preemption_mode=mode,
                        swap_space_blocks=80 if mode == "swap" else 0)
    tokens, _ = run(engine, prompts)
    stats = engine.get_stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert [t[0] for t in tokens] == expected


def test_windowed_groups_with_prefix_hits(mixed):
    folder, prompts, expected = mixed
    engine = engine_for(folder)
    first, _ = run(engine, prompts)
    # Longer prompts that start with the first ones: their prefixes are cached
    # (a windowed group maps only the blocks inside its window).
    again, _ = run(engine, [p + e[:4] for p, e in zip(prompts, expected)],
                   SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS - 4, ignore_eos=True))
    assert engine.get_stats().prefix_cache_hits > 0
    assert [t[0] for t in first] == expected
    assert [t[0] for t in again] == [e[4:] for e in expected]


def test_parallel_samples_share_and_copy_windowed_blocks(mixed):
    folder, prompts, _ = mixed
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True)
    freed, _ = run(engine_for(folder, seed=3), prompts[1:3], params)
    kept, _ = run(engine_for(folder, seed=3, disable_hybrid_kv_cache_manager=True), prompts[1:3], params)
    assert freed == kept
    assert all(len(set(map(tuple, samples))) > 1 for samples in freed)   # the samples differ


def test_the_ledger_reports_the_blocks_held(mixed):
    folder, prompts, _ = mixed
    engine = engine_for(folder)
    engine.add_request("0", prompts[-1], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats()
        assert stats.num_used_blocks == engine.block_manager.num_used_blocks
        assert stats.kv_usage == pytest.approx(stats.num_used_blocks / 120)
        seq = next((g.seqs[0] for g in engine.scheduler.running), None)
        if seq is not None and seq.num_output_tokens > 1:
            # full group: every position; the windowed groups: their window and the decode's slot
            full = -(-seq.num_tokens // 8)
            assert stats.num_used_blocks <= full + 2 * (-(-(WINDOW + 1) // 8) + 1)


def test_a_windowed_only_model_through_the_llm_api(tmp_path_factory, default_model_dir):
    from runner_reference import greedy_hf, load_hf, random_prompts
    from tiny_model import build_tiny_llama
    folder = build_tiny_llama(tmp_path_factory.mktemp("mistral"), seed=8, num_hidden_layers=2,
                              model_type="mistral", sliding_window=WINDOW)
    prompts = random_prompts([40, 66], 49152, seed=9)
    expected = greedy_hf(load_hf(folder), prompts, NEW_TOKENS)
    preemptions = {}
    for hybrid in (True, False):
        # 16 blocks of 8 positions: two sequences of 60 and 86 positions take
        # 19 blocks whole, at most 7 each while they keep only their window.
        with LLM(model=str(folder), compile=False, block_size=8, num_kv_blocks=16, max_num_batched_tokens=32,
                 long_prefill_token_threshold=16, disable_hybrid_kv_cache_manager=not hybrid) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
            preemptions[hybrid] = llm.engine.get_stats().num_preemptions
            assert llm.engine.block_manager.num_used_blocks == 0
    assert preemptions[True] == 0 and preemptions[False] > 0


def test_decode_graph_buffers_hold_every_groups_tables(mixed):
    """The CUDA-graph decode path keeps slots and block tables per KV group
    (run here without recording, ``capture=False``, on the Triton-lang
    kernels in the interpreter, as tests/worker/test_cuda_graphs.py does)."""
    from pagedbackend.worker.cuda_graphs import DecodeGraphs
    folder, prompts, expected = mixed
    engine = engine_for(folder, attention_backend="triton", max_num_batched_tokens=64,
                        long_prefill_token_threshold=64)
    graphs = engine.runner.graphs = DecodeGraphs(engine.runner, [1, 2], capture=False)
    assert len(graphs.buffers.block_tables) == len(engine.runner.kv_layout.groups) == 3
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens, _ = run(engine, prompts[1:3], params)   # 30 and 52 prompt tokens: past the window
    assert [t[0] for t in tokens] == [e[:6] for e in expected[1:3]]
    assert graphs.replays[2] > 0


def test_a_runner_with_groups_refuses_one_table_for_cached_positions(mixed):
    from pagedbackend.worker.model_runner import SeqEntry
    runner = engine_for(mixed[0]).runner
    with pytest.raises(ValueError, match="one block table for 3 KV groups"):
        runner.execute_model([SeqEntry([5], 8, [1, 2])])
    one = SeqEntry([5], 8, [1, 2], block_tables=[[1, 2], [3, 4], [5, 6]])
    assert runner.execute_model([one]).shape == (1, runner.vocab_size)
