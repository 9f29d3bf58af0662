"""What a user of NVIDIA's vllm_backend relies on, against a real tritonserver:
the additional outputs (return_* inputs, ``logprobs`` included) in every
combination with stream, exclude_input_in_output, n and beam search; vLLM's
metric names beside ours, chosen per model by METRIC_NAMES, and none with
REPORT_CUSTOM_METRICS false; the Grafana dashboard's queries; a repository with
a model that cannot load; the log line of a cancelled request.

One server for the module, on the tiny random model, with four models:
paged_llm (both metric namespaces), paged_llm_vllm (vLLM names only),
paged_llm_quiet (no custom metrics) and broken (its weights folder is missing).
"""
import json
import math
import pathlib
import queue
import re
import time
import urllib.request

import numpy as np
import pytest

from strict_json import strict_loads
from loadtest.harness.triton import TritonServer, is_model_ready, is_ready
from pagedbackend.serving.repository import make_model_repository

pytestmark = pytest.mark.slow

SETTINGS = dict(block_size=16, num_kv_blocks=96, max_num_seqs=64, max_num_batched_tokens=1024,
                dtype="float32", device="cpu", compile=False)
PROMPT = "The capital of France is"
FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
         "return_num_input_tokens", "return_num_output_tokens")
OUTPUT_OF = {"return_finish_reason": "finish_reason", "return_cumulative_logprob": "cumulative_logprob",
             "return_logprobs": "logprobs", "return_num_input_tokens": "num_input_tokens",
             "return_num_output_tokens": "num_output_tokens"}
