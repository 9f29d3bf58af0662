"""The model runner computes what Hugging Face transformers computes, through
shuffled paged blocks, and moves blocks exactly as asked."""
import json
import shutil
import threading
import time

import pytest
import torch

from pagedbackend.models import default_model
from pagedbackend.config import EngineConfig
from pagedbackend.worker.compiled import compile_unavailable
from pagedbackend.worker.model_runner import ModelRunner, SeqEntry
from runner_reference import greedy_hf, greedy_paged, load_hf, random_prompts, shuffled_block_tables


def make_runner(model_dir, **overrides) -> ModelRunner:
    settings = dict(model=str(model_dir), block_size=16, num_kv_blocks=128, dtype="float32",
                    device="cpu", attention_backend="torch", compile=False)
    return ModelRunner(EngineConfig(**{**settings, **overrides}))


# Lengths 1..300, several on and around block boundaries of 16 and 32.
TINY_LENGTHS = [1, 7, 16, 17, 31, 33, 64, 100, 200, 300]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir, tiny_untied_model_dir):
    refs = {}
    for name, folder in (("tied", tiny_model_dir), ("untied", tiny_untied_model_dir)):
        prompts = random_prompts(TINY_LENGTHS, 49152, seed=len(name))
        refs[name] = (folder, prompts, greedy_hf(load_hf(folder), prompts))
    return refs


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("variant", ["tied", "untied"])
@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_greedy_generation_matches_transformers_tiny(tiny_reference, variant, block_size, backend):
    folder, prompts, expected = tiny_reference[variant]
    runner = make_runner(folder, block_size=block_size, num_kv_blocks=96, attention_backend=backend)
    assert greedy_paged(runner, prompts) == expected
    assert len({tuple(o) for o in expected}) == len(expected)  # outputs differ: a real check


NO_COMPILER = compile_unavailable(torch.device("cpu"))


@pytest.mark.skipif(NO_COMPILER is not None, reason=f"torch.compile cannot run here: {NO_COMPILER}")
@pytest.mark.parametrize("cpp_wrapper", [True, False])
def test_compiled_step_matches_transformers_tiny(tiny_reference, cpp_wrapper):
    # The graph's wrapper in C++ (the default) and in inductor's Python (EngineConfig.cpp_wrapper).
    folder, prompts, expected = tiny_reference["untied"]
    runner = make_runner(folder, num_kv_blocks=96, attention_backend="sdpa", compile=True, cpp_wrapper=cpp_wrapper,
                         step_package=False)   # torch.compile in process (test_step_package.py: packages)
    assert runner.compiled is not None
    assert runner.compiled.options["cpp_wrapper"] is cpp_wrapper
    # Steps of one token (one decode) and of many use different graphs: both occur.
    assert greedy_paged(runner, prompts) == expected
    assert greedy_paged(runner, prompts[:1]) == expected[:1]


