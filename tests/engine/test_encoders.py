"""Encoder embedders (BERT, XLM-RoBERTa) in the engine against transformers'
own embeddings of tiny random checkpoints: CLS and MEAN from the folder's
sentence-transformers files, normalisation, dimensions, text inputs, and the
scheduling rule of an encoder (never chunked: a step with room for the
whole input, an input over the step's budget refused by name); a BERT
cross-encoder's scores against transformers' logits."""
import random

import pytest
import torch

from loadtest.tiny_embedder import cosine_distance, hf_embeddings
from loadtest.tiny_encoder import build_tiny_encoder, hf_scores
from pagedbackend import LLM, InvalidRequestError, PoolingParams
from pagedbackend.kernels import onednn_linear

TOLERANCE = 1e-4   # cosine distance
SETTINGS = {"compile": False}


def inputs(n, seed=0, low=2, high=100):
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def assert_close(outs, reference):
    assert len(outs) == len(reference)
    for out, want in zip(outs, reference):
        assert len(out.outputs.embedding) == len(want)
        assert cosine_distance(out.outputs.embedding, want) < TOLERANCE


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def model_type(request):
    return request.param


@pytest.fixture(scope="module")
def mean_dir(tmp_path_factory, model_type):
    return build_tiny_encoder(tmp_path_factory.mktemp(f"{model_type}-mean"), model_type, "MEAN")


@pytest.fixture(scope="module")
def mean_llm(mean_dir):
    with LLM(model=str(mean_dir), **SETTINGS) as llm:
        yield llm


def test_mean_pooling_folder_equals_transformers(mean_llm, mean_dir):
    assert mean_llm.engine.config.runner == "pooling"
    assert mean_llm.engine.config.pooling_type == "MEAN"
    batch = inputs(7, seed=1)
    outs = mean_llm.embed(batch)
    assert_close(outs, hf_embeddings(mean_dir, batch, "MEAN"))
    assert [o.prompt_token_ids for o in outs] == batch
    assert all(abs(sum(x * x for x in o.outputs.embedding) - 1.0) < 1e-5 for o in outs)
    # every projection multiplies through oneDNN in its own weight layout where torch has it
    assert mean_llm.engine.runner.describe()["linear_backend"] == (
        "onednn" if onednn_linear.unavailable() is None else "torch")


def test_linear_backend_torch_keeps_f_linear(mean_llm, mean_dir):
    batch = inputs(5, seed=6)
    with LLM(model=str(mean_dir), linear_backend="torch", **SETTINGS) as plain:
        assert plain.engine.runner.describe()["linear_backend"] == "torch"
        outs = plain.embed(batch)
    assert_close(outs, hf_embeddings(mean_dir, batch, "MEAN"))
    for a, b in zip(outs, mean_llm.embed(batch)):
        assert cosine_distance(a.outputs.embedding, b.outputs.embedding) < 1e-6


def test_a_request_may_name_cls_and_skip_normalisation(mean_llm, mean_dir):
    batch = inputs(4, seed=2)
    outs = mean_llm.embed(batch, PoolingParams(pooling_type="CLS", normalize=False))
    for out, want in zip(outs, hf_embeddings(mean_dir, batch, "CLS", normalize=False)):
        assert max(abs(a - b) for a, b in zip(out.outputs.embedding, want.tolist())) < 1e-4


def test_dimensions_truncate_then_normalise(mean_llm, mean_dir):
    batch = inputs(3, seed=3)
    outs = mean_llm.embed(batch, PoolingParams(dimensions=16))
    assert_close(outs, hf_embeddings(mean_dir, batch, "MEAN", dimensions=16))
    with pytest.raises(InvalidRequestError, match="dimensions 65 is larger than the model's embedding size 64"):
        mean_llm.embed([5, 6, 7], PoolingParams(dimensions=65))


def test_text_is_tokenised_with_cls_and_sep(mean_llm, mean_dir):
    text = "the paged attention cache is fast"
    ids = mean_llm.engine.tokenizer.encode(text)
    assert ids[0] == 3 and ids[-1] == 4   # [CLS] ... [SEP]
    (out,) = mean_llm.embed([text])
    assert out.prompt_token_ids == ids
    assert_close([out], hf_embeddings(mean_dir, [ids], "MEAN"))


