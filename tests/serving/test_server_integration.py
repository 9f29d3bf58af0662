"""The paged_llm model behind a real tritonserver: streaming over gRPC and HTTP,
concurrency, cancellation, refused requests, parallel sampling and beam search,
and the /metrics it exports. One server per module, on a tiny random model."""
import asyncio
import json
import time

import numpy as np
import pytest

from strict_json import strict_loads
from client import ServerError, acollect, generate, grpc_stream, grpc_stream_async, http_stream
from loadtest.harness.triton import TritonServer
from pagedbackend.serving.repository import make_model_repository

pytestmark = pytest.mark.slow

# Small pool: 96 blocks x 16 positions; the tiny model's context is 512.
SETTINGS = dict(block_size=16, num_kv_blocks=96, max_num_seqs=64, max_num_batched_tokens=1024,
                dtype="float32", device="cpu", compile=False)
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": tiny_model_dir, **SETTINGS})
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """The offline engine with the same settings, for reference outputs."""
    from pagedbackend import LLM
    return LLM(model=str(tiny_model_dir), **SETTINGS)


def metric(server: TritonServer, name: str) -> float:
    prefix = f'pagedbackend:{name}{{model="paged_llm",version="1"}} '
    for line in server.metrics().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"pagedbackend:{name} is not on /metrics")


