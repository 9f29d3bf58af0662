"""Request limits on real servers: the OpenAI API and Triton's own ports (gRPC,
HTTP generate with the sampling_parameters input and with request
parameters) refuse each oversized field with a 4xx naming it, before any work
is queued; malformed tools and an oversized header get OpenAI error objects;
after all of it the server still serves and no KV block is left in use.
One tritonserver and one API server for the module, on the tiny random model."""
import json
import socket
import time

import httpx
import pytest

from client import ServerError, generate, http_stream
from loadtest.harness.triton import TritonServer
from loadtest.harness.openai import OpenAIServer
from pagedbackend.serving.repository import make_model_repository

pytestmark = pytest.mark.slow

# The tiny model's context is 512; MAX_N set lower than the default on the Triton model.
SETTINGS = dict(block_size=16, num_kv_blocks=96, max_num_seqs=64, max_num_batched_tokens=1024,
                dtype="float32", device="cpu", compile=False, MAX_N="16")
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def triton(tmp_path_factory, tiny_model_dir):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": tiny_model_dir, **SETTINGS})
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


@pytest.fixture(scope="module")
def api(triton, tiny_model_dir):
    with OpenAIServer(triton.grpc_url, tokenizer=tiny_model_dir, extra_args=["--max-header-bytes", "32768"]) as running:
        yield running


def blocks_in_use(triton: TritonServer) -> float:
    prefix = 'pagedbackend:kv_blocks_used{model="paged_llm",version="1"} '
    line = next(line for line in triton.metrics().splitlines() if line.startswith(prefix))
    return float(line[len(prefix):])


# ---------------------------------------------------------------- OpenAI API

@pytest.mark.timeout(120)
@pytest.mark.parametrize("fields, param, words", [
    ({"n": 1_000_000}, "n", ["n"]),
    ({"logprobs": 10_000}, "logprobs", ["logprobs"]),
    ({"stop": ["a"] * 100_000}, "stop", ["100000 stop strings", "limit is 64"]),
    ({"stop": ["a" * 5000]}, "stop", ["5000 characters"]),
    ({"max_tokens": 10 ** 12}, "max_tokens", ["context length"]),
    ({"seed": 1 << 70}, "seed", ["64-bit"]),
    ({"logit_bias": {str(i): 1 for i in range(5000)}}, "logit_bias", ["5000 entries"]),
    ({"bad_words": ["w"] * 1000}, "bad_words", ["1000 bad words"]),
    ({"best_of": 1000, "temperature": 1.0}, "best_of", ["limit is 128"]),
    ({"prompt": list(range(1000))}, "prompt", ["1000 tokens"]),
    ({"guided_regex": "a" * 60_000}, "structured_outputs", ["bytes of JSON"]),
], ids=["n", "logprobs", "stop-count", "stop-length", "max-tokens", "seed", "logit-bias", "bad-words",
        "best-of", "prompt-ids", "structured-size"])
def test_the_openai_api_refuses_each_limit_up_front_naming_the_field(api, fields, param, words):
    body = {"model": "paged_llm", "prompt": "Hi", "max_tokens": 4, **fields}

    start = time.perf_counter()
    reply = httpx.post(f"{api.base_url}/completions", json=body, timeout=60)
    elapsed = time.perf_counter() - start

    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]
    assert elapsed < 5.0   # refused before any work: no generation to wait for


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fields, param", [
    ({"tools": "not a list"}, "tools"),
    ({"tools": [1, 2]}, "tools"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [FUNCTION], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ({"tools": [FUNCTION], "tool_choice": 7}, "tool_choice"),
    ({"tools": [FUNCTION] * 129}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 40_000}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                         for i in range(500)}}}}}, "structured_outputs"),
], ids=["not-a-list", "numbers", "function-text", "parameters-list", "choice-function-text", "choice-number",
        "too-many", "too-large", "response-format-size"])