@pytest.mark.skipif(NO_COMPILER is not None, reason=f"torch.compile cannot run here: {NO_COMPILER}")
def test_compiled_steps_of_two_models_in_one_process_each_run_their_own_graphs(tiny_reference):
    """The guards on a model's modules are dropped (they never change after
    load), so each compiled step keeps its graphs apart from another model's:
    two models of different shapes, stepped in turn, each compute their own
    logits, never the other's graphs."""
    runners = {name: make_runner(tiny_reference[name][0], num_kv_blocks=96, attention_backend="sdpa",
                                 compile=True, step_package=False) for name in ("tied", "untied")}
    assert runners["tied"].compiled.forward is not runners["untied"].compiled.forward
    eager = {name: make_runner(tiny_reference[name][0], num_kv_blocks=96, attention_backend="sdpa")
             for name in runners}
    for length in (1, 5, 1, 9):   # single-token and multi-token graphs, back and forth
        for name, runner in runners.items():
            prompt = tiny_reference[name][1][-1][:length]
            entries = [SeqEntry(prompt, 0, list(range(-(-length // 16))), True)]
            got, want = runner.execute_model(entries), eager[name].execute_model(entries)
            assert got.shape == want.shape == (1, runner.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(NO_COMPILER is not None, reason=f"torch.compile cannot run here: {NO_COMPILER}")
def test_background_compile_serves_eager_at_once_then_hands_over_without_touching_the_cache(tiny_reference,
                                                                                         caplog, monkeypatch):
    """Ready with eager steps at once; the compile and its warm-up run beside
    them (on a scratch cache: no KV block a sequence may hold is written), and
    the compiled step takes over with the same greedy tokens. The compile is
    held until the test has filled the cache (a warm inductor cache compiles
    the tiny model in a second or two)."""
    folder, prompts, expected = tiny_reference["untied"]
    from pagedbackend.worker import step_source
    gate, compile_in_background = threading.Event(), step_source.compile_in_background

    def held(runner):
        gate.wait(120)
        compile_in_background(runner)
    monkeypatch.setattr(step_source, "compile_in_background", held)
    with caplog.at_level("INFO", logger="pagedbackend"):
        runner = ModelRunner(EngineConfig(model=str(folder), block_size=16, num_kv_blocks=96, dtype="float32",
                                          device="cpu", attention_backend="sdpa", compile=True,
                                          step_package=False),
                             compile_in_background=True)
        assert runner.compiled is None and runner.compile_thread.is_alive()
        eager_tokens = greedy_paged(runner, prompts[:1])   # served before any compiled step exists
        runner.kv_cache.fill_(7.0)   # every block, slot 0 of block 0 included
        gate.set()
        assert runner.wait_for_compile(timeout=600)
    assert eager_tokens == expected[:1]
    assert bool((runner.kv_cache == 7.0).all()), "the background warm-up wrote the served KV cache"
    assert runner.compiled is not None and runner.step_functions()[0] is runner.compiled.forward
    assert greedy_paged(runner, prompts) == expected
    assert any("compiled model step serves from now on" in r.getMessage() for r in caplog.records)


def test_without_a_compiler_the_step_runs_eager_and_says_so_once(tiny_reference, monkeypatch, caplog):
    from pagedbackend.worker import step_source
    folder, prompts, expected = tiny_reference["tied"]
    monkeypatch.setattr(step_source, "compile_unavailable", lambda device: "no C++ compiler on PATH")
    with caplog.at_level("WARNING", logger="pagedbackend"):
        runner = make_runner(folder, num_kv_blocks=96, attention_backend="sdpa", compile=True)
    assert runner.compiled is None
    assert [r.getMessage() for r in caplog.records] == [
        "pagedbackend: the model step runs eager: no C++ compiler on PATH"]
    assert greedy_paged(runner, prompts[:3]) == expected[:3]


DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain paged attention in one sentence.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
]


def default_prompts(tokenizer):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
             for text in DEFAULT_PROMPTS]
    prompts = [tokenizer(text).input_ids for text in chats]
    story = "Once upon a time, in a small village by the river, there lived an old clockmaker. " * 18
    prompts.append(tokenizer(story).input_ids[:300])
    prompts.append(tokenizer("The quick brown fox").input_ids)
    prompts.append([1])  # a single token: <|im_start|>
    return prompts


@pytest.fixture(scope="module")
def default_reference(default_model_dir):
    from transformers import AutoTokenizer
    prompts = default_prompts(AutoTokenizer.from_pretrained(default_model_dir))
    return prompts, greedy_hf(load_hf(default_model_dir), prompts)


@pytest.mark.slow
@pytest.mark.parametrize("block_size,backend,compiled", [(16, "sdpa", NO_COMPILER is None), (32, "torch", False)])
def test_greedy_generation_matches_transformers_default_model(default_reference, block_size, backend,
                                                              compiled):
    # The serving defaults (sdpa, compiled where a compiler exists) and the reference twin, eager.
    # The compiled step keeps inductor's Python wrapper here: g++ takes about
    # 90 s of 2 cores for the default model's C++ wrapper alone, and the C++
    # wrapper is checked against transformers on the tiny model
    # (test_compiled_step_matches_transformers_tiny).
    prompts, expected = default_reference
    runner = make_runner("default", block_size=block_size, num_kv_blocks=256 // block_size * 8,
                         attention_backend=backend, compile=compiled, cpp_wrapper=False)
    assert (runner.compiled is not None) == compiled
    assert max(map(len, prompts)) == 300 and min(map(len, prompts)) == 1
    assert greedy_paged(runner, prompts) == expected


@pytest.mark.slow
def test_default_model_output_is_sensible_text(default_reference, default_model_dir):
    from transformers import AutoTokenizer
    prompts, expected = default_reference
    text = AutoTokenizer.from_pretrained(default_model_dir).decode(expected[0])
    assert "Paris" in text


# ---- logits -------------------------------------------------------------

TINY_VARIANTS = {
    "llama": {},
    "llama-untied": dict(tie_word_embeddings=False),
    "llama3-rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}),
    "linear-rope": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2"),  # q/k/v biases
}


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def tiny_variant_dir(request, tmp_path_factory, default_model_dir):
    from tiny_model import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp(request.param), seed=2,
                            num_hidden_layers=2, **TINY_VARIANTS[request.param])


def test_prefill_and_decode_logits_match_transformers(tiny_variant_dir):
    runner, hf = make_runner(tiny_variant_dir), load_hf(tiny_variant_dir)
    prompt = random_prompts([70], runner.vocab_size, seed=3)[0]
    table = shuffled_block_tables(runner, [len(prompt) + 2], seed=4)[0]
    prefill = runner.execute_model([SeqEntry(prompt, 0, table, True)])
    next_token = int(prefill.argmax())
    decode = runner.execute_model([SeqEntry([next_token], len(prompt), table, True)])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + [next_token]])).logits[0, -2:]
    torch.testing.assert_close(prefill[0], expected[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(decode[0], expected[1], atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir):
    return make_runner(tiny_model_dir, num_kv_blocks=64, swap_space_blocks=8)


def test_prefill_in_two_chunks_matches_one_prefill(tiny_runner):
    prompt = random_prompts([50], tiny_runner.vocab_size, seed=5)[0]
    one, two = shuffled_block_tables(tiny_runner, [50, 50], seed=6)
    whole = tiny_runner.execute_model([SeqEntry(prompt, 0, one, True)])
    first = tiny_runner.execute_model([SeqEntry(prompt[:21], 0, two, False)])
    second = tiny_runner.execute_model([SeqEntry(prompt[21:], 21, two, True)])
    assert first.shape == (0, tiny_runner.vocab_size)
    torch.testing.assert_close(second, whole, atol=1e-5, rtol=1e-5)


def test_logits_come_only_for_entries_that_ask_in_entry_order(tiny_runner):
    prompts = random_prompts([5, 9, 3], tiny_runner.vocab_size, seed=7)
    tables = shuffled_block_tables(tiny_runner, [5, 9, 3], seed=8)
    alone = [tiny_runner.execute_model([SeqEntry(p, 0, t, True)])[0] for p, t in zip(prompts, tables)]
    batched = tiny_runner.execute_model([SeqEntry(prompts[0], 0, tables[0], True),
                                         SeqEntry(prompts[1], 0, tables[1], False),
                                         SeqEntry(prompts[2], 0, tables[2], True)])
    # Batched and single-row matmuls block differently: fp32 rounding differs by ~1e-5.
    torch.testing.assert_close(batched, torch.stack([alone[0], alone[2]]), atol=5e-5, rtol=1e-4)


def test_bfloat16_runner_returns_float32_logits_close_to_float32(tiny_model_dir, tiny_runner):
    runner = make_runner(tiny_model_dir, dtype="bfloat16", num_kv_blocks=8)
    entry = SeqEntry(random_prompts([40], runner.vocab_size, seed=11)[0], 0, [2, 5, 7], True)
    logits = runner.execute_model([entry])
    assert runner.kv_cache.dtype == torch.bfloat16 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, tiny_runner.execute_model([entry]), atol=0.5, rtol=0.05)


# ---- block moves --------------------------------------------------------

def fill_random(runner):
    runner.kv_cache.copy_(torch.randn_like(runner.kv_cache))
    runner.swap_cache.copy_(torch.randn_like(runner.swap_cache))
    return runner.kv_cache.clone(), runner.swap_cache.clone()


def test_copy_blocks_copies_exactly_the_named_blocks(tiny_runner):
    kv, _ = fill_random(tiny_runner)
    tiny_runner.copy_blocks([(1, 5), (2, 6), (5, 9)])
    expected = kv.clone()
    expected[:, :, [5, 6, 9]] = kv[:, :, [1, 2, 5]]  # sources read before any write
    assert torch.equal(tiny_runner.kv_cache, expected)


def test_swap_out_then_in_round_trips_blocks(tiny_runner):
    kv, swap = fill_random(tiny_runner)
    tiny_runner.swap_out([(3, 0), (7, 4)])
    expected_swap = swap.clone()
    expected_swap[:, :, [0, 4]] = kv[:, :, [3, 7]]
    assert torch.equal(tiny_runner.swap_cache, expected_swap)
    assert torch.equal(tiny_runner.kv_cache, kv)

    tiny_runner.swap_in([(4, 10), (0, 11)])
    expected_kv = kv.clone()
    expected_kv[:, :, [10, 11]] = kv[:, :, [7, 3]]
    assert torch.equal(tiny_runner.kv_cache, expected_kv)


def test_a_forked_sequence_decodes_like_a_fresh_one(tiny_runner):
    # Fork after 20 tokens (block 16): the full block is shared, the partial
    # one is copied on write; each branch then decodes its own token.
    prompt = random_prompts([20], tiny_runner.vocab_size, seed=9)[0]
    parent, child, fresh = ([0, 1], [0, 2], [3, 4])
    tiny_runner.execute_model([SeqEntry(prompt, 0, parent, False)])
    tiny_runner.copy_blocks([(1, 2)])
    forked = tiny_runner.execute_model([SeqEntry([11], 20, parent, True), SeqEntry([12], 20, child, True)])
    direct = tiny_runner.execute_model([SeqEntry(prompt + [12], 0, fresh, True)])
    torch.testing.assert_close(forked[1], direct[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(forked[0], forked[1])


# ---- tensor parallelism -------------------------------------------------

class ThreadAllReduce:
    """Sums one tensor per rank, ranks being threads (stands in for NCCL)."""

    def __init__(self, tp_size):
        self.parts = [None] * tp_size
        self.barrier = threading.Barrier(tp_size)

    def hook(self, rank):
        def reduce(x):
            self.parts[rank] = x
            self.barrier.wait()
            total = sum(self.parts)  # same order on every rank: identical results
            self.barrier.wait()  # nobody overwrites a part before all have read
            return total
        return reduce


def test_two_rank_split_computes_the_same_logits(tiny_model_dir, tiny_runner):
    # 4 query heads / 2 KV heads / 512 intermediate: 2 / 1 / 256 per rank.
    reducer = ThreadAllReduce(2)
    settings = dict(model=str(tiny_model_dir), block_size=16, num_kv_blocks=8, dtype="float32",
                    device="cpu", attention_backend="torch", compile=False)
    ranks = [ModelRunner(EngineConfig(**settings), tp_rank=r, tp_size=2, reduce=reducer.hook(r))
             for r in range(2)]
    assert ranks[0].kv_caches[0][0].shape == (8, 16, 1, 64)
    prompt = random_prompts([40], tiny_runner.vocab_size, seed=10)[0]
    logits = [None, None]

    def run(rank):
        logits[rank] = ranks[rank].execute_model([SeqEntry(prompt, 0, [3, 1, 6], True)])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    whole = tiny_runner.execute_model([SeqEntry(prompt, 0, [3, 1, 6], True)])
    torch.testing.assert_close(logits[0], whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], whole, atol=1e-4, rtol=1e-4)


def test_kv_heads_are_replicated_when_ranks_outnumber_them():
    from pagedbackend.models.linear import QKVParallelLinear
    hidden, head_dim, heads, kv_heads = 32, 8, 4, 2
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(3, hidden)
    for rank in range(4):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp_rank=rank, tp_size=4)
        for shard, weight in enumerate((q, k, v)):
            layer.load(shard, "weight", weight)
        kv_head = rank // 2  # ranks 0, 1 share KV head 0; ranks 2, 3 KV head 1
        expected = torch.cat([x @ q[rank * head_dim:(rank + 1) * head_dim].T,
                              x @ k[kv_head * head_dim:(kv_head + 1) * head_dim].T,
                              x @ v[kv_head * head_dim:(kv_head + 1) * head_dim].T], dim=-1)
        assert (layer.num_heads, layer.num_kv_heads) == (1, 1)
        torch.testing.assert_close(layer(x), expected)


# ---- sizes and errors ---------------------------------------------------

def test_kv_cache_is_sized_from_the_byte_budget(tiny_model_dir):
    runner = make_runner(tiny_model_dir, num_kv_blocks=None, kv_cache_bytes=10 * 65536 + 5)
    # 2 (K, V) x 4 layers x 16 positions x 2 KV heads x 64 dims x 4 bytes = 65536
    assert runner.kv_bytes_per_block == 65536
    assert runner.num_kv_blocks == 10
    assert runner.kv_caches[0][0].shape == (10, 16, 2, 64)
    assert runner.max_model_len == 512 and not hasattr(runner, "tokenizer")


def test_too_small_kv_budget_says_what_one_block_needs(tiny_model_dir):
    with pytest.raises(ValueError, match="too small for one KV block: a block needs 65536 bytes"):
        make_runner(tiny_model_dir, num_kv_blocks=None, kv_cache_bytes=65535)


def test_token_outside_vocabulary_is_named(tiny_runner):
    with pytest.raises(ValueError, match=r"token id 49152 is outside the vocabulary \(size 49152\)"):
        tiny_runner.execute_model([SeqEntry([5, 49152], 0, [0], True)])


def test_short_block_table_is_refused(tiny_runner):
    with pytest.raises(ValueError, match="block table has 1 blocks, 20 positions need 2"):
        tiny_runner.execute_model([SeqEntry([5] * 10, 10, [0], True)])


def test_missing_model_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_runner(tmp_path / "nowhere")


def test_folder_without_config_or_weights_is_refused(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        make_runner(tmp_path)
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="has no \\*.safetensors weights"):
        make_runner(tmp_path)


def test_unsupported_architecture_is_named(tmp_path, tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_model_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unsupported architecture.*model_type='gpt2'"):
        make_runner(tmp_path)


# ---- the default model folder -------------------------------------------

def test_default_model_folder_loads_in_transformers_and_is_reused(default_model_dir):
    from transformers import AutoConfig, AutoTokenizer
    written = {f.name: f.stat().st_mtime_ns for f in default_model_dir.iterdir()}
    again = default_model.resolve_model_path("default")
    # Reused as it is: nothing in the folder was written again.
    assert again == default_model_dir
    assert {f.name: f.stat().st_mtime_ns for f in again.iterdir()} == written
    assert AutoConfig.from_pretrained(again).num_hidden_layers == 30
    tokenizer = AutoTokenizer.from_pretrained(again)
    assert tokenizer.chat_template and len(tokenizer) == 49152


def test_concurrent_preparations_convert_once(tmp_path, monkeypatch):
    calls = []

    def fake_convert(gguf_dir, out_dir):
        calls.append(out_dir)
        time.sleep(0.2)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setenv("PAGEDBACKEND_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "_convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model.prepare_default_model()))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / default_model.DEFAULT_MODEL_NAME] * 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [default_model.DEFAULT_MODEL_NAME]


def test_failed_preparation_leaves_no_folder_behind(tmp_path, monkeypatch):
    def broken_convert(gguf_dir, out_dir):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setenv("PAGEDBACKEND_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "_convert_gguf", broken_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model.prepare_default_model()
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_a_failed_compile_is_named_by_its_inner_error():
    # inductor's BackendCompilerFailed says only which backend raised on its first line.
    from torch._dynamo.exc import BackendCompilerFailed
    from pagedbackend.worker.compiled import compile_failure
    inner = UnicodeDecodeError("ascii", b"\xe2", 0, 1, "ordinal not in range(128)")
    try:
        try:
            raise inner
        except UnicodeDecodeError as exc:
            raise BackendCompilerFailed(lambda: None, exc, None) from exc
    except BackendCompilerFailed as wrapped:
        assert str(wrapped).splitlines()[0].startswith("backend=")
        assert compile_failure(wrapped) == (
            "UnicodeDecodeError: 'ascii' codec can't decode byte 0xe2 in position 0: "
            "ordinal not in range(128)")
    assert compile_failure(RuntimeError("\n  no compiler\nmore")) == "RuntimeError: no compiler"
