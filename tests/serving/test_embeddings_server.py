"""Embeddings through real servers: Triton's ``embedding_request`` input (gRPC,
as vllm_backend's own test sends it) and the OpenAI API's ``/v1/embeddings``
in front of it give transformers' embeddings of the tiny random Qwen3
embedder, for every input shape, with ``dimensions`` and base64; bad requests
get 400s naming the field, and a generation model refuses embeddings (and the
embedder generation). One tritonserver (the embedder and a generator) and one
API server for the module."""
import base64
import json
import queue
import struct
import threading
import time

import httpx
import numpy as np
import pytest

from loadtest.harness.openai import OpenAIServer
from loadtest.harness.triton import TritonServer
from loadtest.tiny_embedder import build_tiny_embedder, cosine_distance, hf_embeddings
from pagedbackend.serving.repository import make_model_repository

pytestmark = pytest.mark.slow

SETTINGS = dict(block_size=16, num_kv_blocks=64, max_num_seqs=32, max_num_batched_tokens=64,
                long_prefill_token_threshold=16, dtype="float32", device="cpu", compile=False)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory, default_model_dir):
    return build_tiny_embedder(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def triton(tmp_path_factory, embedder_dir, tiny_model_dir):
    repo = tmp_path_factory.mktemp("repo")
    make_model_repository(repo, {"model": embedder_dir, **SETTINGS})
    make_model_repository(repo, {"model": tiny_model_dir, **SETTINGS}, name="generator")
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


@pytest.fixture(scope="module")
def api(triton, embedder_dir):
    with OpenAIServer(triton.grpc_url, tokenizer=embedder_dir) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(embedder_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedder_dir)


def ids_of(tokenizer, text):
    return tokenizer(text)["input_ids"]


def embeddings(api, **body):
    reply = httpx.post(f"{api.base_url}/embeddings", json={"model": "paged_llm", **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def assert_close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert len(a) == len(b)
        assert cosine_distance(a, b) < TOLERANCE


TEXTS = ["Paged attention keeps keys and values in blocks.", "A short one.",
         "Continuous batching admits requests between steps, " * 4]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", ["string", "strings", "ids", "id-lists"])
def test_openai_embeddings_equal_transformers_for_every_input_shape(api, embedder_dir, tokenizer, shape):
    token_lists = [ids_of(tokenizer, t) for t in TEXTS]
    given = {"string": TEXTS[0], "strings": TEXTS, "ids": token_lists[0], "id-lists": token_lists}[shape]
    expected_ids = token_lists[:1] if shape in ("string", "ids") else token_lists

    answer = embeddings(api, input=given)

    assert answer["object"] == "list" and answer["model"] == "paged_llm"
    assert [d["index"] for d in answer["data"]] == list(range(len(expected_ids)))
    assert_close([d["embedding"] for d in answer["data"]], hf_embeddings(embedder_dir, expected_ids))
    tokens = sum(len(ids) for ids in expected_ids)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


@pytest.mark.timeout(300)
def test_dimensions_and_base64(api, embedder_dir, tokenizer):
    answer = embeddings(api, input=TEXTS, dimensions=16, encoding_format="base64")

    vectors = [list(struct.unpack("<16f", base64.b64decode(d["embedding"]))) for d in answer["data"]]
    assert_close(vectors, hf_embeddings(embedder_dir, [ids_of(tokenizer, t) for t in TEXTS], dimensions=16))
    assert all(abs(float(np.linalg.norm(v)) - 1.0) < 1e-5 for v in vectors)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", ["empty list"]),
    ({"input": [[1]] * 2049}, "input", ["2049 inputs", "limit is 2048"]),
    ({"input": list(range(3, 400))}, "input", ["397 tokens"]),
    ({"input": ["fine", "paged " * 400]}, "input", ["tokens", "maximum context length is 256"]),
    ({"input": ["a", 5]}, "input", ["item 1"]),
    ({"input": "hi", "dimensions": 0}, "dimensions", ["at least 1"]),
    ({"input": "hi", "dimensions": 65}, "dimensions", ["larger than the model's embedding size 64"]),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", []),
    ({"input": "hi", "model": "generator"}, "model", ["runner=generate"]),
], ids=["empty", "too-many", "too-long", "too-long-text", "mixed", "dimensions-0", "dimensions-65", "format", "generator"])
def test_bad_embedding_requests_get_400_naming_the_field(api, body, param, words):
    reply = httpx.post(f"{api.base_url}/embeddings", json={"model": "paged_llm", **body}, timeout=60)

    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]


