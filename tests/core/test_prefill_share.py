"""Prefill chunks sized by time: the step-cost fit recovers its fixed and
per-token parts; while sequences decode or requests wait, a prompt's chunk is
what the time-per-output-token target leaves, given to the prefilling and
waiting requests shortest first (at least MIN_CHUNK; a prompt whose rest fits a
step of FINISH_TARGETS targets in full); with nothing decoding and nobody
waiting it is the configured chunk again; steps that keep pace under the
target bank the time they leave, and the next prompt may spend it. On the tiny model, a long prompt's
chunks shrink while another request decodes and grow back once it is done,
and greedy tokens do not change."""
import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.engine.llm import merge_delta
from pagedbackend.core.prefill_share import CREDIT_TARGETS, FINISH_TARGETS, MIN_CHUNK, MIN_STEPS, PrefillShare


def fitted(a: float, b: float, sizes) -> PrefillShare:
    share = PrefillShare(target_s=0.1, max_chunk=256)
    for n in sizes:
        share.observe(n, a + b * n)
    return share


def test_the_fit_recovers_the_step_cost_and_weighs_recent_steps_most():
    a, b = fitted(0.05, 0.002, [1, 40, 8, 256, 17, 100]).cost()
    assert a == pytest.approx(0.05) and b == pytest.approx(0.002)
    share = fitted(0.05, 0.002, [1, 40, 8, 256] * 5)
    for n in [1, 40, 8, 256] * 20:   # the machine got twice as slow
        share.observe(n, 2 * (0.05 + 0.002 * n))
    assert share.cost()[1] == pytest.approx(0.004, rel=0.05)


def test_steps_of_one_size_put_the_whole_cost_on_the_tokens():
    a, b = fitted(0.05, 0.002, [10] * 5).cost()
    assert a == 0.0 and b == pytest.approx(0.007)


def test_the_share_is_what_the_target_leaves_after_the_decodes_shortest_prompt_first():
    share = fitted(0.05, 0.001, [1, 50, 200, 3])   # a 50-token step takes the target of 0.1 s
    assert share.share(10) == 40 and share.share(10, FINISH_TARGETS) == 340
    assert share.caps(decode_tokens=10, prompts=[(7, 300)], waiting=0) == {7: 40}
    # shortest first, ties in scheduling order; a prompt whose rest fits a step of
    # FINISH_TARGETS targets is finished; the others get what is left, at least MIN_CHUNK
    assert share.caps(10, [(7, 300), (8, 30), (9, 30)], waiting=2) == {8: 30, 9: 30, 7: MIN_CHUNK}
    assert share.caps(10, [(7, 300), (8, 200), (9, 200)], waiting=2) == {8: 200, 9: MIN_CHUNK, 7: MIN_CHUNK}
    assert share.caps(10, [(7, 300), (8, 20)], waiting=1) == {8: 20, 7: 20}
    assert share.caps(10, [(7, 300, 0), (8, 20, 1)], waiting=1) == {7: 40, 8: 20}   # priority first
    assert share.caps(10, [(7, 300, 0), (8, 301, 1)], waiting=1) == {7: 40, 8: MIN_CHUNK}
    assert share.caps(45, [(7, 300)], waiting=0) == {7: MIN_CHUNK}
    assert share.caps(0, [(7, 300)], waiting=0) is None   # grows back: nothing to keep pace for
    # nothing decodes but requests wait: at least the configured chunk, shortest first
    assert share.caps(0, [(7, 3000), (8, 200), (9, 200)], waiting=2) == {8: 200, 9: 56, 7: MIN_CHUNK}
    assert fitted(0.001, 0.0001, [1, 50, 200]).caps(1, [(7, 1000)], 0) == {7: 256}   # never above the configured chunk
    assert fitted(0.05, 0.001, [1] * (MIN_STEPS - 1)).caps(1, [(7, 300)], 0) is None


def test_decode_steps_under_the_target_bank_time_that_a_newcomer_spends_at_once():
    a, b = 0.05, 0.001   # a 50-token step takes the target of 0.1 s
    share = fitted(a, b, [1, 50, 200, 3])
    assert share.share(decode_tokens=8) == 42 and share.credit == 0.0
    share.caps(8, [(1, 300)], 0)
    share.observe(50, 0.1)           # a step at the target banks nothing
    assert share.credit == 0.0
    share.caps(8, [], 0)
    share.observe(8, a + 8 * b)
    assert share.credit == pytest.approx(0.042)
    assert share.share(decode_tokens=8) in (83, 84)   # 42 more tokens fit
    for _ in range(5):               # 8 streams decoding alone: 0.058 s a step, 0.042 s banked each
        share.caps(8, [], 0)
        share.observe(8, a + 8 * b)
    assert share.credit == pytest.approx(CREDIT_TARGETS * 0.1)   # at most two targets' worth
    assert share.caps(8, [(5, 200)], waiting=1) == {5: 200}      # a 200-token prompt in one step
    share.observe(208, a + 208 * b)  # that step overran the target by 0.158 s: the credit is spent
    assert share.credit == pytest.approx(0.042)
    share.caps(8, [(5, 10)], 0)
    share.observe(50, 0.5)           # an overrun beyond the credit leaves no debt behind
    assert share.credit == 0.0
    alone = fitted(a, b, [1, 50, 200, 3])
    assert alone.caps(0, [(1, 300)], 0) is None
    alone.observe(8, 0.01)           # a step sized for nobody's pace banks nothing
    assert alone.credit == 0.0


def test_a_long_prompt_computes_small_chunks_while_another_request_decodes(tiny_model_dir):
    prompt = list(range(100, 500))   # 400 tokens
    params = SamplingParams(max_tokens=4, temperature=0)
    alone = LLM(str(tiny_model_dir), num_kv_blocks=128, compile=False).generate([prompt], params)[0]
    engine = LLM(str(tiny_model_dir), num_kv_blocks=128, compile=False,
                 tpot_target_s=1e-6).engine   # a target no step meets: the smallest chunks
    engine.add_request("warm", "Hello", SamplingParams(max_tokens=MIN_STEPS + 1, temperature=0))
    while engine.has_unfinished_requests():   # steps measured
        engine.step()
    engine.add_request("stream", "Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.step()   # its prompt; it decodes from here on
    engine.add_request("long", prompt, params)
    long_seq, chunks, merged = engine.groups["long"].seqs[0], [], {}
    while engine.has_unfinished_requests():
        decoding, before = "stream" in engine.groups, long_seq.num_computed_tokens
        for delta in engine.step():
            merge_delta(merged, delta)
        if before < len(prompt):
            chunks.append((decoding, long_seq.num_computed_tokens - before))
    beside = [size for decoding, size in chunks if decoding]
    after = [size for decoding, size in chunks if not decoding]
    assert beside and all(size == MIN_CHUNK for size in beside), chunks
    assert after and after[0] == min(256, len(prompt) - MIN_CHUNK * len(beside)), chunks   # grown back
    assert merged["long"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert not engine.check_idle()
