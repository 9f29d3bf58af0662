"""Who may talk to the servers (docs/security.md): API keys on the OpenAI API
(Bearer, 401 with an OpenAI error object) and on tritonserver's HTTP and gRPC
ports (its restricted APIs), the admin-only APIs, the refusal of a public
bind without a key, and internal names kept out of error messages."""
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pagedbackend.serving.constants import ADMIN_HEADER, GRPC_ADMIN_HEADER
from loadtest.harness.triton import TritonServer
from pagedbackend.serving.security import (API_KEY_ENV, API_KEY_HEADER, GRPC_API_KEY_HEADER, api_keys, bearer,
                                           is_loopback, key_matches, redact, refuse_public_bind)
from echo_repository import REPO, write_echo_repository

KEY, OTHER = "sk-test-0123456789", "sk-second-key"


# ---------------------------------------------------------------- keys

def test_keys_come_from_the_options_else_the_comma_separated_environment():
    assert api_keys(["a", "b", "a"], {API_KEY_ENV: "x"}) == ["a", "b"]
    assert api_keys([], {API_KEY_ENV: " x , y ,,"}) == ["x", "y"]
    assert api_keys([], {}) == []
    with pytest.raises(ValueError, match="printable ASCII"):
        api_keys(["has space"], {})


def test_a_key_matches_only_exactly_and_bearer_takes_the_token():
    assert key_matches(KEY, [OTHER, KEY]) and not key_matches(KEY[:-1], [KEY])
    assert not key_matches(KEY + "x", [KEY]) and not key_matches(None, [KEY]) and not key_matches("", [KEY])
    assert not key_matches("é" + KEY, [KEY])
    assert bearer(f"Bearer {KEY}") == KEY and bearer(f"bearer  {KEY} ") == KEY
    assert bearer(f"Basic {KEY}") is None and bearer("Bearer") is None and bearer(None) is None


def test_a_public_bind_without_a_key_is_refused_unless_allowed():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("::")
    message = refuse_public_bind("0.0.0.0", [], False, "tritonserver")
    assert "--api-key" in message and "--allow-public-without-api-key" in message and API_KEY_ENV in message
    assert refuse_public_bind("0.0.0.0", [KEY], False, "x") is None
    assert refuse_public_bind("0.0.0.0", [], True, "x") is None
    assert refuse_public_bind("127.0.0.1", [], False, "x") is None


@pytest.mark.parametrize("module", ["pagedbackend.serve", "pagedbackend.serving.openai_server"])
def test_both_command_lines_refuse_a_public_bind_without_a_key_at_start(module):
    env = {k: v for k, v in __import__("os").environ.items() if k != API_KEY_ENV}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", module, "--host", "0.0.0.0"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "refusing to serve" in result.stderr and "--allow-public-without-api-key" in result.stderr
    assert time.monotonic() - started < 60


def test_internal_names_are_redacted_from_error_messages():
    message = redact("Failed to open 'triton_python_backend_shm_region_7f3a-2' (/dev/shm/triton_python_"
                     "backend_shm_region_7f3a-2) in /work/.venv/lib/python3.11/site-packages/torch/x.py: no")
    assert "shm_region" not in message and "/dev/shm" not in message and "site-packages" not in message
    assert "<shared-memory region>" in message and "<server file>" in message and message.endswith(": no")
    assert redact("stop must be a list of strings") == "stop must be a list of strings"


# ---------------------------------------------------------------- tritonserver's ports