@pytest.mark.timeout(120)
def test_the_embedder_refuses_generation(api):
    reply = httpx.post(f"{api.base_url}/completions", json={"model": "paged_llm", "prompt": "Hi", "max_tokens": 2},
                       timeout=60)
    assert reply.status_code == 400
    assert "runner=pooling" in reply.json()["error"]["message"]


def triton_embed(triton, request: dict, flags=(), model: str = "paged_llm"):
    """One request as vllm_backend's embed test sends it (an empty text_input
    beside embedding_request); the response's outputs, or the error."""
    import tritonclient.grpc as grpcclient
    inputs = []
    values = {"text_input": np.array([b""], dtype=np.object_),
              "embedding_request": np.array([json.dumps(request).encode()], dtype=np.object_),
              **{flag: np.array([True]) for flag in flags}}
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, [1], "BYTES" if value.dtype == np.object_ else "BOOL")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, outputs=None)
        result, error = results.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    if error is not None:
        return error
    return {out.name: result.as_numpy(out.name).reshape(-1).tolist() for out in result.get_response().outputs}


@pytest.mark.timeout(300)
def test_triton_embedding_request_as_vllm_backend_sends_it(triton, embedder_dir, tokenizer):
    one = triton_embed(triton, {"input": TEXTS[0], "pooling_params": {}})
    ids = triton_embed(triton, {"input": [101, 7592, 102], "pooling_params": {}})
    listed = triton_embed(triton, {"input": TEXTS, "pooling_params": {"dimensions": [16]}},
                          flags=("return_num_input_tokens", "return_num_output_tokens"))

    token_lists = [ids_of(tokenizer, t) for t in TEXTS]
    assert len(one["text_output"]) == 1
    assert_close([json.loads(one["text_output"][0])], hf_embeddings(embedder_dir, token_lists[:1]))
    assert_close([json.loads(ids["text_output"][0])], hf_embeddings(embedder_dir, [[101, 7592, 102]]))
    assert_close([json.loads(t) for t in listed["text_output"]],
                 hf_embeddings(embedder_dir, token_lists, dimensions=16))
    assert listed["num_input_tokens"] == [len(t) for t in token_lists]
    assert listed["num_output_tokens"] == [0] * len(TEXTS)


@pytest.mark.timeout(120)
def test_triton_refuses_bad_embedding_requests(triton):
    generator = triton_embed(triton, {"input": "hi"}, model="generator")
    empty = triton_embed(triton, {"input": []})
    unknown = triton_embed(triton, {"input": "hi", "pooling_params": {"dimension": 3}})

    assert "runner=generate" in generator.message()
    assert "empty list" in empty.message()
    assert "unknown pooling parameter" in unknown.message()


@pytest.mark.timeout(400)
def test_a_stopping_server_ends_an_embedding_request_in_flight(tmp_path, embedder_dir):
    repo = make_model_repository(tmp_path / "repo", {"model": embedder_dir, **SETTINGS, "max_num_batched_tokens": 16})
    many = [[(7 * i + j) % 40000 + 3 for j in range(200)] for i in range(400)]   # minutes of 16-token steps
    answers: "queue.Queue" = queue.Queue()
    server = TritonServer(repo, ready_timeout_s=240)
    with server:
        worker = threading.Thread(target=lambda: answers.put(triton_embed(server, {"input": many})), daemon=True)
        worker.start()
        time.sleep(3.0)   # the request is in the engine
        code = server.stop()
        worker.join(timeout=60)

    answer = answers.get(timeout=1)
    assert code == 0
    assert not isinstance(answer, dict) and "shutting down" in answer.message()


def e2e_count(triton) -> float:
    prefix = 'pagedbackend:e2e_request_latency_seconds_count{model="paged_llm",version="1"} '
    line = next((line for line in triton.metrics().splitlines() if line.startswith(prefix)), prefix + "0")
    return float(line[len(prefix):])


@pytest.mark.timeout(120)
def test_each_embedded_input_counts_as_a_finished_request(triton):
    before = e2e_count(triton)
    answer = triton_embed(triton, {"input": ["one", "two"]})
    assert len(answer["text_output"]) == 2
    assert e2e_count(triton) == before + 2