def wait_for_metric(server: TritonServer, name: str, predicate, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    value = metric(server, name)
    while not predicate(value) and time.monotonic() < deadline:
        time.sleep(0.05)
        value = metric(server, name)
    return value


def assert_still_serving(server: TritonServer):
    result = generate(PROMPTS[0], {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
                      url=server.grpc_url, timeout=60)
    assert result.finish_reasons == ["length"] and result.num_output_tokens == [3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_and_http_streams_give_the_offline_greedy_text(server, offline, prompt):
    from pagedbackend import SamplingParams
    expected = offline.generate(prompt, SamplingParams(**GREEDY))[0].outputs[0]

    over_grpc = generate(prompt, GREEDY, protocol="grpc", url=server.grpc_url, timeout=120)
    over_http = generate(prompt, GREEDY, protocol="http", url=server.http_url, timeout=120)

    assert over_grpc.texts == over_http.texts == [expected.text]
    assert over_grpc.num_output_tokens == over_http.num_output_tokens == [len(expected.token_ids)]
    assert over_grpc.finish_reasons == over_http.finish_reasons == ["length"]
    assert len(over_grpc.deltas) > 1 and over_grpc.ttft < over_grpc.latency  # really streamed


@pytest.mark.timeout(120)
def test_cumulative_logprob_comes_only_when_asked_and_equals_the_offline_one(server, offline):
    from pagedbackend import SamplingParams
    group = offline.engine.add_request("logprob", PROMPTS[0], SamplingParams(**GREEDY),
                                       cumulative_logprob=True)
    while offline.engine.has_unfinished_requests():
        offline.engine.step()
    expected = group.finished_seqs[0].cumulative_logprob

    asked = generate(PROMPTS[0], GREEDY, url=server.grpc_url, cumulative_logprob=True, timeout=60)
    not_asked = generate(PROMPTS[0], GREEDY, url=server.http_url, protocol="http", timeout=60)

    assert expected < 0 and asked.cumulative_logprobs[0] == pytest.approx(expected, abs=1e-3)
    assert not_asked.cumulative_logprobs == [None]


@pytest.mark.timeout(120)
def test_without_streaming_one_response_holds_the_prompt_and_the_whole_text(server):
    streamed = generate(PROMPTS[1], GREEDY, url=server.grpc_url, timeout=60)

    whole = generate(PROMPTS[1], GREEDY, url=server.grpc_url, stream=False, timeout=60)
    excluded = generate(PROMPTS[1], GREEDY, url=server.grpc_url, stream=False, exclude_input=True, timeout=60)

    assert len(whole.deltas) == 1 and whole.texts == [PROMPTS[1] + streamed.text]
    assert excluded.texts == streamed.texts and excluded.num_output_tokens == [12]
    assert whole.num_input_tokens == streamed.num_input_tokens > 0


@pytest.mark.timeout(300)
def test_32_concurrent_streams_complete_and_release_every_kv_block(server):
    params = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}

    async def run_all():
        import tritonclient.grpc.aio as aioclient
        client = aioclient.InferenceServerClient(server.grpc_url)
        try:
            return await asyncio.gather(*(
                acollect(grpc_stream_async(f"Request {i} says", params, client=client, timeout=240))
                for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(run_all())

    assert [r.finish_reasons for r in results] == [["length"]] * 32
    assert [r.num_output_tokens for r in results] == [[16]] * 32
    assert wait_for_metric(server, "kv_blocks_used", lambda v: v == 0) == 0
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "kv_slots_allocated") == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [grpc_stream, http_stream], ids=["grpc", "http"])
def test_a_cancelled_stream_frees_its_blocks_and_later_requests_are_unaffected(server, stream):
    url = server.grpc_url if stream is grpc_stream else server.http_url
    before = generate(PROMPTS[2], GREEDY, url=server.grpc_url, timeout=60).text
    deltas = stream(PROMPTS[0], {"max_tokens": 400, "ignore_eos": True}, url=url, timeout=120)
    received = [delta for _, delta in zip(range(5), deltas)]
    in_use = wait_for_metric(server, "kv_blocks_used", lambda v: v > 0)

    deltas.close()  # hangs up: the server sees the request cancelled

    assert len(received) == 5 and in_use > 0
    assert wait_for_metric(server, "kv_blocks_used", lambda v: v == 0) == 0
    assert metric(server, "num_requests_running") == 0
    assert generate(PROMPTS[2], GREEDY, url=server.grpc_url, timeout=60).text == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prompt, params, message", [
    ("Hello", {"temperature": -0.5}, "temperature must be in [0, inf]"),
    ("Hello", {"max_tokens": 4, "logprobs": 1000000}, "logprobs must be an integer in [0, 20]"),
    ("Hello", {"max_tokens": 4, "min_tokens": 1, "stop_token_ids": [1000000000]},
     "stop_token_ids: token id 1000000000 is outside the vocabulary"),
    ("Hello", {"temperature": "NaN"}, "temperature must be a finite number"),
    ("Hello", {"stop": 5}, "stop must be a string or a list of strings"),
    ("Hello", {"top_p": 0}, "top_p"),
    ("Hello", {"max_tokens": "lots"}, "max_tokens"),
    ("Hello", {"bogus_knob": 1}, "unknown sampling parameter(s): bogus_knob"),
    ("", {"max_tokens": 4}, "prompt is empty"),
    ("word " * 600, {"max_tokens": 4}, "exceeds the maximum context length"),
    ("Hello", {"max_tokens": 400, "n": 4, "best_of": 4, "temperature": 1.0}, "KV blocks"),
], ids=["negative-temperature", "huge-logprobs", "stop-token-outside-vocabulary", "nan-temperature",
        "stop-not-a-string", "zero-top_p", "non-numeric", "unknown-parameter", "empty-prompt",
        "over-long-prompt", "beyond-kv-pool"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_bad_request_gets_an_error_naming_the_problem(server, protocol, prompt, params, message):
    url = server.grpc_url if protocol == "grpc" else server.http_url

    with pytest.raises(ServerError) as refused:
        generate(prompt, params, protocol=protocol, url=url, timeout=60)

    assert message in str(refused.value)
    assert_still_serving(server)


def raw_grpc_error(server: TritonServer, tensors) -> str:
    """Send hand-made tensors over a gRPC stream; return the error text."""
    import tritonclient.grpc as grpcclient
    errors = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: errors.append(error))
        inputs = []
        for name, datatype, value in tensors:
            tensor = grpcclient.InferInput(name, list(value.shape), datatype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        client.async_stream_infer("paged_llm", inputs)
        deadline = time.monotonic() + 30
        while not errors and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        client.stop_stream()  # no cancel: the request is complete (cancelling it pins the model)
        client.close()
    assert errors and errors[0] is not None, "expected an error response"
    return str(errors[0])


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tensors, words", [
    ([("text_input", "INT32", np.array([7], dtype=np.int32))], ["text_input", "INT32", "BYTES"]),
    ([("text_input", "BYTES", np.array([b"a", b"b"], dtype=np.object_))], ["text_input", "shape"]),
    ([("text_input", "BYTES", text("Hi")), ("stream", "BYTES", text("yes"))], ["stream", "BOOL"]),
    ([("text_input", "BYTES", text("Hi")), ("sampling_parameters", "BYTES", text("{max_tokens: 3"))],
     ["sampling_parameters is not valid JSON"]),
    ([("text_input", "BYTES", np.array([b"\xff\xfe"], dtype=np.object_))], ["text_input", "UTF-8"]),
    ([("text_input", "BYTES", text("Hi")), ("stream", "BOOL", np.array([True])),
      ("exclude_input_in_output", "BOOL", np.array([False]))], ["exclude_input_in_output"]),
], ids=["dtype", "shape", "flag-dtype", "bad-json", "bad-utf8", "stream-with-prompt-echo"])
def test_malformed_tensors_get_an_error_naming_them(server, tensors, words):
    message = raw_grpc_error(server, tensors)

    assert all(word in message for word in words), message
    assert_still_serving(server)