MAX_TOKENS = 4
MODES = {
    "greedy-logprobs": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 2},
    "greedy": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
    "n2-logprobs": {"n": 2, "temperature": 0.8, "seed": 5, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "logprobs": 1},
    "beam": {"n": 2, "best_of": 2, "use_beam_search": True, "temperature": 0.0, "max_tokens": MAX_TOKENS,
             "ignore_eos": True},
}
# No flag, every flag, and each one alone (sent as explicit false otherwise).
FLAG_SETS = [(), FLAGS] + [(flag,) for flag in FLAGS]
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("repo")
    make_model_repository(root, {"model": tiny_model_dir, **SETTINGS})
    make_model_repository(root, {"model": tiny_model_dir, **SETTINGS, "METRIC_NAMES": "vllm"},
                          name="paged_llm_vllm")
    make_model_repository(root, {"model": tiny_model_dir, **SETTINGS, "REPORT_CUSTOM_METRICS": "false"},
                          name="paged_llm_quiet")
    make_model_repository(root, {"model": str(root / "no-such-weights")}, name="broken")
    with TritonServer(root, ready_timeout_s=300,
                      required_models=["paged_llm", "paged_llm_vllm", "paged_llm_quiet"]) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Offline outputs of the deterministic modes: mode -> RequestOutput."""
    from pagedbackend import LLM, SamplingParams
    llm = LLM(model=str(tiny_model_dir), **SETTINGS)
    return {mode: llm.generate(PROMPT, SamplingParams(**params))[0]
            for mode, params in MODES.items() if mode != "n2-logprobs"}


def infer(server, params: dict, stream: bool, exclude: bool, flags=(), model: str = "paged_llm",
          request_id: str = "", cancel_after: int = 0, timeout: float = 120.0) -> list:
    """One request over a gRPC stream with every return_* input sent (true for
    ``flags``); each response as {output name: list of values}. With
    ``cancel_after`` the stream is cancelled after that many responses."""
    import tritonclient.grpc as grpcclient
    values = {"text_input": np.array([PROMPT.encode()], dtype=np.object_), "stream": np.array([stream]),
              "exclude_input_in_output": np.array([exclude]),
              "sampling_parameters": np.array([json.dumps(params).encode()], dtype=np.object_),
              **{flag: np.array([flag in flags]) for flag in FLAGS}}
    inputs = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, [1], "BYTES" if value.dtype == np.object_ else "BOOL")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses, complete = [], False
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, request_id=request_id)
        deadline = time.monotonic() + timeout
        while not complete and (not cancel_after or len(responses) < cancel_after):
            result, error = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:
                raise AssertionError(f"request failed: {error}")
            response = result.get_response()
            responses.append({out.name: result.as_numpy(out.name).reshape(-1).tolist()
                              for out in response.outputs})
            final = response.parameters.get("triton_final_response")
            complete = final is None or final.bool_param
    finally:
        client.stop_stream(cancel_requests=not complete)
        client.close()
    return responses


def text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("exclude", [False, True], ids=["echo", "exclude-input"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_additional_outputs_in_every_combination(server, reference, stream, exclude, mode):
    params = MODES[mode]
    n = params.get("n", 1)
    if stream and not exclude:  # as vllm_backend: a stream never echoes the prompt, and says so
        with pytest.raises(AssertionError, match="exclude_input_in_output=false is not allowed with stream"):
            infer(server, params, stream, exclude, FLAGS)
        return
    for flags in FLAG_SETS:
        responses = infer(server, params, stream, exclude, flags)
        where = f"flags={flags}"

        expected_names = {"text_output"} | {OUTPUT_OF[flag] for flag in flags}
        assert all(set(r) == expected_names for r in responses), (where, [set(r) for r in responses])
        for r in responses:  # one element per output; num_input_tokens one per request
            assert len(r["text_output"]) == n, where
            assert all(len(v) == (1 if name == "num_input_tokens" else n) for name, v in r.items()), where
        assert len(responses) == 1 if not stream else len(responses) >= (1 if mode == "beam" else 2), where

        texts = ["".join(text(r["text_output"][i]) for r in responses) for i in range(n)]
        if mode in reference:
            expected = [o.text for o in reference[mode].outputs]
            assert texts == [t if exclude else PROMPT + t for t in expected], where
        else:
            assert all(texts) and texts[0] != texts[1], where

        if "return_num_output_tokens" in flags:
            counts = [sum(int(r["num_output_tokens"][i]) for r in responses) for i in range(n)]
            assert counts == [MAX_TOKENS] * n, where
        if "return_num_input_tokens" in flags:
            assert {int(r["num_input_tokens"][0]) for r in responses} == {len(reference["greedy"].prompt_token_ids)}
        if "return_finish_reason" in flags:
            assert [text(v) for v in responses[-1]["finish_reason"]] == ["length"] * n, where
            for r in responses[:-1]:  # earlier stream responses: unfinished, or an output finished before
                assert all(text(v) in ("None", "length") for v in r["finish_reason"]), where
        if "return_cumulative_logprob" in flags:
            final = responses[-1]["cumulative_logprob"]
            assert all(math.isfinite(v) and v <= 0.0 for v in final), (where, final)
        if "return_logprobs" in flags:
            entries = [[] for _ in range(n)]
            for r in responses:
                for i, value in enumerate(r["logprobs"]):
                    decoded = strict_loads(text(value))
                    if "logprobs" not in params:
                        assert decoded is None, where
                    else:
                        entries[i].extend(decoded)
            if "logprobs" in params:
                assert [len(e) for e in entries] == [MAX_TOKENS] * n, where
                for step in (step for e in entries for step in e):
                    assert params["logprobs"] <= len(step) <= params["logprobs"] + 1, step
                    ranks = [entry["rank"] for entry in step.values()]
                    assert 1 in ranks and all(isinstance(r, int) and r >= 1 for r in ranks), step
                    for token, entry in step.items():
                        assert token.isdigit() and set(entry) == {"logprob", "rank", "decoded_token"}
                        assert entry["logprob"] <= 0.0 and isinstance(entry["decoded_token"], str)
                if mode in reference:  # the offline engine's tokens and values
                    offline = reference[mode].outputs[0]
                    sampled = [int(next(iter(step))) for step in entries[0]]
                    assert sampled == list(offline.token_ids), where
                    assert [step[str(t)]["logprob"] for step, t in zip(entries[0], sampled)] == pytest.approx(
                        [offline.logprobs[k][t].logprob for k, t in enumerate(sampled)], abs=1e-4)


@pytest.mark.timeout(120)
def test_logprobs_sum_to_the_cumulative_logprob_and_come_over_the_http_generate_endpoint(server):
    params = MODES["greedy-logprobs"]
    [whole] = infer(server, params, stream=False, exclude=True, flags=FLAGS)
    steps = strict_loads(text(whole["logprobs"][0]))
    body = json.dumps({"text_input": PROMPT, "stream": False, "exclude_input_in_output": True,
                       "return_logprobs": True, "sampling_parameters": json.dumps(params)}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/models/paged_llm/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        over_http = strict_loads(reply.read())

    sampled = [next(iter(step.values()))["logprob"] for step in steps]
    assert sum(sampled) == pytest.approx(whole["cumulative_logprob"][0], abs=1e-3)
    assert strict_loads(over_http["logprobs"]) == steps
    assert over_http["text_output"] == text(whole["text_output"][0])


# --------------------------------------------------------------- metrics

SAMPLE = re.compile(r'^([a-z0-9_]+:[a-z0-9_]+)\{([^}]*)\} (\S+)$')


def scrape(server) -> dict:
    """{(metric name, model label): value}, summing over other labels (histogram buckets aside)."""
    values = {}
    for line in server.metrics().splitlines():
        match = SAMPLE.match(line)
        if match and 'le="' not in match.group(2):
            model = re.search(r'model="([^"]*)"', match.group(2))
            key = (match.group(1), model.group(1) if model else None)
            values[key] = values.get(key, 0.0) + float(match.group(3))
    return values


def wait_for(server, predicate, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    values = scrape(server)
    while not predicate(values) and time.monotonic() < deadline:
        time.sleep(0.1)
        values = scrape(server)
    return values


def settled(server, timeout_s: float = 15.0) -> dict:
    """Metrics once two scrapes 0.5 s apart agree: the previous tests' requests
    have all been counted (a counter moves just after the final response)."""
    deadline, values = time.monotonic() + timeout_s, scrape(server)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = scrape(server)
        if again == values:
            break
        values = again
    return values


@pytest.mark.timeout(300)
def test_vllm_metric_names_count_the_same_requests_as_ours(server):
    def get(values, name, model="paged_llm"):
        return values.get((name, model), 0.0)
    before = settled(server)
    outputs = [infer(server, {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}, False, True, FLAGS)
               for _ in range(3)]
    outputs.append(infer(server, {"n": 2, "temperature": 0.7, "max_tokens": 5, "ignore_eos": True},
                         False, True, FLAGS))
    prompt_tokens = sum(int(o[-1]["num_input_tokens"][0]) for o in outputs)
    wait_for(server, lambda v: get(v, "vllm:request_params_n_count") - get(before, "vllm:request_params_n_count") >= 4
             and get(v, "vllm:num_requests_running") == 0)
    # A scrape can fall between two metric updates of one refresh: take the
    # figures once they stand still.
    after = settled(server)
    delta = {name: get(after, name) - get(before, name) for name, model in after if model == "paged_llm"}

    assert delta["vllm:generation_tokens_total"] == delta["pagedbackend:generation_tokens_total"] == 3 * 5 + 2 * 5
    assert delta["vllm:prompt_tokens_total"] == delta["pagedbackend:prompt_tokens_total"] == prompt_tokens
    assert delta["vllm:request_prompt_tokens_sum"] == prompt_tokens
    assert delta["vllm:request_generation_tokens_sum"] == 25
    assert delta["vllm:request_params_n_sum"] == 5 and delta["vllm:request_params_n_count"] == 4
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_inference_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert delta[f"vllm:{histogram}_count"] == 4, histogram
    assert delta["vllm:time_to_first_token_seconds_count"] == delta["pagedbackend:time_to_first_token_seconds_count"]
    assert delta["vllm:e2e_request_latency_seconds_sum"] >= delta["vllm:request_inference_time_seconds_sum"] > 0
    assert get(after, "vllm:kv_cache_usage_perc") == get(after, "pagedbackend:kv_cache_usage_ratio") == 0.0
    assert get(after, "vllm:num_requests_waiting") == 0.0


@pytest.mark.timeout(120)
def test_metric_names_and_report_custom_metrics_are_honoured_per_model(server):
    for model in ("paged_llm_vllm", "paged_llm_quiet"):
        infer(server, {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}, False, True, FLAGS, model=model)
    wait_for(server, lambda v: v.get(("vllm:request_params_n_count", "paged_llm_vllm"), 0) >= 1)
    values = settled(server)   # a scrape can fall between two metric updates of one refresh
    names_of = lambda model: {name for name, m in values if m == model}

    vllm_only = names_of("paged_llm_vllm")
    assert {"vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
            "vllm:kv_cache_usage_perc"} <= vllm_only
    assert not [name for name in vllm_only if name.startswith("pagedbackend:")]
    assert values[("vllm:generation_tokens_total", "paged_llm_vllm")] >= 3
    assert not [name for name in names_of("paged_llm_quiet") if ":" in name]  # no custom metric at all
    assert ("nv_inference_request_success", "paged_llm_quiet") not in values  # (Triton's own use no colon)


@pytest.mark.timeout(60)
def test_every_metric_the_grafana_dashboard_queries_is_exported(server):
    dashboard = json.loads((REPO / "docs" / "grafana" / "pagedbackend.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queried = {re.sub(r"_(bucket|sum|count)$", "", name)
               for query in queries for name in re.findall(r"(?:pagedbackend|vllm):[a-z0-9_]+", query)}
    exported = set(re.findall(r"^# TYPE ((?:pagedbackend|vllm):[a-z0-9_]+) ", server.metrics(), re.M))

    assert len(queries) >= 8 and len(queried) >= 15
    assert queried <= exported, sorted(queried - exported)


# --------------------------------------------------------------- repository, cancellation

@pytest.mark.timeout(60)
def test_a_model_that_cannot_load_leaves_the_others_serving(server):
    assert is_ready(server.http_url)
    assert not is_model_ready(server.http_url, "broken")
    assert all(is_model_ready(server.http_url, name) for name in ("paged_llm", "paged_llm_vllm", "paged_llm_quiet"))
    assert "no-such-weights" in server.log_path.read_text(errors="replace")


@pytest.mark.timeout(120)
def test_a_cancelled_request_is_logged_with_its_id(server):
    request_id = f"cancel-me-{time.monotonic_ns()}"
    received = infer(server, {"max_tokens": 400, "ignore_eos": True}, True, True, request_id=request_id,
                     cancel_after=2)
    deadline, line = time.monotonic() + 15, ""
    while not line and time.monotonic() < deadline:
        time.sleep(0.1)
        line = next((l for l in server.log_path.read_text(errors="replace").splitlines()
                     if f"request {request_id} " in l), "")

    assert len(received) == 2
    assert "was cancelled by the client" in line and "engine id" in line
