"""A BERT cross-encoder through real servers: ``/rerank`` and ``/score`` on the
OpenAI server, in front of a tritonserver serving the tiny random
``BertForSequenceClassification``, give the sigmoid of transformers' logits;
bad requests get 400s naming the field; both routes need the API key. One
tritonserver and one API server for the module."""
import httpx
import pytest
import torch

from loadtest.harness.openai import OpenAIServer
from loadtest.harness.triton import TritonServer
from loadtest.tiny_encoder import build_tiny_encoder, hf_scores
from pagedbackend.serving.repository import make_model_repository

pytestmark = pytest.mark.slow

SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=256, dtype="float32", device="cpu", compile=False)
KEY = "scores-test-key"
QUERY = "what is paged attention"
DOCUMENTS = ["paged attention is a kernel", "the cache", "a block of memory is small and fast", "decoder"]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return build_tiny_encoder(tmp_path_factory.mktemp("reranker"), "bert", None, cross_encoder=True, seed=3)


@pytest.fixture(scope="module")
def api(tmp_path_factory, reranker_dir):
    repo = tmp_path_factory.mktemp("repo")
    make_model_repository(repo, {"model": reranker_dir, **SETTINGS})
    with TritonServer(repo, ready_timeout_s=240) as triton:
        with OpenAIServer(triton.grpc_url, tokenizer=reranker_dir,
                          extra_args=["--api-key", KEY, "--request-limit", "max_embedding_inputs=8"]) as running:
            yield running


@pytest.fixture(scope="module")
def expected(reranker_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(reranker_dir)
    pairs = [(tokenizer.encode(QUERY, add_special_tokens=False), tokenizer.encode(d, add_special_tokens=False))
             for d in DOCUMENTS]
    return [torch.sigmoid(torch.tensor(x)).item() for x in hf_scores(reranker_dir, pairs)]


def post(api, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{api.url}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.timeout(300)
def test_rerank_orders_documents_by_the_cross_encoders_score(api, expected):
    reply = post(api, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3, "return_documents": True})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    best = sorted(range(len(expected)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in results] == best
    for r in results:
        assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-4
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert reply.json()["usage"]["total_tokens"] > 0
    plain = post(api, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()["results"]
    assert len(plain) == len(DOCUMENTS) and all("document" not in r for r in plain)


@pytest.mark.timeout(300)
def test_score_gives_one_score_per_pair(api, expected):
    reply = post(api, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCUMENTS)))
    assert max(abs(d["score"] - e) for d, e in zip(data, expected)) < 1e-4
    pairwise = post(api, "/v1/score", {"text_1": [QUERY, "x"], "text_2": [DOCUMENTS[0], "y"]}).json()["data"]
    assert abs(pairwise[0]["score"] - expected[0]) < 1e-4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path, body, field, words", [
    ("/rerank", {"query": QUERY, "documents": []}, "documents", "empty list"),
    ("/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents", "item 1 is empty"),
    ("/rerank", {"query": QUERY, "documents": ["a"] * 9}, "documents", "the limit is 8"),
    ("/rerank", {"query": QUERY, "documents": ["token " * 200]}, "documents", "maximum context length"),
    ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n", "at least 1"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "one text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", "empty list"),
])
def test_bad_requests_get_400_naming_the_field(api, path, body, field, words):
    reply = post(api, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and words in error["message"], error


@pytest.mark.timeout(300)
def test_scores_need_the_api_key(api):
    for path in ("/rerank", "/score"):
        body = {"query": QUERY, "documents": ["a"]} if path == "/rerank" else {"text_1": "a", "text_2": "b"}
        assert post(api, path, body, key=None).status_code == 401
        assert post(api, path, body, key="wrong").status_code == 401