@pytest.mark.timeout(120)
def test_generate_endpoint_request_parameters_are_sampling_parameters(server):
    result = collect_http(server, {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True})

    assert result.num_output_tokens == [5] and result.finish_reasons == ["length"]
    with pytest.raises(ServerError, match="unknown sampling parameter\\(s\\): colour"):
        collect_http(server, {"colour": "blue"})


@pytest.mark.timeout(120)
def test_list_fields_go_in_generate_request_parameters_as_json_text(server, offline):
    """Triton's generate endpoints take only scalar parameters: stop, logit_bias
    and the id lists come as JSON text there, a plain stop string as itself."""
    from pagedbackend import SamplingParams
    greedy = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    text = offline.generate(PROMPTS[0], SamplingParams(**greedy))[0].outputs[0].text
    word = text[4:7]
    for stop in (json.dumps([word, "\u2603\u2603"]), word):
        result = collect_http(server, {**greedy, "stop": stop})
        assert result.finish_reasons == ["stop"] and result.texts[0] == text[:text.index(word)], (stop, result)
    ids = offline.generate(PROMPTS[0], SamplingParams(**greedy))[0].outputs[0].token_ids
    banned = collect_http(server, {**greedy, "logit_bias": json.dumps({str(ids[0]): -100})})
    assert banned.texts[0] != text


@pytest.mark.timeout(120)
def test_prompt_logprobs_come_back_as_json_equal_to_the_offline_engine(server, offline):
    import urllib.request
    from pagedbackend import SamplingParams
    params = {"max_tokens": 2, "temperature": 0.0, "prompt_logprobs": 2}
    body = {"text_input": PROMPTS[0], "return_prompt_logprobs": True, "parameters": params}
    request = urllib.request.Request(f"{server.http_url}/v2/models/paged_llm/generate", json.dumps(body).encode())
    got = strict_loads(strict_loads(urllib.request.urlopen(request, timeout=60).read())["prompt_logprobs"])
    expected = offline.generate(PROMPTS[0], SamplingParams(**params))[0].prompt_logprobs
    assert got[0] is None and len(got) == len(expected) > 2
    for mine, theirs in zip(got[1:], expected[1:]):
        assert list(mine) == [str(t) for t in theirs]
        for token, entry in theirs.items():
            assert abs(mine[str(token)]["logprob"] - entry.logprob) < 1e-5
            assert mine[str(token)]["rank"] == entry.rank and mine[str(token)]["decoded_token"] == entry.decoded_token