def test_malformed_or_oversized_tools_get_a_400_not_a_crash(api, fields, param):
    body = {"model": "paged_llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}

    reply = httpx.post(f"{api.base_url}/chat/completions", json=body, timeout=60)

    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.mark.timeout(60)
def test_an_oversized_header_gets_a_431_openai_error_object(api):
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")

    assert head.startswith(b"HTTP/1.1 431") and b"application/json" in head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "32768 bytes" in error["message"]
    assert httpx.get(f"{api.url}/health", timeout=30).status_code == 200


# ---------------------------------------------------------------- Triton's ports

@pytest.mark.timeout(120)
@pytest.mark.parametrize("params, words", [
    ({"n": 1_000_000, "temperature": 1.0}, ["n: 1000000 outputs; the limit is 16"]),
    ({"n": 17, "temperature": 1.0}, ["n: 17 outputs; the limit is 16"]),
    ({"n": 2, "best_of": 500, "temperature": 1.0}, ["best_of: 500"]),
    ({"stop": ["a"] * 65}, ["stop: 65 stop strings"]),
    ({"stop": ["a" * 2000]}, ["stop: a string of 2000 characters"]),
    ({"max_tokens": 10 ** 12}, ["max_tokens", "context length"]),
    ({"seed": 1 << 70}, ["seed", "64-bit"]),
    ({"logit_bias": {str(i): 1 for i in range(2000)}}, ["logit_bias: 2000 entries"]),
], ids=["n-million", "n-over-setting", "best-of", "stop-count", "stop-length", "max-tokens", "seed", "logit-bias"])
@pytest.mark.parametrize("route", ["grpc", "http-tensor", "http-parameters"])
def test_tritons_ports_refuse_each_limit_naming_the_field(triton, params, words, route):
    params = {"max_tokens": 4, **params}
    start = time.perf_counter()
    with pytest.raises(ServerError) as refused:
        if route == "grpc":
            generate("Hi", params, url=triton.grpc_url, timeout=60)
        elif route == "http-tensor":
            for _ in http_stream("Hi", params, url=triton.http_url, timeout=60):
                pass
        else:   # request parameters are scalars: lists and objects as JSON text
            scalars = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in params.items()}
            for _ in http_stream("Hi", scalars, url=triton.http_url, timeout=60, as_request_parameters=True):
                pass
    assert all(w in str(refused.value) for w in words), str(refused.value)
    assert time.perf_counter() - start < 5.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ids", [[-1], [5, -(2 ** 40)], [2 ** 40], [2 ** 63 - 1]])
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_tritons_http_routes_refuse_token_ids_outside_the_vocabulary_with_a_400(triton, ids, route):
    body = {"input_ids": ids, "sampling_parameters": json.dumps({"max_tokens": 2})}

    reply = httpx.post(f"{triton.http_url}/v2/models/paged_llm/{route}", json=body, timeout=60)

    # The model's refusal is its first response: both routes answer it with its status.
    assert reply.status_code == 400, reply.text
    assert f"prompt token id {ids[-1]} is not an integer in the vocabulary" in reply.text, reply.text
    assert "could not start the request" not in reply.text


@pytest.mark.timeout(120)
def test_a_deeply_nested_lora_control_is_a_400_not_an_internal_error(triton):
    body = {"text_input": "Hi", "lora_control": "[" * 20_000 + "]" * 20_000}

    reply = httpx.post(f"{triton.http_url}/v2/models/paged_llm/generate", json=body, timeout=60)

    assert reply.status_code == 400, reply.text
    assert "lora_control is not valid JSON" in reply.json()["error"], reply.text


# ---------------------------------------------------------------- afterwards

@pytest.mark.timeout(120)
def test_after_the_bad_requests_both_servers_still_serve_and_no_block_is_left_in_use(triton, api):
    for _ in range(3):   # a few more refusals, then real work
        httpx.post(f"{api.base_url}/completions", json={"prompt": "Hi", "stop": ["a"] * 100}, timeout=60)
    completion = httpx.post(f"{api.base_url}/completions",
                            json={"prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}, timeout=60)
    direct = generate("Hi", {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}, url=triton.grpc_url, timeout=60)

    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
    assert direct.num_output_tokens == [3]
    deadline = time.monotonic() + 10
    while blocks_in_use(triton) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert blocks_in_use(triton) == 0
