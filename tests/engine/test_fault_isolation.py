"""A fault while handling one request ends that request alone: it gets an
error, its blocks go back, every other request finishes as if alone and the
engine goes on serving. Only a fault of the engine itself (the forward pass)
stops it, and then it says so. Whenever the engine goes idle it checks that
nothing was left behind."""
import threading
import time

import pytest

from pagedbackend import SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine import AsyncLLMEngine, EngineDeadError, LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def poison(params: SamplingParams, **fields) -> SamplingParams:
    """Change parameters that already passed validation (and the engine's
    submission checks), so that sampling itself raises for this request."""
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def run_to_end(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=8, compile=False))


@pytest.fixture(scope="module")
def alone(engine):
    """Greedy tokens of the healthy requests, each run alone."""
    results = {}
    for i, prompt in enumerate(["The sky is", "Once upon a time"]):
        engine.add_request(f"alone-{i}", prompt, GREEDY)
        results[prompt] = run_to_end(engine)[f"alone-{i}"].outputs[0].token_ids
    return results


@pytest.mark.parametrize("fault", [
    dict(logprobs=1_000_000),                          # topk beyond the vocabulary
    dict(min_tokens=1, stop_token_ids=[1_000_000_000]),  # suppression indexes past it
], ids=["logprobs-beyond-vocabulary", "stop-token-beyond-vocabulary"])
def test_a_request_whose_sampling_raises_fails_alone(engine, alone, fault):
    failed_before = engine.stats.failed_requests
    engine.add_request("ok-0", "The sky is", GREEDY)
    bad = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("bad", "Hello there", bad)
    poison(bad, **fault)
    engine.add_request("ok-1", "Once upon a time", GREEDY)

    finals = run_to_end(engine)

    assert finals["bad"].error and "sampling" in finals["bad"].error
    assert finals["bad"].outputs[0].finish_reason == "abort"
    assert finals["ok-0"].error is None and finals["ok-0"].outputs[0].token_ids == alone["The sky is"]
    assert finals["ok-1"].outputs[0].token_ids == alone["Once upon a time"]
    assert engine.stats.failed_requests == failed_before + 1
    assert engine.block_manager.num_used_blocks == 0 and engine.check_idle() == []
    engine.block_manager.check_invariants()


def test_a_request_whose_detokenisation_raises_fails_alone_and_frees_its_blocks(engine, alone, monkeypatch):
    # A detokeniser fault for one request cannot be caused through the API:
    # this stand-in decode, handed to the incremental detokeniser in place of
    # the tokenizer's, raises whenever the poisoned prompt's tokens are in the window.
    from pagedbackend.engine import detokenizer
    marker = engine.tokenizer.encode(" zebra")[-1]
    real_decode = engine.tokenizer.decode

    def decode(ids, **kw):
        if marker in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "stand-in fault")
        return real_decode(ids, **kw)
    monkeypatch.setattr(detokenizer, "_decoder", lambda tokenizer: decode)
    engine.add_request("ok", "The sky is", GREEDY)
    engine.add_request("bad", "A zebra", SamplingParams(n=3, temperature=0.8, max_tokens=12))
    finals = run_to_end(engine)
    monkeypatch.undo()

    assert "applying its tokens" in finals["bad"].error and "UnicodeDecodeError" in finals["bad"].error
    assert finals["ok"].outputs[0].token_ids == alone["The sky is"]
    assert engine.block_manager.num_used_blocks == 0 and engine.check_idle() == []
    engine.block_manager.check_invariants()


def test_the_idle_check_reports_blocks_left_behind(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, compile=False))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=3))
    run_to_end(engine)
    assert engine.check_idle() == [] and engine.stats.idle_leak_checks_failed == 0

    engine.block_manager.allocate(10 ** 9, [1, 2, 3])   # a table nobody will free

    leaks = engine.check_idle()
    assert "1 KV block(s) still in use" in leaks and "1 sequence(s) still hold a block table" in leaks
    assert engine.stats.idle_leak_checks_failed == 1


def test_the_online_engine_survives_a_failing_request_and_checks_itself_when_idle(tiny_model_dir):
    failures = []
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, compile=False),
                            on_failure=failures.append)
    try:
        bad = list(engine.add_request("bad", "Hello", poison(SamplingParams(temperature=0.0, max_tokens=12),
                                                             logprobs=1_000_000)))
        good = list(engine.add_request("good", "Hello", GREEDY))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (engine.stats().num_used_blocks or engine.stats().num_running):
            time.sleep(0.02)

        assert bad[-1].finished and "sampling" in bad[-1].error
        assert good[-1].error is None and sum(len(o.outputs[0].token_ids) for o in good) == 12
        assert engine.is_alive() and failures == []
        assert engine.stats().failed_requests == 1 and engine.stats().idle_leak_checks_failed == 0
    finally:
        engine.shutdown()


def test_a_failing_forward_pass_ends_every_stream_and_calls_on_failure_once(tiny_model_dir):
    failures = []
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, compile=False),
                            on_failure=failures.append)
    try:
        # A device fault cannot be caused on purpose here: the forward is replaced by one that
        # raises, once all three requests are in (else the third could meet a dead engine).
        all_added = threading.Event()

        def broken(entries):
            all_added.wait(10)
            raise RuntimeError("device lost")
        engine.engine.runner.execute_model = broken
        streams = [engine.add_request(f"r{i}", "Hello", GREEDY) for i in range(3)]
        all_added.set()

        finals = [list(s)[-1] for s in streams]

        assert all(f.finished and "the engine failed" in f.error and "device lost" in f.error for f in finals)
        assert len(failures) == 1 and str(failures[0]) == "device lost"
        with pytest.raises(EngineDeadError):
            engine.add_request("late", "Hello", GREEDY)
    finally:
        engine.shutdown()