def test_cls_folder_and_a_plain_folder(tmp_path, model_type):
    cls_dir = build_tiny_encoder(tmp_path / "cls", model_type, "CLS", seed=1)
    plain_dir = build_tiny_encoder(tmp_path / "plain", model_type, None, seed=2)
    batch = inputs(5, seed=4)
    with LLM(model=str(cls_dir), **SETTINGS) as llm:
        assert_close(llm.embed(batch), hf_embeddings(cls_dir, batch, "CLS"))
    with LLM(model=str(plain_dir), **SETTINGS) as llm:   # an encoder pools CLS and normalises by default
        assert (llm.engine.config.runner, llm.engine.config.pooling_type) == ("pooling", "CLS")
        assert_close(llm.embed(batch), hf_embeddings(plain_dir, batch, "CLS"))
        with pytest.raises(ValueError, match="runner='generate'"):
            llm.generate("hello")
    with pytest.raises(ValueError, match="runner=generate: .* is an encoder"):
        LLM(model=str(plain_dir), runner="generate", **SETTINGS)


def test_inputs_are_never_chunked_and_wait_for_room(mean_dir):
    """A budget of 64 tokens per step: inputs of up to 60 tokens are computed
    whole, one or two a step; one of 65 tokens is refused, naming the setting."""
    batch = inputs(6, seed=5, low=30, high=61)
    with LLM(model=str(mean_dir), max_num_batched_tokens=64, max_num_seqs=4, **SETTINGS) as llm:
        steps = []
        runner = llm.engine.runner
        original = runner.execute_model

        def recording(entries, hidden_out=None):
            steps.append([(e.start_pos, len(e.token_ids)) for e in entries])
            return original(entries, hidden_out)
        runner.execute_model = recording
        assert_close(llm.embed(batch), hf_embeddings(mean_dir, batch, "MEAN"))
        computed = sorted(n for step in steps for _, n in step)
        assert computed == sorted(len(b) for b in batch)   # each input once, whole
        assert all(start == 0 for step in steps for start, _ in step)
        assert all(sum(n for _, n in step) <= 64 for step in steps)
        with pytest.raises(InvalidRequestError, match="input has 65 tokens; an encoder computes each input "
                                                      "whole in one step, and max_num_batched_tokens is 64"):
            llm.embed([[7] * 65])


def test_over_long_input_is_refused(mean_llm):
    limit = mean_llm.engine.max_model_len
    assert limit == 128   # BERT: max_position_embeddings; XLM-RoBERTa: 130 less pad_token_id + 1
    with pytest.raises(InvalidRequestError, match=f"129 tokens; the maximum context length is {limit}"):
        mean_llm.embed([[7] * 129])


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def reranker_dir(tmp_path_factory, request):
    """A BertForSequenceClassification (pooler, classifier) or an
    XLMRobertaForSequenceClassification (its dense-tanh-out_proj head, as
    bge-reranker's), one label."""
    return build_tiny_encoder(tmp_path_factory.mktemp("reranker"), request.param, None, cross_encoder=True, seed=3)


def test_cross_encoder_scores_equal_transformers(reranker_dir):
    """Pairs of different lengths in one batch: [CLS] query [SEP] document
    [SEP], segment ids 0 then 1, the classifier's logit through a sigmoid."""
    query = "what is paged attention"
    documents = ["paged attention is a kernel", "the cache", "a block of memory is small and fast",
                 "decoder", "query token rank score"]
    with LLM(model=str(reranker_dir), **SETTINGS) as llm:
        tokenizer = llm.get_tokenizer()
        outs = llm.score(query, documents)
        assert len(outs) == len(documents)
        pairs = [(tokenizer.encode(query, add_special_tokens=False), tokenizer.encode(d, add_special_tokens=False))
                 for d in documents]
        want = [torch.sigmoid(torch.tensor(x)).item() for x in hf_scores(reranker_dir, pairs)]
        got = [o.outputs.score for o in outs]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert len(set(round(g, 4) for g in got)) == len(got)   # the documents are told apart
        assert outs[0].prompt_token_ids == [3, *pairs[0][0], 4, *pairs[0][1], 4]
        # Segment ids matter: the same ids as one segment score otherwise.
        (flat,) = llm.embed([outs[0].prompt_token_ids])
        assert abs(flat.outputs.embedding[0] - got[0]) > 1e-4
        pairwise = llm.score(["the cache", query], ["decoder", documents[1]])   # pair by pair
        assert abs(pairwise[1].outputs.score - got[1]) < 1e-5
        with pytest.raises(InvalidRequestError, match="takes no dimensions"):
            llm.embed([[5, 6]], PoolingParams(dimensions=4))


def test_score_needs_a_cross_encoder(mean_llm):
    with pytest.raises(ValueError, match="LLM.score needs a cross-encoder"):
        mean_llm.score("a", ["b"])
    with pytest.raises(InvalidRequestError, match="a text pair is scored by a cross-encoder"):
        mean_llm.embed([{"text": "a", "text_pair": "b"}])