def collect_http(server, params):
    from client import collect
    return collect(http_stream(PROMPTS[0], params, url=server.http_url, as_request_parameters=True,
                               timeout=60))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_parallel_sampling_returns_n_outputs_reproducibly_with_a_seed(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    params = {"n": 2, "temperature": 0.9, "seed": 11, "max_tokens": 10, "ignore_eos": True}

    first = generate(PROMPTS[1], params, protocol=protocol, url=url, timeout=120)
    second = generate(PROMPTS[1], params, protocol=protocol, url=url, timeout=120)

    assert len(first.texts) == 2 and all(first.texts)
    assert first.num_output_tokens == [10, 10] and first.finish_reasons == ["length", "length"]
    assert second.texts == first.texts


@pytest.mark.timeout(180)
def test_beam_search_returns_width_outputs_matching_the_offline_engine(server, offline):
    from pagedbackend import SamplingParams
    params = {"n": 2, "best_of": 2, "use_beam_search": True, "temperature": 0.0, "max_tokens": 8,
              "ignore_eos": True}
    expected = [o.text for o in offline.generate(PROMPTS[0], SamplingParams(**params))[0].outputs]

    result = generate(PROMPTS[0], params, url=server.grpc_url, timeout=120)

    assert len(result.texts) == 2 and result.texts[0] != result.texts[1]
    assert result.texts == expected
    assert all(reason in ("length", "stop") for reason in result.finish_reasons)


@pytest.mark.timeout(60)
def test_metrics_are_exported_with_model_and_version_labels(server):
    generate(PROMPTS[0], {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}, url=server.grpc_url)
    names = ["kv_cache_usage_ratio", "kv_blocks_used", "kv_blocks_total", "num_requests_running",
             "num_requests_waiting", "num_requests_swapped", "kv_positions_stored", "kv_slots_allocated",
             "kv_blocks_shared", "kv_blocks_cached_free", "prompt_tokens_total", "generation_tokens_total",
             "num_preemptions_total", "prefix_cache_hits_total", "prefix_cache_queries_total",
             "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
             "e2e_request_latency_seconds_count", "engine_steps_total", "engine_step_seconds_total",
             "engine_forward_seconds_total", "engine_sample_seconds_total"]

    values = {name: wait_for_metric(server, name, lambda v: True) for name in names}

    assert values["kv_blocks_total"] == SETTINGS["num_kv_blocks"]
    assert values["generation_tokens_total"] >= 4 and values["prompt_tokens_total"] > 0
    assert values["time_to_first_token_seconds_count"] >= 1
    assert values["e2e_request_latency_seconds_count"] >= 1
    assert 0.0 <= values["kv_cache_usage_ratio"] <= 1.0
    assert values["engine_steps_total"] >= 4  # a prefill and three decodes at least
    assert values["engine_step_seconds_total"] >= values["engine_forward_seconds_total"] > 0
    assert values["engine_step_seconds_total"] >= values["engine_sample_seconds_total"] > 0


@pytest.mark.timeout(900)
def test_the_model_step_compiles_inside_the_stub(tmp_path, tiny_model_dir, offline):
    # The stub's embedded interpreter starts in the C locale; inductor's compile
    # failed there on the first non-ASCII byte it read and the step ran eager,
    # with one warning and no error. The step must compile there and give the
    # eager engine's greedy text.
    from pagedbackend import SamplingParams
    from pagedbackend.worker.compiled import compile_unavailable
    import torch
    reason = compile_unavailable(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"torch.compile cannot run here: {reason}")
    # torch.compile inside the stub (step_package false: a package is built in a process of its own).
    repo = make_model_repository(tmp_path / "repo", {"model": tiny_model_dir, **SETTINGS, "compile": True,
                                                     "step_package": False})
    with TritonServer(repo, ready_timeout_s=600, wait_for_compiled_step=True) as running:
        results = [generate(prompt, GREEDY, url=running.grpc_url, timeout=120) for prompt in PROMPTS]
        log = running.log_path.read_text(errors="replace")
        compiled = running.metrics()
    assert "runs eager" not in log, log[-3000:]
    assert "the compiled model step serves from now on" in log, log[-3000:]
    assert 'pagedbackend:model_step_compiled{model="paged_llm",version="1"} 1' in compiled
    expected = [out.outputs[0].text for out in offline.generate(PROMPTS, SamplingParams(**GREEDY))]
    assert [r.texts[0] for r in results] == expected
