"""One ``make serve`` with several models, as Triton users deploy them: a
generator, an embedder and a cross-encoder, one Triton model each
(``MODEL="chat=... embed=... rerank=..."``), each with its own KV pool
(``SERVE_ARGS="--set embed:num_kv_blocks=40"``). Each answers through both
front ends with its own results (the generator as the engine generates, the
embedder and the reranker as sentence-transformers computes), the OpenAI
server uses each model's own tokenizer, and a model asked for what it does
not do refuses by name."""
import os
import pathlib
import signal
import subprocess
import time

import httpx
import pytest
import torch

from loadtest.harness.triton import free_port
from loadtest.tiny_embedder import build_tiny_embedder, cosine_distance
from loadtest.tiny_encoder import build_tiny_encoder

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = ["paged attention is a kernel", "the cache", "a block of memory is small and fast", "decoder"]
QUERY = "what is paged attention"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("several")
    return {"chat": tiny_model_dir, "embed": build_tiny_embedder(base / "embed", "LAST"),
            "rerank": build_tiny_encoder(base / "rerank", "bert", None, cross_encoder=True, seed=3)}


@pytest.fixture(scope="module")
def serve(folders, tmp_path_factory):
    ports = {name: free_port() for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBACKEND_MODEL")}
    env.update(PAGEDBACKEND_DEVICE="cpu", PAGEDBACKEND_COMPILE="false")
    log_path = tmp_path_factory.mktemp("several-log") / "make.log"
    models = " ".join(f"{name}={folder}" for name, folder in folders.items())
    with open(log_path, "wb") as log:
        make = subprocess.Popen(["make", "-s", "-C", str(REPO), "-o", ".venv/.installed", "-o", ".venv/.step-built",
                                 "serve", f"MODEL={models}", "SERVE_ARGS=--set max_num_seqs=8 --set "
                                 "embed:num_kv_blocks=40 --set chat:num_kv_blocks=96",
                                 *(f"{k}={v}" for k, v in ports.items())],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    urls = {"openai": f"http://127.0.0.1:{ports['OPENAI_PORT']}", "http": f"http://127.0.0.1:{ports['HTTP_PORT']}"}
    try:
        deadline, ready = time.monotonic() + 300, False
        while time.monotonic() < deadline and make.poll() is None and not ready:
            try:
                ready = httpx.get(f"{urls['openai']}/health", timeout=2).status_code == 200 and all(
                    httpx.get(f"{urls['http']}/v2/models/{name}/ready", timeout=2).status_code == 200
                    for name in folders)
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert ready, log_path.read_text(errors="replace")[-3000:]
        yield urls
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        try:
            make.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()


def test_each_model_is_a_triton_model_with_its_own_folder_and_kv_pool(serve, folders):
    params = {}
    for name in folders:
        config = httpx.get(f"{serve['http']}/v2/models/{name}/config", timeout=10).json()
        params[name] = {k: v["string_value"] for k, v in config["parameters"].items()}
        assert params[name]["model"] == str(folders[name])
        assert params[name]["max_num_seqs"] == "8"   # a setting for every model
    assert params["embed"]["num_kv_blocks"] == "40" and params["chat"]["num_kv_blocks"] == "96"
    assert params["rerank"]["num_kv_blocks"] not in ("40", "96")
    listed = {m["id"] for m in httpx.get(f"{serve['openai']}/v1/models", timeout=10).json()["data"]}
    assert listed == set(folders)


def test_the_generator_generates_as_the_engine_does(serve, folders):
    from pagedbackend import LLM, SamplingParams
    prompt = "The paged attention kernel reads"
    reply = httpx.post(f"{serve['openai']}/v1/completions", timeout=120, json={
        "model": "chat", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    with LLM(model=str(folders["chat"]), compile=False, device="cpu") as llm:
        expected = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert reply.json()["choices"][0]["text"] == expected[0].outputs[0].text


def test_the_embedder_and_the_reranker_answer_as_sentence_transformers(serve, folders):
    from sentence_transformers import CrossEncoder, SentenceTransformer
    reply = httpx.post(f"{serve['openai']}/v1/embeddings", timeout=120,
                       json={"model": "embed", "input": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    reference = SentenceTransformer(str(folders["embed"]), device="cpu").encode(DOCUMENTS, convert_to_tensor=True)
    for item, want in zip(reply.json()["data"], reference):
        assert cosine_distance(item["embedding"], want) < 1e-4
    reply = httpx.post(f"{serve['openai']}/rerank", timeout=120,
                       json={"model": "rerank", "query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    scores = CrossEncoder(str(folders["rerank"]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    for result in reply.json()["results"]:
        assert abs(result["relevance_score"] - float(scores[result["index"]])) < 1e-4


def test_each_model_is_tokenised_with_its_own_tokenizer(serve, folders):
    from transformers import AutoTokenizer
    for name in ("chat", "rerank"):
        reply = httpx.post(f"{serve['openai']}/tokenize", timeout=30, json={"model": name, "prompt": QUERY})
        assert reply.status_code == 200, reply.text
        assert reply.json()["tokens"] == AutoTokenizer.from_pretrained(folders[name]).encode(QUERY)


def test_a_model_asked_for_what_it_does_not_do_refuses_by_name(serve):
    reply = httpx.post(f"{serve['openai']}/v1/embeddings", timeout=60, json={"model": "chat", "input": "hello"})
    assert reply.status_code == 400 and "runner" in reply.text, reply.text
    reply = httpx.post(f"{serve['openai']}/v1/completions", timeout=60,
                       json={"model": "embed", "prompt": "hello", "max_tokens": 4})
    assert reply.status_code == 400 and "runner" in reply.text, reply.text
    # The others are unharmed.
    assert httpx.post(f"{serve['openai']}/v1/embeddings", timeout=60,
                      json={"model": "embed", "input": "hello"}).status_code == 200
