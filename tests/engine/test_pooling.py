"""Embedding requests in the engine against transformers' own embeddings of a
tiny random Qwen3 checkpoint: every pooler, normalisation, Matryoshka
dimensions, chunked prefill, generation in the same steps, the prefix cache,
and the runner a folder's sentence-transformers files choose."""
import random

import pytest

from loadtest.tiny_embedder import build_tiny_embedder, cosine_distance, hf_embeddings
from pagedbackend import LLM, InvalidRequestError, PoolingParams, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm_engine import LLMEngine

TOLERANCE = 1e-4   # cosine distance
EAGER = {"compile": False, "num_kv_blocks": 64, "block_size": 16}


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory, default_model_dir):
    return build_tiny_embedder(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def llm(embedder_dir):
    with LLM(model=str(embedder_dir), **EAGER) as llm:
        yield llm


def prompts(n, seed=0, low=2, high=70):
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def assert_close(ours, reference):
    assert len(ours) == len(reference)
    for got, want in zip(ours, reference):
        assert len(got) == len(want)
        assert cosine_distance(got, want) < TOLERANCE


def test_sentence_transformers_folder_serves_embeddings(llm):
    assert llm.engine.config.runner == "pooling"
    assert llm.engine.config.pooling_type == "LAST"
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.generate("hello")


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_each_pooler_equals_transformers(llm, embedder_dir, pooling_type):
    batch = prompts(6, seed=1)
    outs = llm.embed(batch, PoolingParams(pooling_type=pooling_type))
    reference = hf_embeddings(embedder_dir, batch, pooling_type)
    assert_close([o.outputs.embedding for o in outs], reference)
    assert all(abs(sum(x * x for x in o.outputs.embedding) - 1.0) < 1e-5 for o in outs)
    assert [o.prompt_token_ids for o in outs] == batch


def test_unnormalised_embedding_is_the_hidden_state(llm, embedder_dir):
    batch = prompts(3, seed=2)
    outs = llm.embed(batch, PoolingParams(normalize=False, pooling_type="MEAN"))
    for out, want in zip(outs, hf_embeddings(embedder_dir, batch, "MEAN", normalize=False)):
        got = out.outputs.embedding
        assert max(abs(a - b) for a, b in zip(got, want.tolist())) < 1e-4
        assert abs(sum(x * x for x in got) - 1.0) > 1e-3   # not normalised


def test_dimensions_truncate_then_normalise(llm, embedder_dir):
    batch = prompts(3, seed=3)
    outs = llm.embed(batch, PoolingParams(dimensions=16))
    assert all(len(o.outputs.embedding) == 16 for o in outs)
    assert_close([o.outputs.embedding for o in outs], hf_embeddings(embedder_dir, batch, dimensions=16))


def test_dimensions_beyond_the_hidden_size_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="dimensions 65 is larger than the model's embedding size 64"):
        llm.embed([5, 6, 7], PoolingParams(dimensions=65))
    with pytest.raises(InvalidRequestError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)


def test_text_prompts_are_tokenised(llm, embedder_dir):
    text = "Paged attention keeps the KV cache in blocks."
    out = llm.embed(text)[0]
    assert out.prompt == text
    assert_close([out.outputs.embedding], hf_embeddings(embedder_dir, [out.prompt_token_ids]))


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_chunked_prefill_pools_every_chunk(embedder_dir, pooling_type):
    long_prompts = prompts(3, seed=4, low=90, high=120)
    engine = LLMEngine(EngineConfig(model=str(embedder_dir), **EAGER, max_num_batched_tokens=32,
                                    long_prefill_token_threshold=16, tpot_target_s=0))
    for i, ids in enumerate(long_prompts):
        engine.add_request(f"e{i}", ids, PoolingParams(pooling_type=pooling_type))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        done.update({o.request_id: o for o in engine.step()})
    assert steps >= 90 // 16   # the prompts came in chunks of at most 16 tokens
    assert_close([done[f"e{i}"].outputs.embedding for i in range(3)],
                 hf_embeddings(embedder_dir, long_prompts, pooling_type))
    assert engine.check_idle() == []   # every block went back


