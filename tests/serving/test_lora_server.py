"""Multi-LoRA through a real tritonserver, as NVIDIA's vllm_backend users and
vLLM's OpenAI server users drive it: ``multi_lora.json`` beside model.py and
``lora_name`` over gRPC streaming and HTTP generate, vllm_backend's errors
word for word, adapters as OpenAI models (the ``openai`` SDK), adapters
loaded, reloaded in place and unloaded at run time while another request
streams, and the LoRA metrics. One tritonserver (a model with adapters, one
without, one whose multi_lora.json is missing) and one API server per module,
on the tiny random model; texts are compared with the in-process engine's,
whose tokens test_lora.py compares with PEFT's."""
import json
import shutil
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from client.streaming import Result, ServerError, generate, grpc_stream
from pagedbackend import LLM, LoRARequest, SamplingParams
from pagedbackend.serving.constants import ADMIN_HEADER
from loadtest.harness.triton import TritonServer
from loadtest.harness.openai import OpenAIServer
from pagedbackend.serving.repository import make_model_repository
from peft_reference import save_random_adapter

pytestmark = pytest.mark.slow

SETTINGS = dict(block_size=16, num_kv_blocks=96, max_num_seqs=16, max_num_batched_tokens=1024,
                dtype="float32", device="cpu", compile=False)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = "Tell me about the sea"
PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    specs = {"doll": dict(r=4, lora_alpha=8, seed=1), "sheep": dict(r=8, lora_alpha=16, seed=2,
                                                                      targets=["q_proj", "v_proj"]),
             "fresh": dict(r=4, lora_alpha=4, seed=3), "fresh_v2": dict(r=2, lora_alpha=4, seed=4)}
    return {name: save_random_adapter(tiny_model_dir, root / name, **spec) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def triton(tmp_path_factory, tiny_model_dir, adapters):
    repo = tmp_path_factory.mktemp("repo")
    make_model_repository(repo, {"model": tiny_model_dir, **SETTINGS, **LORA})
    shutil.copytree(adapters["sheep"], repo / "paged_llm" / "1" / "sheep_adapter")   # a relative folder
    (repo / "paged_llm" / "1" / "multi_lora.json").write_text(
        json.dumps({"doll": adapters["doll"], "sheep": "sheep_adapter"}))
    make_model_repository(repo, {"model": tiny_model_dir, **SETTINGS}, name="paged_llm_plain")
    make_model_repository(repo, {"model": tiny_model_dir, **SETTINGS, **LORA}, name="no_list")
    with TritonServer(repo, ready_timeout_s=300, required_models=["paged_llm", "paged_llm_plain"]) as running:
        yield running


@pytest.fixture(scope="module")
def offline(tiny_model_dir, adapters):
    """The in-process engine's text for a prompt with an adapter (None: base)."""
    llm = LLM(model=str(tiny_model_dir), **SETTINGS, **LORA, max_cpu_loras=8)
    ids = {name: i + 1 for i, name in enumerate(adapters)}

    def text(name, prompt=PROMPT, max_tokens=PARAMS["max_tokens"]):
        request = None if name is None else LoRARequest(name, ids[name], adapters[name])
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(prompt, params, lora_request=request)[0].outputs[0].text
    return text


@pytest.fixture(scope="module")
def api(triton, tiny_model_dir):
    with OpenAIServer(triton.grpc_url, tokenizer=tiny_model_dir,
                      extra_args=["--triton-admin-key", triton.admin_key]) as running:
        yield running


def grpc(triton, params, model="paged_llm", stream=True) -> str:
    return generate(PROMPT, params, protocol="grpc", url=triton.grpc_url, model=model, stream=stream,
                    exclude_input=True).text


def http_generate(triton, parameters, model="paged_llm"):
    """POST /v2/models/<model>/generate, sampling parameters as request parameters."""
    body = json.dumps({"text_input": PROMPT, "exclude_input_in_output": True, "parameters": parameters})
    request = urllib.request.Request(f"{triton.http_url}/v2/models/{model}/generate", data=body.encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return 200, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_multi_lora_json_adapters_serve_over_grpc_streaming_and_http_generate(triton, offline):
    texts = {name: offline(name) for name in ("doll", "sheep", None)}
    assert len(set(texts.values())) == 3   # each adapter changes the text
    for name in ("doll", "sheep"):
        assert grpc(triton, {**PARAMS, "lora_name": name}) == texts[name]
        assert grpc(triton, {**PARAMS, "lora_name": name}, stream=False) == texts[name]
        status, answer = http_generate(triton, {**PARAMS, "lora_name": name})
        assert status == 200 and answer["text_output"] == texts[name]
    assert grpc(triton, PARAMS) == texts[None]


def test_vllm_backends_lora_errors_word_for_word_before_any_work(triton):
    with pytest.raises(ServerError) as unknown:
        grpc(triton, {**PARAMS, "lora_name": "pear"})
    assert str(unknown.value) == "LoRA pear is not supported, we currently support ['doll', 'sheep']"
    with pytest.raises(ServerError) as off:
        grpc(triton, {**PARAMS, "lora_name": "doll"}, model="paged_llm_plain")
    assert str(off.value) == "LoRA feature is not enabled."
    status, answer = http_generate(triton, {**PARAMS, "lora_name": "pear"})
    assert status == 400 and answer["error"] == "LoRA pear is not supported, we currently support ['doll', 'sheep']"
    # Refused before the prompt is read: an unknown adapter wins over a missing prompt.
    with pytest.raises(ServerError, match="LoRA feature is not enabled."):
        generate("", {**PARAMS, "lora_name": "doll"}, url=triton.grpc_url, model="paged_llm_plain")


def test_lora_on_without_multi_lora_json_fails_the_load_naming_the_file(triton):
    assert "Triton backend cannot find" in triton.log_tail(400) and "no_list/1/multi_lora.json" in \
        triton.log_tail(400)


def test_adapters_are_openai_models(api, triton, offline):
    with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        listed = {m.id: m for m in client.models.list().data}
        assert {"paged_llm", "doll", "sheep"} <= set(listed)
        assert listed["doll"].parent == "paged_llm" and listed["doll"].root.endswith("doll")
        answer = client.completions.create(model="doll", prompt=PROMPT, max_tokens=8, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        assert answer.model == "doll" and answer.choices[0].text == offline("doll")
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="sheep", prompt=PROMPT, max_tokens=8, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert streamed == offline("sheep")
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="pear", prompt=PROMPT, max_tokens=2)


def test_adapters_load_reload_and_unload_at_run_time_while_another_request_streams(api, triton, adapters,
                                                                                   offline, tmp_path):
    folder = tmp_path / "fresh"
    shutil.copytree(adapters["fresh"], folder)
    long = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "lora_name": "doll"}
    streamed, started = {}, threading.Event()

    def stream():
        result = Result()
        for delta in grpc_stream("Once", long, url=triton.grpc_url, exclude_input=True):
            result.add(delta)
            started.set()
        streamed["text"], streamed["ended"] = result.text, time.monotonic()
    streaming = threading.Thread(target=stream)
    streaming.start()
    assert started.wait(timeout=120)
    key = {ADMIN_HEADER: triton.admin_key}
    with httpx.Client(base_url=api.url, timeout=120) as http:
        body = {"lora_name": "fresh", "lora_path": str(folder)}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 401   # no admin key
        asked_at = time.monotonic()
        loaded = http.post("/v1/load_lora_adapter", json=body, headers=key)
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'fresh' added successfully."
        assert http.post("/v1/load_lora_adapter", json=body, headers=key).status_code == 400   # already loaded
        assert complete(http, "fresh") == offline("fresh")
        shutil.rmtree(folder)
        shutil.copytree(adapters["fresh_v2"], folder)
        reloaded = http.post("/v1/load_lora_adapter", json={**body, "load_inplace": True}, headers=key)
        assert reloaded.status_code == 200
        assert complete(http, "fresh") == offline("fresh_v2") != offline("fresh")
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"}, headers=key)
        assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'fresh' removed successfully."
        assert http.post("/v1/completions", json={"model": "fresh", "prompt": PROMPT}).status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"}, headers=key).status_code == 404
    streaming.join(timeout=120)
    # The adapter was asked for at run time while the long request streamed (on
    # a slow machine the stream may end before the load, reload and unload finish).
    assert streamed["ended"] > asked_at
    assert streamed["text"] == offline("doll", "Once", 400)
    with pytest.raises(ServerError, match="LoRA fresh is not supported"):
        grpc(triton, {**PARAMS, "lora_name": "fresh"})


def complete(http, model) -> str:
    reply = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                               "temperature": 0.0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_lora_metrics_name_running_and_waiting_adapters_and_count_requests(triton):
    long = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True, "lora_name": "doll"}
    streaming = threading.Thread(target=lambda: grpc(triton, long))
    streaming.start()
    deadline, seen = time.monotonic() + 60, []
    while not seen and time.monotonic() < deadline:
        seen = [line for line in triton.metrics().splitlines()
                if line.startswith("vllm:lora_requests_info{") and 'running_lora_adapters="doll"' in line]
        time.sleep(0.1)
    streaming.join(timeout=120)
    assert seen   # the newest series (earlier tests of the module left series of their own)
    current = max(seen, key=lambda line: float(line.rsplit(" ", 1)[1]))
    assert 'max_lora="2"' in current and 'waiting_lora_adapters=""' in current
    time.sleep(0.5)
    text = triton.metrics().splitlines()
    series = [line for line in text if line.startswith("vllm:lora_requests_info{")]
    latest = max(series, key=lambda line: float(line.rsplit(" ", 1)[1]))
    assert 'running_lora_adapters=""' in latest   # idle now: the current series says so
    counts = [line for line in text if line.startswith("pagedbackend:lora_requests_total{") and 'lora_name="doll"'
              in line]
    assert counts and float(counts[0].rsplit(" ", 1)[1]) >= 1
    assert any(line.startswith("pagedbackend:lora_loads_total{") for line in text)
