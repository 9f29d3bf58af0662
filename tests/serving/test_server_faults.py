"""No client can kill, wedge or stall the server (issues 10 and 15), against a
real tritonserver on the tiny model, one server for the module: requests that
used to kill the engine or wedge its queue get a clear error while the server
keeps serving; a fault in one request's handling ends that request alone; huge
prompts and HTTP bodies are refused at once; 100 streams with 10 cancelled
leave no block behind."""
import asyncio
import json
import random
import threading
import time
import urllib.request

import pytest

from client import ServerError, acollect, generate, grpc_stream, grpc_stream_async
from fault_injection import make_faulty_repository
from loadtest.harness.triton import TritonServer

pytestmark = pytest.mark.slow

# At most 8 sequences run at once, so requests queue up behind one another.
SETTINGS = dict(block_size=16, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=1024,
                dtype="float32", device="cpu", compile=False)
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
POISON_PROMPT = "Zebras poison the detokeniser"


@pytest.fixture(scope="module")
def poison_ids(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir).encode(POISON_PROMPT)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, poison_ids):
    # The model carries a test-only fault: detokenising raises for the poison prompt alone.
    repo = make_faulty_repository(tmp_path_factory.mktemp("repo"), {"model": tiny_model_dir, **SETTINGS},
                                  "detokenise", poison_ids)
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


def metric(server: TritonServer, name: str) -> float:
    prefix = f'pagedbackend:{name}{{model="paged_llm",version="1"}} '
    for line in server.metrics().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"pagedbackend:{name} is not on /metrics")


