"""Qwen2.5-VL through the engine (``LLM.generate`` with vLLM's prompt dicts)
against Hugging Face ``generate``: prefill chunks that end inside an image's
placeholders, the prefix cache (the same image hits, another image shares no
block past its start, and the positions after a cached prefix stay M-RoPE's),
the encoder cache, preemption by recompute, speculative n-gram verification
(M-RoPE positions for draft rows), the decode-graph buffers with ``[3, M]``
positions, and the refusals."""
import pytest

from pagedbackend import LLM
from pagedbackend.worker.cuda_graphs import DecodeGraphs
from qwen_vl_reference import GREEDY, QwenReference, request, tokens_of


@pytest.fixture(scope="module")
def ref(tiny_vision):
    return QwenReference(tiny_vision("qwen2_5_vl"))


def engine(ref, **overrides):
    settings = dict(model=str(ref.folder), dtype="float32", device="cpu", block_size=8, num_kv_blocks=96,
                    enable_prefix_caching=True, compile=False)
    return LLM(**{**settings, **overrides})


def cases(ref):
    return [(ref.chat("what is this?", 1), (1,)), (ref.chat("compare them", 2), (2, 3)),
            (ref.chat("say something about llamas", 0), ())]


def test_prefill_chunks_ending_inside_an_image(ref):
    prompts = cases(ref)
    expected = [ref.greedy(t, s) for t, s in prompts]
    ids = ref.inputs(*prompts[0])["input_ids"][0].tolist()
    pads = [i for i, t in enumerate(ids) if t == ref.model.config.image_token_id]
    assert len(pads) == 12 and pads[0] // 5 != pads[-1] // 5   # chunks of 5 split the image's 12 pads
    llm = engine(ref, max_num_batched_tokens=5, max_num_seqs=3)
    assert tokens_of(llm.generate([request(t, s) for t, s in prompts], GREEDY)) == expected


def test_prefix_cache_same_image_hits_another_image_shares_no_block_past_it(ref):
    text = ref.chat("what is this?", 1)
    ids = ref.inputs(text, (5,))["input_ids"][0].tolist()
    image_at = ids.index(ref.model.config.image_token_id)
    llm = engine(ref)

    def run(seed):
        out = llm.generate(request(text, (seed,)), GREEDY)[0]
        return list(out.outputs[0].token_ids), out.metrics.num_cached_prompt_tokens

    first, other = ref.greedy(text, (5,)), ref.greedy(text, (6,))
    assert first != other
    assert run(5) == (first, 0)
    tokens, cached = run(5)   # a hit past the image: the rest is computed at M-RoPE positions
    assert tokens == first and cached >= len(ids) - 8 > image_at + 12
    tokens, cached = run(6)
    assert tokens == other and cached <= image_at
    # the encoder cache: each distinct image went through the tower once
    assert llm.engine.runner.image_rows.encoded_images == 2


def test_preemption_by_recompute_keeps_the_tokens(ref):
    prompts = cases(ref) + [(ref.chat("what is this?", 1), (4,))]
    expected = [ref.greedy(t, s) for t, s in prompts]
    longest = max(len(ref.inputs(t, s)["input_ids"][0]) for t, s in prompts)
    llm = engine(ref, num_kv_blocks=-(-(longest + 8) // 8) + 2, preemption_mode="recompute",
                 enable_prefix_caching=False)
    assert tokens_of(llm.generate([request(t, s) for t, s in prompts], GREEDY)) == expected
    assert llm.engine.get_stats().num_preemptions > 0


def test_ngram_speculation_verifies_at_mrope_positions(ref):
    prompts = cases(ref)
    expected = [ref.greedy(t, s) for t, s in prompts]
    llm = engine(ref, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 1})
    assert tokens_of(llm.generate([request(t, s) for t, s in prompts], GREEDY)) == expected
    assert llm.engine.get_stats().spec_num_draft_tokens > 0


def test_decode_graph_buffers_hold_three_position_streams(ref):
    """The CUDA-graph decode path (run here without recording, on the
    Triton-lang kernels in the interpreter) keeps [3, M] positions."""
    prompts = cases(ref)
    expected = [ref.greedy(t, s) for t, s in prompts]
    llm = engine(ref, attention_backend="triton")
    graphs = llm.engine.runner.graphs = DecodeGraphs(llm.engine.runner, [1, 2, 4], capture=False)
    assert graphs.buffers.positions.shape == (3, 4)
    assert tokens_of(llm.generate([request(t, s) for t, s in prompts], GREEDY)) == expected
    assert graphs.replays[4] > 0


def test_a_draft_model_with_mrope_is_refused_by_name(ref):
    with pytest.raises(ValueError, match="multimodal RoPE.*Qwen2_5_VLForConditionalGeneration"):
        engine(ref, speculative_config={"method": "self_int4", "num_speculative_tokens": 2})
