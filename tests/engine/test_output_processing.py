"""Output processing off the step: in the online engine, detokenisation, stop
strings and deltas run in the output thread, never in the engine thread; a
stop string found there while the core has run ahead ends the sequence
where a synchronous run ends it (text, tokens, reasons, log-probabilities),
frees its blocks and counts only the tokens it returned."""
import threading
import time

import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine import AsyncLLMEngine, output_processor
from pagedbackend.engine.llm import merge_delta

SETTINGS = dict(compile=False, num_kv_blocks=128)


def stop_inside(llm, prompt, params):
    """A stop string from the middle of ``prompt``'s free greedy output (the
    end of one token and the start of the next)."""
    free = llm.generate([prompt], params)[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in free.token_ids]
    i = next(i for i in range(4, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    return pieces[i][-2:] + pieces[i + 1][:2]


def run_online(engine, requests):
    """Every request's deltas merged, as ``LLM.generate`` merges them."""
    streams = {rid: engine.add_request(rid, prompt, params) for rid, (prompt, params) in requests.items()}
    merged = {}
    for stream in streams.values():
        for delta in stream:
            merge_delta(merged, delta)
    return merged


def summary(out):
    return [(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason, o.cumulative_logprob,
             None if o.logprobs is None else [sorted((t, round(lp.logprob, 5), lp.rank, lp.decoded_token)
                                                     for t, lp in step.items()) for step in o.logprobs])
            for o in out.outputs]


@pytest.mark.timeout(300)
def test_stop_strings_found_behind_the_core_end_outputs_as_a_synchronous_run_does(tiny_model_dir, monkeypatch):
    llm = LLM(model=str(tiny_model_dir), **SETTINGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    stop_a = stop_inside(llm, "The weather", greedy)
    stop_b = stop_inside(llm, "Once upon a time", greedy)
    requests = {
        "greedy": ("The weather", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop_a],
                                                 logprobs=2)),
        "parallel": ("Once upon a time", SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=24,
                                                        ignore_eos=True, stop=[stop_b, " the"])),
        "best_of": ("Once upon a time", SamplingParams(n=1, best_of=3, temperature=0.9, seed=3, max_tokens=24,
                                                       ignore_eos=True, stop=[stop_b, " a"])),
        "plain": ("Hello", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
    }
    prompts = [p for p, _ in requests.values()]
    generated_before = llm.engine.stats.generation_tokens
    offline = dict(zip(requests, llm.generate(prompts, [p for _, p in requests.values()])))
    generated_offline = llm.engine.stats.generation_tokens - generated_before
    assert offline["greedy"].outputs[0].stop_reason == stop_a

    # The output thread sleeps on every step's reports, so the core runs
    # several steps past a stop string before it learns of it.
    decoded_in, real_process = set(), output_processor.OutputProcessor.process
    real_decode = output_processor.decode_new_text

    def slow_process(self, reports):
        time.sleep(0.03)
        return real_process(self, reports)

    def recorded_decode(*args, **kwargs):
        decoded_in.add(threading.get_ident())
        return real_decode(*args, **kwargs)
    monkeypatch.setattr(output_processor.OutputProcessor, "process", slow_process)
    monkeypatch.setattr(output_processor, "decode_new_text", recorded_decode)
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_model_dir), **SETTINGS))
    try:
        online = run_online(engine, requests)
        for rid in requests:
            assert summary(online[rid]) == summary(offline[rid]), rid
        # The last word of the output thread (tokens it dropped) reaches the core a little later.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (engine.stats().num_used_blocks or engine.engine.groups
                                               or engine.stats().generation_tokens != generated_offline):
            time.sleep(0.02)
        stats = engine.stats()
        assert stats.num_used_blocks == 0 and not engine.engine.groups and engine.engine.check_idle() == []
        engine.engine.block_manager.check_invariants()
        # Tokens generated past a stop string before the core learnt of it do not count.
        assert stats.generation_tokens == generated_offline
        assert stats.finished_requests == len(requests) and stats.failed_requests == 0
        assert decoded_in == {engine._output_thread.ident}
    finally:
        engine.shutdown()


def test_a_synchronous_step_frees_a_sequence_its_stop_string_ends_before_it_returns(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), **SETTINGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    stop = stop_inside(llm, "The weather", greedy)
    engine = llm.engine
    engine.add_request("s", "The weather", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                         stop=[stop]))
    tokens_before = engine.stats.generation_tokens
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
    assert final.outputs[0].stop_reason == stop and not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0 and engine.check_idle() == []
    assert engine.stats.generation_tokens - tokens_before == final.outputs[0].num_tokens