def wait_for_metric(server: TritonServer, name: str, predicate, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    value = metric(server, name)
    while not predicate(value) and time.monotonic() < deadline:
        time.sleep(0.05)
        value = metric(server, name)
    return value


def wait_until_idle(server: TritonServer, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(metric(server, name) == 0 for name in ("num_requests_running", "num_requests_waiting",
                                                      "kv_blocks_used")):
            return True
        time.sleep(0.1)
    return False


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def assert_healthy_and_serving(server: TritonServer):
    """Ready and live, the model ready, a request served, no block held."""
    assert [status(server.http_url + path) for path in
            ("/v2/health/live", "/v2/health/ready", "/v2/models/paged_llm/ready")] == [200, 200, 200]
    result = generate("The sky is", {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
                      url=server.grpc_url, timeout=60)
    assert result.finish_reasons == ["length"] and result.num_output_tokens == [3]
    assert wait_for_metric(server, "kv_blocks_used", lambda v: v == 0) == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("params", [
    {"max_tokens": 4, "logprobs": 1_000_000},
    {"max_tokens": 4, "logprobs": 49153},
    {"max_tokens": 4, "min_tokens": 1, "stop_token_ids": [1_000_000_000]},
], ids=["logprobs-1e6", "logprobs-49153", "stop-token-beyond-vocabulary"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_requests_that_used_to_kill_the_engine_get_an_error_and_it_keeps_serving(server, protocol, params):
    url = server.grpc_url if protocol == "grpc" else server.http_url

    with pytest.raises(ServerError):
        generate("Hello", params, protocol=protocol, url=url, timeout=60)

    assert_healthy_and_serving(server)


@pytest.mark.timeout(300)
def test_a_fault_in_one_requests_detokenising_ends_it_alone(server):
    prompts = ["Once upon a time", "def fibonacci(n):", "The capital of France is"]
    alone = [generate(p, GREEDY, url=server.grpc_url, timeout=60).texts for p in prompts]
    failures_before = metric(server, "request_failures_total")

    async def together():
        import tritonclient.grpc.aio as aioclient
        client = aioclient.InferenceServerClient(server.grpc_url)
        try:
            poisoned = {"n": 2, "temperature": 0.8, "max_tokens": 12}
            return await asyncio.gather(
                *(acollect(grpc_stream_async(p, GREEDY, client=client, timeout=120)) for p in prompts),
                acollect(grpc_stream_async(POISON_PROMPT, poisoned, client=client, timeout=120)),
                return_exceptions=True)
        finally:
            await client.close()
    *healthy, poisoned = asyncio.run(together())

    assert isinstance(poisoned, ServerError) and "injected detokenisation fault" in str(poisoned)
    assert [r.texts for r in healthy] == alone
    assert wait_for_metric(server, "request_failures_total", lambda v: v > failures_before) == failures_before + 1
    assert_healthy_and_serving(server)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_more_sequences_than_max_num_seqs_is_refused_at_once_and_blocks_no_one(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url

    with pytest.raises(ServerError, match="needs 9 sequences at once .* max_num_seqs is 8"):
        generate("Hello", {"n": 9, "temperature": 0.8, "max_tokens": 1}, protocol=protocol, url=url, timeout=30)

    assert metric(server, "num_requests_waiting") == 0
    assert_healthy_and_serving(server)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_5_mb_prompt_is_refused_before_tokenising_and_delays_no_one(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    outcome = {}

    def send_huge():
        start = time.monotonic()
        try:
            generate("x" * 5_000_000, {"max_tokens": 2}, protocol=protocol, url=url, timeout=60)
        except ServerError as exc:
            outcome["error"], outcome["seconds"] = str(exc), time.monotonic() - start
    huge = threading.Thread(target=send_huge)
    huge.start()
    time.sleep(0.05)  # the huge prompt is on its way or being refused
    small = generate("The sky is", GREEDY, url=server.grpc_url, timeout=60)
    huge.join()

    assert "text_input" in outcome["error"] and "max_prompt_chars" in outcome["error"]
    # Tokenising 5 MB takes 5-10 s on this CPU: both bounds say it never happened.
    assert outcome["seconds"] < 2.0
    assert small.ttft < 2.0 and small.num_output_tokens == [12]
    assert_healthy_and_serving(server)


def post(url: str, body: bytes, content_type: str):
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [5_000_000, 16_000_000], ids=["5MB", "16MB"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "application/json"],
                         ids=["form", "json"])
def test_oversized_http_bodies_get_a_4xx_on_every_endpoint_and_the_server_survives(server, size, content_type):
    # tritonserver 2.51 used to die on a form-urlencoded body over ~4 MB (docs/robustness.md).
    text = "x" * size
    generate_body = json.dumps({"text_input": text, "stream": True,
                                "sampling_parameters": json.dumps({"max_tokens": 2})}).encode()
    replies = {path: post(server.http_url + path, generate_body, content_type)
               for path in ("/v2/models/paged_llm/generate_stream", "/v2/models/paged_llm/generate",
                            "/v2/health/ready")}
    replies["/metrics"] = post(server.metrics_url, generate_body, content_type)

    assert server.process.poll() is None
    assert all(400 <= code < 500 for code, _ in replies.values()), replies
    for path in ("/v2/models/paged_llm/generate_stream", "/v2/models/paged_llm/generate"):
        assert "text_input" in replies[path][1] and "max_prompt_chars" in replies[path][1]
    assert_healthy_and_serving(server)


@pytest.mark.timeout(600)
def test_100_streams_with_10_cancelled_at_random_points_the_rest_complete_exactly(server):
    rng = random.Random(7)
    lengths = [rng.randint(8, 32) for _ in range(100)]
    cancel_after = {i: rng.randint(1, 6) for i in rng.sample(range(100), 10)}  # deltas before hanging up

    async def one(client, i):
        deltas = grpc_stream_async(f"Request {i} says", {"max_tokens": lengths[i], "ignore_eos": True,
                                                         "temperature": 0.0}, client=client, timeout=400)
        if i not in cancel_after:
            return await acollect(deltas)
        received = 0
        async for _ in deltas:
            received += 1
            if received == cancel_after[i]:
                break
        await deltas.aclose()  # cancels the request on the server
        return received

    async def run_all():
        import tritonclient.grpc.aio as aioclient
        client = aioclient.InferenceServerClient(server.grpc_url)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(100)))
        finally:
            await client.close()
    results = asyncio.run(run_all())

    completed = {i: r for i, r in enumerate(results) if i not in cancel_after}
    assert all(r.finish_reasons == ["length"] and r.num_output_tokens == [lengths[i]]
               for i, r in completed.items())
    assert all(results[i] == n for i, n in cancel_after.items())
    assert wait_until_idle(server)
    assert metric(server, "idle_leak_checks_failed_total") == 0
    assert_healthy_and_serving(server)


@pytest.mark.timeout(180)
def test_an_http_client_that_hangs_up_while_queued_is_dropped_at_its_first_token(server):
    """tritonserver 2.51 pauses an HTTP request's connection until its first
    response, so a hang-up is seen only then: the request must end there."""
    import socket
    # Two wide requests share the 8 sequence slots, 4 each (one request decodes at
    # most half of them while others are present), so a 2-sequence request must wait.
    blockers = [grpc_stream(f"Story {i}", {"n": 8, "temperature": 0.8, "max_tokens": 400, "ignore_eos": True},
                            url=server.grpc_url, timeout=120) for i in range(2)]
    for blocker in blockers:
        next(blocker)
    body = json.dumps({"text_input": "Waiting", "stream": True,
                       "parameters": {"n": 2, "temperature": 0.8, "max_tokens": 200, "ignore_eos": True}}).encode()
    host, port = server.http_url[len("http://"):].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v2/models/paged_llm/generate_stream HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        waiting = wait_for_metric(server, "num_requests_waiting", lambda v: v == 1)
    generated_before = metric(server, "generation_tokens_total")

    for blocker in blockers:
        blocker.close()  # the queued request runs now, into a closed connection

    assert waiting == 1
    assert wait_until_idle(server)
    # Run to the end it would add 2 x 200 tokens; it is stopped after its first few.
    assert metric(server, "generation_tokens_total") - generated_before < 200
    assert_healthy_and_serving(server)