def test_embeddings_and_generation_share_steps(embedder_dir):
    gen_prompts, emb_prompts = prompts(3, seed=5), prompts(4, seed=6)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = LLMEngine(EngineConfig(model=str(embedder_dir), runner="generate", **EAGER))
    for i, ids in enumerate(gen_prompts):
        alone.add_request(f"g{i}", ids, greedy)
    expected = {}
    while alone.has_unfinished_requests():
        for out in alone.step():
            expected.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)

    engine = LLMEngine(EngineConfig(model=str(embedder_dir), **EAGER, max_num_batched_tokens=48,
                                    long_prefill_token_threshold=16, tpot_target_s=0))
    for i, ids in enumerate(gen_prompts):
        engine.add_request(f"g{i}", ids, greedy)
    for i, ids in enumerate(emb_prompts):
        engine.add_request(f"e{i}", ids, PoolingParams(pooling_type="MEAN"))
    got, embeddings, mixed_steps = {}, {}, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        kinds = {o.request_id[0] for o in outs}
        mixed_steps += kinds == {"g", "e"}
        for out in outs:
            if out.request_id.startswith("e"):
                embeddings[out.request_id] = out.outputs.embedding
            else:
                got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert mixed_steps >= 1   # some step returned both kinds
    assert got == expected
    assert_close([embeddings[f"e{i}"] for i in range(4)], hf_embeddings(embedder_dir, emb_prompts, "MEAN"))
    assert engine.check_idle() == []


def test_prefix_cache_serves_last_but_not_mean(embedder_dir):
    engine = LLMEngine(EngineConfig(model=str(embedder_dir), **EAGER))
    ids = prompts(1, seed=7, low=60, high=61)[0]

    def embed(rid, pooling_type):
        engine.add_request(rid, ids, PoolingParams(pooling_type=pooling_type))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        return outs[-1].outputs.embedding

    first = embed("a", "MEAN")
    hits = engine.block_manager.prefix_hits
    again = embed("b", "MEAN")
    assert engine.block_manager.prefix_hits == hits   # MEAN computed every position again
    last = embed("c", "LAST")
    assert engine.block_manager.prefix_hits > hits    # LAST took the cached blocks
    assert_close([first, again], hf_embeddings(embedder_dir, [ids, ids], "MEAN"))
    assert_close([last], hf_embeddings(embedder_dir, [ids], "LAST"))


def test_generation_model_refuses_embed(tmp_path, default_model_dir):
    folder = build_tiny_embedder(tmp_path / "plain", sentence_transformers=False)
    with LLM(model=str(folder), **EAGER) as llm:
        assert llm.engine.config.runner == "generate"
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed("hello")
    with LLM(model=str(folder), runner="pooling", pooling_type="cls", **EAGER) as llm:
        out = llm.embed([[9, 8, 7, 6]])[0]
        assert_close([out.outputs.embedding], hf_embeddings(folder, [[9, 8, 7, 6]], "CLS"))


def test_sentence_transformers_mean_without_normalize(tmp_path, default_model_dir):
    folder = build_tiny_embedder(tmp_path / "mean", pooling_type="MEAN", normalize=False)
    with LLM(model=str(folder), **EAGER) as llm:
        assert llm.engine.config.pooling_type == "MEAN"
        got = llm.embed([[11, 12, 13, 14, 15]])[0].outputs.embedding
    want = hf_embeddings(folder, [[11, 12, 13, 14, 15]], "MEAN", normalize=False)[0]
    assert max(abs(a - b) for a, b in zip(got, want.tolist())) < 1e-4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_embedding_request_pools_every_position_once(embedder_dir, mode):
    # 12 blocks: the generation's growth past 64 tokens preempts the newer embedding request.
    engine = LLMEngine(EngineConfig(model=str(embedder_dir), compile=False, num_kv_blocks=12, block_size=16,
                                    preemption_mode=mode, swap_space_blocks=16, max_num_batched_tokens=32,
                                    long_prefill_token_threshold=16, tpot_target_s=0))
    gen, emb = prompts(1, seed=8, low=60, high=61)[0], prompts(1, seed=9, low=120, high=121)[0]
    engine.add_request("g", gen, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    group = engine.add_request("e", emb, PoolingParams(pooling_type="MEAN"))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})

    assert group.num_preemptions >= 1
    assert_close([outs["e"].outputs.embedding], hf_embeddings(embedder_dir, [emb], "MEAN"))
    assert engine.check_idle() == []


def test_an_aborted_embedding_request_leaves_nothing_behind(embedder_dir):
    engine = LLMEngine(EngineConfig(model=str(embedder_dir), **EAGER, max_num_batched_tokens=16,
                                    long_prefill_token_threshold=16, tpot_target_s=0))
    engine.add_request("e", prompts(1, seed=10, low=80, high=81)[0], PoolingParams(pooling_type="MEAN"))
    engine.step()
    assert engine.pooling.pooled and engine.block_manager.num_used_blocks > 0   # partway through its prompt

    final = engine.abort_request("e")

    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.check_idle() == []