def post(url: str, body: dict, headers=None) -> tuple:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def get(url: str, headers=None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


ECHO_BODY = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tritonservers_inference_needs_the_api_key_and_its_other_apis_the_admin_key(tmp_path):
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    repo = write_echo_repository(tmp_path / "repo")
    with TritonServer(repo, ready_timeout_s=60, api_key=KEY) as server:
        http = server.http_url
        infer = f"{http}/v2/models/echo/infer"
        anonymous = post(infer, ECHO_BODY)
        wrong = post(infer, ECHO_BODY, {API_KEY_HEADER: OTHER})
        keyed = post(infer, ECHO_BODY, {API_KEY_HEADER: KEY})
        open_probes = [get(f"{http}/v2/health/ready"), get(f"{http}/v2/models/echo/ready")]
        metadata = [get(f"{http}/v2/models/echo"), get(f"{http}/v2/models/echo/config"),
                    get(f"{http}/v2/models/echo", {API_KEY_HEADER: KEY})]
        admin_only = [f"{http}/v2/systemsharedmemory/status", f"{http}/v2/cudasharedmemory/status",
                      f"{http}/v2/models/stats", f"{http}/v2/trace/setting", f"{http}/v2/logging"]
        refused = [get(url, {API_KEY_HEADER: KEY}) for url in admin_only]
        admitted = [get(url, {ADMIN_HEADER: server.admin_key}) for url in admin_only[:1] + admin_only[2:]]
        register = post(f"{http}/v2/systemsharedmemory/region/r/register",
                        {"key": "/triton_python_backend_shm_region_1", "offset": 0, "byte_size": 64},
                        {API_KEY_HEADER: KEY})

        text_input = grpcclient.InferInput("text_input", [1], "BYTES")
        text_input.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
        with grpcclient.InferenceServerClient(server.grpc_url) as grpc:
            with pytest.raises(InferenceServerException) as grpc_anonymous:
                grpc.infer("echo", [text_input])
            grpc_keyed = grpc.infer("echo", [text_input], headers={GRPC_API_KEY_HEADER: KEY})
            with pytest.raises(InferenceServerException):
                grpc.get_system_shared_memory_status(headers={GRPC_API_KEY_HEADER: KEY})
            grpc_admin = grpc.get_system_shared_memory_status(headers={GRPC_ADMIN_HEADER: server.admin_key})

    assert anonymous[0] == 403 and API_KEY_HEADER in anonymous[1] and wrong[0] == 403
    assert keyed == (200, keyed[1]) and json.loads(keyed[1])["outputs"][0]["data"] == ["echo:hi"]
    assert open_probes == [200, 200]
    assert metadata == [403, 403, 200]
    assert refused == [403] * 5 and all(status == 200 for status in admitted), (refused, admitted)
    assert register[0] == 403
    assert "permission" in str(grpc_anonymous.value).lower() or API_KEY_HEADER in str(grpc_anonymous.value)
    assert grpc_keyed.as_numpy("text_output")[0] == b"echo:hi" and grpc_admin is not None


# ---------------------------------------------------------------- the OpenAI API

@pytest.fixture(scope="module")
def keyed_app(tiny_model_dir):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer
    from pagedbackend.serving.openai.app import Settings, create_app
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    # No tritonserver behind it: the key is checked before any route runs.
    app = create_app(Settings(triton_url="127.0.0.1:9", api_keys=[KEY, OTHER]), tokenizer=tokenizer)
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/paged_llm"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/v1/embeddings"),
          ("GET", "/openapi.json")]


@pytest.mark.parametrize("method, path", ROUTES)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x"])
def test_every_route_without_a_valid_key_gets_401_with_an_openai_error(keyed_app, method, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    reply = keyed_app.request(method, path, headers=headers, json={"model": "paged_llm", "prompt": "x"})

    assert reply.status_code == 401
    error = reply.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert "Bearer" in error["message"] and reply.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("key", [KEY, OTHER])
def test_each_key_opens_the_routes_and_health_stays_open(keyed_app, key):
    schema = keyed_app.get("/openapi.json", headers={"Authorization": f"Bearer {key}"})
    health = keyed_app.get("/health")

    assert schema.status_code == 200
    body = schema.json()["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/CompletionRequest"
    assert health.status_code == 503   # no tritonserver behind it, but no key needed to ask


def test_the_client_sends_the_given_key_else_the_first_of_the_environment(monkeypatch):
    from client import api_key_of, triton_headers
    monkeypatch.setenv(API_KEY_ENV, f"{KEY},{OTHER}")
    assert api_key_of() == KEY and api_key_of(OTHER) == OTHER
    assert triton_headers() == {API_KEY_HEADER: KEY} and triton_headers(grpc=True) == {GRPC_API_KEY_HEADER: KEY}
    monkeypatch.delenv(API_KEY_ENV)
    assert triton_headers() == {} and api_key_of() is None


# ---------------------------------------------------------------- requests in flight per key


JSON = {"Content-Type": "application/json"}


def test_a_key_over_its_concurrent_requests_gets_429_while_other_keys_are_served(tmp_path, tiny_model_dir):
    import socket
    from loadtest.harness.openai import OpenAIServer
    repo = write_echo_repository(tmp_path / "repo")
    with TritonServer(repo, ready_timeout_s=60) as triton, \
            OpenAIServer(triton.grpc_url, tokenizer=tiny_model_dir,
                         extra_args=["--model-name", "echo", "--api-key", KEY, "--api-key", OTHER,
                                     "--max-concurrent-per-key", "1"]) as api:
        tokenize = f"{api.url}/tokenize"
        body = {"model": "echo", "prompt": "hello"}
        # A request of KEY's whose body is still arriving holds KEY's one place.
        held = socket.create_connection(("127.0.0.1", api.port))
        held.sendall(f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
        try:
            deadline, over = time.monotonic() + 10, None
            while time.monotonic() < deadline:   # until the server has read the held head
                over = post(tokenize, body, {**JSON, "Authorization": f"Bearer {KEY}"})
                if over[0] == 429:
                    break
                time.sleep(0.05)
            other = post(tokenize, body, {**JSON, "Authorization": f"Bearer {OTHER}"})
            health = get(f"{api.url}/health")
        finally:
            held.close()
        deadline, after = time.monotonic() + 10, None
        while time.monotonic() < deadline:   # the place comes back once the held request ends
            after = post(tokenize, body, {**JSON, "Authorization": f"Bearer {KEY}"})
            if after[0] == 200:
                break
            time.sleep(0.05)
    assert over[0] == 429, over
    error = json.loads(over[1])["error"]
    assert error["code"] == "rate_limit_exceeded" and "max_concurrent_per_key" in error["message"]
    assert other[0] == 200 and json.loads(other[1])["tokens"] and health == 200
    assert after[0] == 200 and after[1] == other[1]
