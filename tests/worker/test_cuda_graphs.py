"""Decode steps replayed from CUDA graphs (``worker/cuda_graphs.py``).

Without CUDA nothing can be recorded, so the CPU tests run the same per-size
steps with ``capture=False``: the same static buffers, padding rows and
graph-safe Triton-lang kernels (interpreted), each step run directly instead
of replayed. The recording itself is checked by the CUDA test below and by
``python -m loadtest.bench gpu``.
"""
import pytest
import torch

from pagedbackend.config import EngineConfig, engine_config
from pagedbackend.worker.cuda_graphs import DecodeGraphs, capture_sizes, decode_graphs_for
from pagedbackend.worker.model_runner import ModelRunner, SeqEntry
from runner_reference import greedy_hf, greedy_paged, load_hf, random_prompts

LENGTHS = [1, 7, 16, 17, 33, 64]
# Tokens generated per prompt: every step runs the Triton-lang kernels through
# the interpreter (about 4 ms per program per loop iteration), so few; eight
# still give decode steps of 6 sequences (padded to 8) and then 3 (padded to 4).
NEW_TOKENS = 8


def make_runner(folder, **overrides) -> ModelRunner:
    settings = dict(model=str(folder), block_size=16, num_kv_blocks=64, dtype="float32",
                    device="cpu", attention_backend="triton", compile=False)
    return ModelRunner(EngineConfig(**{**settings, **overrides}))


@pytest.fixture(scope="module")
def reference(tiny_untied_model_dir):
    prompts = random_prompts(LENGTHS, 49152, seed=5)
    return tiny_untied_model_dir, prompts, greedy_hf(load_hf(tiny_untied_model_dir), prompts, NEW_TOKENS)


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1000) == capture_sizes(256)
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_padded_decode_steps_generate_what_transformers_does(reference):
    folder, prompts, expected = reference
    runner = make_runner(folder)
    assert runner.graphs is None   # nothing is recorded on a CPU
    runner.graphs = graphs = DecodeGraphs(runner, [1, 2, 4, 8], capture=False)
    assert greedy_paged(runner, prompts, NEW_TOKENS) == expected
    assert len({tuple(o) for o in expected}) == len(expected)
    # Half the prompts start a step late, so decode steps had 3 (padded to 4)
    # and 6 (padded to 8) sequences; sequences that stop at EOS shrink them.
    assert graphs.replays[4] > 0 and graphs.replays[8] > 0


def test_padding_rows_write_no_cache_slot_and_change_no_real_row(reference):
    folder, prompts, _ = reference
    runner = make_runner(folder)
    graphs = DecodeGraphs(runner, [8], capture=False)
    prompts = prompts[1:4]
    tables = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    runner.kv_cache.zero_()   # the warm-up left token 0's K/V in slot 0: a padding row's would match
    runner.execute_model([SeqEntry(p, 0, t) for p, t in zip(prompts, tables)])
    decode = [SeqEntry([5 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))]

    before = runner.kv_cache.clone()
    eager = runner.execute_model(decode)
    after_eager = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    batch = runner.prepare(decode)
    assert graphs.fits(batch)
    padded = graphs.run(batch)
    assert graphs.replays == {8: 1}
    assert padded.shape == eager.shape == (3, runner.vocab_size)
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    # The same cache slots were written, with the same K/V, and no other.
    torch.testing.assert_close(runner.kv_cache, after_eager, rtol=1e-5, atol=1e-5)
    changed = (runner.kv_cache != before).flatten(4).any(-1)   # [2, layers, blocks, slot]
    written = {(b, s) for b, s in changed.any(0).any(0).nonzero().tolist()}
    assert written == {(t[len(p) // 16], len(p) % 16) for p, t in zip(prompts, tables)}


def test_steps_a_graph_does_not_serve(reference):
    folder, prompts, _ = reference
    runner = make_runner(folder)
    graphs = DecodeGraphs(runner, [1, 2], capture=False)
    decode = [SeqEntry([7], 4, [1]), SeqEntry([8], 4, [2]), SeqEntry([9], 4, [3])]
    assert not graphs.fits(runner.prepare(decode))               # more rows than the largest size
    assert graphs.fits(runner.prepare(decode[:2]))
    assert not graphs.fits(runner.prepare([SeqEntry([7, 8], 4, [1])]))   # a prefill chunk
    assert not graphs.fits(runner.prepare([SeqEntry([7], 4, [1], need_logits=False)]))
    assert graphs.size_for(1) == 1 and graphs.size_for(2) == 2 and graphs.size_for(3) is None


def test_backends_that_plan_on_the_host_are_refused(reference):
    folder, _, _ = reference
    for backend in ("torch", "sdpa"):
        runner = make_runner(folder, attention_backend=backend)
        with pytest.raises(ValueError, match="triton"):
            DecodeGraphs(runner, [1], capture=False)
        assert decode_graphs_for(runner) is None   # CPU


def test_enforce_eager_leaves_the_step_uncompiled(reference):
    folder, _, _ = reference
    runner = make_runner(folder, attention_backend="sdpa", compile=True, enforce_eager=True)
    assert runner.compiled is None and runner.graphs is None
    assert engine_config({"enforce_eager": {"string_value": "true"}}, environ={}).enforce_eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: CUDA graphs need one")
def test_recorded_decode_graphs_generate_what_transformers_does(reference):
    folder, prompts, expected = reference
    runner = make_runner(folder, device="cuda", max_num_seqs=16)
    assert runner.graphs is not None and runner.graphs.capture
    assert runner.graphs.sizes == [1, 2, 4, 8, 16]
    assert greedy_paged(runner, prompts, NEW_TOKENS) == expected
    assert sum(runner.graphs.replays.values()) > 0
    eager = make_runner(folder, device="cuda", enforce_eager=True)
    assert eager.graphs is None and greedy_paged(eager, prompts, NEW_TOKENS) == expected
