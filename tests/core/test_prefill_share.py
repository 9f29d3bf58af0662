"""Prefill chunks sized by time: the step-cost fit recovers its fixed and
per-token parts; while sequences decode or requests wait, a prompt's chunk is
what the time-per-output-token target leaves, split among the prefilling and
waiting requests (at least MIN_CHUNK); with nothing decoding and nobody
waiting it is the configured chunk again; steps that keep pace under the
target bank the time they leave, and the next prompt may spend it. On the tiny model, a long prompt's
chunks shrink while another request decodes and grow back once it is done,
and greedy tokens do not change."""
import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.engine.llm import merge_delta
from pagedbackend.core.prefill_share import CREDIT_TARGETS, MIN_CHUNK, MIN_STEPS, PrefillShare


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


def test_the_share_is_what_the_target_leaves_after_the_decodes_split_among_prompts():
    share = fitted(0.05, 0.001, [1, 50, 200, 3])   # a 50-token step takes the target of 0.1 s
    assert share.chunk(decode_tokens=10, prefilling=1, waiting=0) == 40
    assert share.chunk(decode_tokens=10, prefilling=1, waiting=1) == 20
    assert share.chunk(decode_tokens=45, prefilling=1, waiting=0) == MIN_CHUNK
    assert share.chunk(decode_tokens=0, prefilling=1, waiting=0) is None   # grows back: nothing to keep pace for
    assert fitted(0.001, 0.0001, [1, 50, 200]).chunk(1, 1, 0) == 256      # never above the configured chunk
    assert fitted(0.05, 0.001, [1] * (MIN_STEPS - 1)).chunk(1, 1, 0) is None


def test_decode_steps_under_the_target_bank_time_that_a_newcomer_spends_at_once():
    a, b = 0.05, 0.001   # a 50-token step takes the target of 0.1 s
    share = fitted(a, b, [1, 50, 200, 3])
    assert share.chunk(decode_tokens=8, prefilling=1, waiting=0) == 42 and share.credit == 0.0
    share.observe(50, 0.1)           # a step at the target banks nothing
    assert share.credit == 0.0
    share.chunk(decode_tokens=8, prefilling=0, waiting=0)
    share.observe(8, a + 8 * b)
    assert share.credit == pytest.approx(0.042)
    assert share.chunk(decode_tokens=8, prefilling=1, waiting=0) in (83, 84)   # 42 more tokens fit
    for _ in range(5):               # 8 streams decoding alone: 0.058 s a step, 0.042 s banked each
        share.chunk(decode_tokens=8, prefilling=0, waiting=0)
        share.observe(8, a + 8 * b)
    assert share.credit == pytest.approx(CREDIT_TARGETS * 0.1)   # at most two targets' worth
    assert share.chunk(decode_tokens=8, prefilling=0, waiting=1) == 242   # a 200-token prompt in one step
    share.observe(250, a + 250 * b)  # that step overran the target by 0.2 s: the credit is spent
    assert share.credit == pytest.approx(0.0)
    assert share.chunk(decode_tokens=8, prefilling=1, waiting=0) == 42
    share.observe(50, 0.5)           # an overrun with nothing banked leaves no debt behind
    assert share.credit == 0.0
    alone = fitted(a, b, [1, 50, 200, 3])
    assert alone.chunk(decode_tokens=0, prefilling=1, waiting=0) is None
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
