"""The OpenAI-compatible API against a real tritonserver, with the official
``openai`` package as the client: completions and chat, streamed and not,
n > 1, stop strings, refused requests, disconnects that free the KV blocks,
a locust run, and ``make serve`` starting and stopping both servers.
One tritonserver and one API server per module, on the tiny random model."""
import asyncio
import os
import pathlib
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from client import generate
from loadtest.harness.triton import TritonServer, free_port
from pagedbackend.serving.repository import make_model_repository
from processes import alive, children_of, processes_mentioning
from loadtest.harness.openai import OpenAIServer

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
# Small pool: 96 blocks x 16 positions; the tiny model's context is 512.
SETTINGS = dict(block_size=16, num_kv_blocks=96, max_num_seqs=64, max_num_batched_tokens=1024,
                dtype="float32", device="cpu", compile=False)
PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
VLLM_ONLY = ("ignore_eos",)  # sampling fields OpenAI lacks go through extra_body


def split(params: dict):
    """``params`` as (OpenAI keyword arguments, extra_body)."""
    return ({k: v for k, v in params.items() if k not in VLLM_ONLY},
            {k: v for k, v in params.items() if k in VLLM_ONLY})


@pytest.fixture(scope="module")
def triton(tmp_path_factory, tiny_model_dir):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": tiny_model_dir, **SETTINGS})
    without_logprobs(make_model_repository(repo, {"model": tiny_model_dir, **SETTINGS}, name="older_llm")
                     / "older_llm" / "config.pbtxt")
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


def without_logprobs(config_file):
    """A model as older repositories declare it: no return_logprobs input, no logprobs output."""
    from google.protobuf import text_format
    from pagedbackend.serving.repository import read_model_config
    config = read_model_config(config_file.read_text())
    for field, name in ((config.input, "return_logprobs"), (config.output, "logprobs")):
        index = next(i for i, tensor in enumerate(field) if tensor.name == name)
        del field[index]
    config_file.write_text(text_format.MessageToString(config))


@pytest.fixture(scope="module")
def api(triton, tiny_model_dir):
    # With tritonserver's admin key, /v1/models reads the repository's index.
    with OpenAIServer(triton.grpc_url, tokenizer=tiny_model_dir,
                      extra_args=["--triton-admin-key", triton.admin_key]) as running:
        yield running


@pytest.fixture(scope="module")
def client(api):
    with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def model_outputs(triton: TritonServer, model: str = "paged_llm") -> set:
    import tritonclient.grpc as grpcclient
    with grpcclient.InferenceServerClient(triton.grpc_url) as c:
        return {o.name for o in c.get_model_config(model).config.output}


def metric(triton: TritonServer, name: str) -> float:
    prefix = f'pagedbackend:{name}{{model="paged_llm",version="1"}} '
    for line in triton.metrics().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"pagedbackend:{name} is not on /metrics")


def wait_for_metric(triton: TritonServer, name: str, predicate, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    value = metric(triton, name)
    while not predicate(value) and time.monotonic() < deadline:
        time.sleep(0.05)
        value = metric(triton, name)
    return value


# ---------------------------------------------------------------- completions

@pytest.mark.timeout(120)
def test_a_completion_has_the_text_and_token_counts_of_the_model_over_grpc(triton, client):
    direct = generate(PROMPT, GREEDY, url=triton.grpc_url, timeout=60)
    kwargs, extra = split(GREEDY)

    completion = client.completions.create(model="paged_llm", prompt=PROMPT, extra_body=extra, **kwargs)

    assert completion.object == "text_completion" and completion.model == "paged_llm"
    assert [c.text for c in completion.choices] == direct.texts
    assert completion.choices[0].finish_reason == "length" and completion.choices[0].index == 0
    assert completion.usage.prompt_tokens == direct.num_input_tokens > 0
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12


@pytest.mark.timeout(120)
def test_a_streamed_completion_adds_up_to_the_whole_one_and_ends_with_usage(client):
    kwargs, extra = split(GREEDY)
    whole = client.completions.create(model="paged_llm", prompt=PROMPT, extra_body=extra, **kwargs)

    chunks = list(client.completions.create(model="paged_llm", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra, **kwargs))

    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 1 and "".join(texts) == whole.choices[0].text  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.timeout(120)
def test_a_list_of_prompts_gives_n_choices_per_prompt_in_order(client):
    kwargs, extra = split({**GREEDY, "max_tokens": 5})
    alone = [client.completions.create(model="paged_llm", prompt=p, extra_body=extra, **kwargs).choices[0].text
             for p in ("Once upon a time", PROMPT)]

    both = client.completions.create(model="paged_llm", prompt=["Once upon a time", PROMPT], echo=True,
                                     extra_body=extra, **kwargs)

    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == ["Once upon a time" + alone[0], PROMPT + alone[1]]
    assert both.usage.completion_tokens == 10


@pytest.mark.timeout(180)
def test_n_samples_come_back_as_n_choices_the_same_for_the_same_seed(client):
    params = dict(n=2, temperature=0.9, seed=11, max_tokens=10, extra_body={"ignore_eos": True})

    first = client.completions.create(model="paged_llm", prompt="Once upon a time", **params)
    second = client.completions.create(model="paged_llm", prompt="Once upon a time", **params)
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model="paged_llm", prompt="Once upon a time", stream=True, **params):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text

    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1] and all(texts) and texts[0] != texts[1]
    assert [c.finish_reason for c in first.choices] == ["length", "length"]
    assert first.usage.completion_tokens == 20
    assert [c.text for c in second.choices] == texts
    assert [streamed[0], streamed[1]] == texts


@pytest.mark.timeout(120)
def test_a_stop_string_ends_the_text_just_before_it(client):
    kwargs, extra = split({**GREEDY, "max_tokens": 24})
    full = client.completions.create(model="paged_llm", prompt=PROMPT, extra_body=extra, **kwargs).choices[0].text
    words = full.split()
    stop = words[len(words) // 2]  # a word from the middle of the greedy text

    stopped = client.completions.create(model="paged_llm", prompt=PROMPT, stop=[stop], extra_body=extra,
                                        **kwargs).choices[0]

    assert stopped.finish_reason == "stop"
    assert stopped.text == full[:full.index(stop)]


# ---------------------------------------------------------------- chat

@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_runs_the_messages_through_the_tokenizers_chat_template(triton, client, tokenizer, stream):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    direct = generate(prompt, GREEDY, url=triton.grpc_url, timeout=60)
    kwargs, extra = split(GREEDY)

    if stream:
        chunks = list(client.chat.completions.create(model="paged_llm", messages=messages, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body=extra, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant"
        text = "".join(d.content or "" for d in deltas)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        assert len(deltas) > 2 and all(c.object == "chat.completion.chunk" for c in chunks)
    else:
        reply = client.chat.completions.create(model="paged_llm", messages=messages, extra_body=extra, **kwargs)
        assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
        text, reason, usage = reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage

    assert text == direct.text and reason == "length"
    assert usage.prompt_tokens == direct.num_input_tokens and usage.completion_tokens == 12


@pytest.mark.timeout(120)
def test_max_completion_tokens_bounds_a_chat_reply(client):
    reply = client.chat.completions.create(model="paged_llm", messages=[{"role": "user", "content": "Hi"}],
                                           max_completion_tokens=3, extra_body={"ignore_eos": True})

    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- models, health, errors

@pytest.mark.timeout(60)
def test_health_is_503_while_the_served_model_is_not_ready(triton, tokenizer):
    """With explicit model control Triton is ready before any model loads:
    /health answers for the model the API serves, not for the server alone."""
    from fastapi.testclient import TestClient
    from pagedbackend.serving.openai.app import Settings, create_app
    app = create_app(Settings(triton_url=triton.grpc_url, model_name="not_loaded"), tokenizer=tokenizer)
    with TestClient(app) as http:
        reply = http.get("/health")
    assert reply.status_code == 503 and "not_loaded is not ready" in reply.json()["error"]["message"]


@pytest.mark.timeout(60)
def test_models_lists_the_ready_triton_models_and_health_is_ok(api, client):
    models = client.models.list()

    assert [m.id for m in models.data] == ["older_llm", "paged_llm"]  # every ready model
    assert httpx.get(f"{api.url}/health").json() == {"status": "ok"}


def test_a_model_can_be_retrieved_by_its_id_and_an_unknown_one_is_404(client):
    assert client.models.retrieve("paged_llm").id == "paged_llm"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no_such_model")
    assert "does not exist" in missing.value.message


def test_tokenize_counts_a_prompt_with_the_models_tokenizer_and_detokenize_inverts_it(api, tokenizer):
    text = "The capital of France is"
    reply = httpx.post(f"{api.url}/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=60).json()
    ids = tokenizer.encode(text)
    assert reply["tokens"] == ids and reply["count"] == len(ids)
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    back = httpx.post(f"{api.url}/detokenize", json={"tokens": ids}, timeout=60).json()
    assert back == {"prompt": tokenizer.decode(ids)}


def finish_order(calls) -> list:
    """Run each (name, function) in a thread of its own, in the order given
    (a moment apart); returns the names in the order they finished."""
    done, lock, threads = [], threading.Lock(), []

    def run(name, call):
        call()
        with lock:
            done.append(name)
    for name, call in calls:
        threads.append(threading.Thread(target=run, args=(name, call)))
        threads[-1].start()
        time.sleep(0.2)
    for thread in threads:
        thread.join(timeout=300)
    return done


def test_large_tokenize_calls_do_not_hold_up_a_small_request(api):
    """Each tokenises on a worker thread: a small request sent after four
    large ones is answered before the last two of them (on the event loop, it
    waited for all four one after another; the large ones queue on their own
    thread, and the first two, sent 0.8 and 0.6 s earlier, may finish first on
    a fast machine)."""
    big = "The quick brown fox jumps over the lazy dog. " * 13000   # 585 KB, a few seconds each

    def tokenize(text):
        reply = httpx.post(f"{api.url}/tokenize", json={"prompt": text}, timeout=300)
        assert reply.status_code == 200 and reply.json()["count"] > 0
    order = finish_order([*((f"big{i}", lambda: tokenize(big)) for i in range(4)),
                          ("small", lambda: tokenize("Hello"))])
    assert order.index("small") <= 2, order


def test_a_request_of_many_prompts_enters_the_model_a_few_prompts_at_a_time(triton, client, tokenizer):
    """As one tenant: its long prompts are in the model one at a time (all 64
    used to be queued at once, ahead of any later request), and a request
    sent after it is answered while it runs."""
    prompts = [" ".join(f"word{i}_{j}" for j in range(80)) for i in range(64)]   # ~400 tokens each
    assert all(300 < len(tokenizer.encode(p)) < 500 for p in prompts)
    in_model, done = [], threading.Event()

    def watch():
        while not done.is_set():
            in_model.append(metric(triton, "num_requests_running") + metric(triton, "num_requests_waiting"))
            time.sleep(0.05)

    def many():
        out = client.completions.create(model="paged_llm", prompt=prompts, max_tokens=1, temperature=0)
        assert len(out.choices) == 64
        done.set()

    def canary():
        out = client.completions.create(model="paged_llm", prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert finish_order([("many", many), ("canary", canary)]) == ["canary", "many"]
    finally:
        done.set()
        watcher.join()
    assert max(in_model) <= 2 and len(in_model) > 10, in_model   # one prompt, and the canary at times


def test_tokenize_runs_messages_through_the_chat_template(api, tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    reply = httpx.post(f"{api.url}/tokenize", json={"messages": messages}, timeout=60).json()
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert reply["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert reply["token_strs"] is None


@pytest.mark.parametrize("path, body, words", [
    ("/detokenize", {"tokens": [10 ** 9]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/tokenize", {"prompt": "a", "model": "no_such_model"}, "no_such_model"),
    ("/tokenize", {"prompt": "a", "stream": True}, "unrecognized request argument: stream"),
])
def test_a_bad_tokenize_or_detokenize_request_is_a_400_naming_the_problem(api, path, body, words):
    reply = httpx.post(f"{api.url}{path}", json=body, timeout=60)
    assert reply.status_code in (400, 404), reply.text
    assert words in reply.json()["error"]["message"]


@pytest.mark.parametrize("fields", [
    {"prompt": [-1]},
    {"prompt": [10 ** 9]},
    {"prompt": [10 ** 30]},
    {"prompt": [[1, 2], [3, -7]], "echo": True, "logprobs": 1},
    {"prompt": [5, 10 ** 9], "echo": True, "max_tokens": 0},
])
def test_a_token_id_prompt_outside_the_vocabulary_is_a_400_naming_the_prompt(api, fields):
    reply = httpx.post(f"{api.base_url}/completions", json={"max_tokens": 2, **fields}, timeout=60)

    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt" and "outside the vocabulary" in error["message"], error


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", b'{"prompt": "Hi \\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": "Hi", "stop": ["\\ud83d"]}', "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a", "name": "\\udc00"}]}',
     "messages[0].name"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(api, path, body, where):
    reply = httpx.post(f"{api.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith(f"{where} holds a lone UTF-16 surrogate")


def test_a_paired_surrogate_is_one_character_and_is_served(api):
    reply = httpx.post(f"{api.url}/v1/completions", content=b'{"prompt": "Hi \\ud83d\\ude00", "max_tokens": 2}',
                       headers={"Content-Type": "application/json"}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_the_connection_stays_usable_after_a_refused_request(api):
    """A refusal, whatever its cause, leaves the keep-alive connection open for the next request."""
    with httpx.Client(base_url=api.url, timeout=60) as http:
        bad = http.post("/v1/completions", content=b'{"prompt": "Hi \\ud800"}',
                        headers={"Content-Type": "application/json"})
        good = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert bad.status_code == 400 and good.status_code == 200


def test_greedy_with_n_2_gives_two_identical_choices_as_openai_does(client):
    reply = client.completions.create(model="paged_llm", prompt=PROMPT, n=2, temperature=0, max_tokens=6)
    assert len(reply.choices) == 2 and reply.choices[0].text == reply.choices[1].text


def test_chat_with_n_2_and_no_max_tokens_is_capped_to_what_the_pool_holds(client):
    # 96 blocks of 16: two candidates of the rest of a 512-token context would not fit.
    reply = client.chat.completions.create(model="paged_llm", n=2, temperature=0.8, seed=1,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert len(reply.choices) == 2 and reply.usage.completion_tokens > 0


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(client):
    prompt = "A long shared preamble that fills more than two blocks of sixteen tokens. " * 4
    first = client.completions.create(model="paged_llm", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="paged_llm", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 32 <= second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


@pytest.fixture(scope="module")
def offline_engine(tiny_model_dir):
    from pagedbackend import LLM
    return LLM(model=str(tiny_model_dir), **SETTINGS)


def test_echo_with_logprobs_and_no_tokens_scores_a_token_id_prompt_like_the_engine(client, tokenizer,
                                                                                    offline_engine):
    """lm-evaluation-harness's log-likelihood request: token ids, echo, logprobs 1, max_tokens 0."""
    from pagedbackend import SamplingParams
    ids = tokenizer(PROMPT + " and then some more words to score").input_ids
    reply = client.completions.create(model="paged_llm", prompt=ids, echo=True, logprobs=1, max_tokens=0,
                                      temperature=0)
    choice, expected = reply.choices[0], offline_engine.generate(
        ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0].prompt_logprobs
    assert choice.text == tokenizer.decode(ids) and reply.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.text_offset[0] == 0
    for p in range(1, len(ids)):
        assert abs(choice.logprobs.token_logprobs[p] - expected[p][ids[p]].logprob) < 1e-4
        assert choice.logprobs.tokens[p] == expected[p][ids[p]].decoded_token


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_gives_the_prompts_then_the_generated_tokens(client, tokenizer, stream):
    kwargs = dict(model="paged_llm", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0,
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        first = chunks[0].choices[0].logprobs
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, tokens, first = choice.text, choice.logprobs.tokens, choice.logprobs
    prompt_ids = tokenizer(PROMPT).input_ids
    assert text.startswith(PROMPT) and len(tokens) == len(prompt_ids) + 3
    assert first.token_logprobs[0] is None and all(v is not None for v in first.token_logprobs[1:])


def test_max_tokens_zero_without_echo_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens 0"):
        client.completions.create(model="paged_llm", prompt="Hi", max_tokens=0)


def test_a_text_part_with_extra_keys_is_read_for_its_text(client):
    reply = client.chat.completions.create(model="paged_llm", max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}])
    assert reply.usage.completion_tokens == 3


def _long_prompt() -> str:
    return "word " * 600


@pytest.mark.timeout(180)
@pytest.mark.parametrize("call, status, words", [
    (lambda c: c.completions.create(model="paged_llm", prompt="Hi", temperature=-1), 400, ["temperature"]),
    (lambda c: c.completions.create(model="paged_llm", prompt="Hi", extra_body={"colour": "blue"}), 400,
     ["unrecognized request argument: colour"]),
    (lambda c: c.completions.create(model="no_such_model", prompt="Hi"), 404, ["no_such_model", "does not exist"]),
    (lambda c: c.completions.create(model="paged_llm", prompt=_long_prompt()), 400,
     ["exceeds the maximum context length"]),
    (lambda c: c.completions.create(model="paged_llm", prompt="Hi", n=2, temperature=0, extra_body={"best_of": 3}),
     400, ["greedy candidates are all the same"]),
    (lambda c: c.completions.create(model="paged_llm", prompt="Hi", stop=""), 400, ["stop must be a non-empty"]),
    (lambda c: c.completions.create(model="paged_llm", prompt="Hi", extra_body={"length_penalty": 0.5}), 400,
     ["length_penalty", "beam search only"]),
    (lambda c: c.completions.create(model="paged_llm", prompt="Hi", max_tokens=3, n=2, temperature=0, logprobs=1,
                                    extra_body={"use_beam_search": True}), 400,
     ["logprobs are not returned with beam search"]),
    (lambda c: c.completions.create(model="paged_llm", prompt="Hi", extra_body={"top_k": -5}), 400, ["top_k"]),
    (lambda c: c.completions.create(model="paged_llm", prompt="x" * (33 << 20)), 413, ["larger than the limit"]),
    (lambda c: c.chat.completions.create(model="paged_llm", messages=[]), 400, ["messages"]),
    (lambda c: c.chat.completions.create(model="paged_llm", stream=True, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400,
     ["model paged_llm takes no image input"]),
    (lambda c: c.chat.completions.create(model="paged_llm", messages=[{"role": "user", "content": "Hi"}],
                                         stream=True, max_tokens=400, extra_body={"min_tokens": 500}), 400,
     ["min_tokens"]),
], ids=["negative-temperature", "unknown-field", "unknown-model", "over-long-prompt", "greedy-best_of",
        "empty-stop", "length_penalty-without-beams", "beam-logprobs", "model-refuses-top_k", "body-too-large", "no-messages", "image-part", "streamed-refusal"])
def test_a_bad_request_gets_an_openai_error_with_a_4xx_status(client, call, status, words):
    with pytest.raises(openai.APIStatusError) as refused:
        call(client)

    error = refused.value.body if isinstance(refused.value.body, dict) else {}
    assert refused.value.status_code == status
    assert all(word in refused.value.message for word in words), refused.value.message
    assert error.get("type") in ("invalid_request_error", "not_found_error")
    assert client.completions.create(model="paged_llm", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method, path, body, status, words", [
    ("POST", "/v1/completions", b'{"prompt": "Hi",', 400, ["not valid JSON"]),
    ("POST", "/v1/chat/completions", b'"just a string"', 400, ["JSON object"]),
    ("GET", "/v1/no-such-route", None, 404, ["Not Found"]),
    ("GET", "/v1/completions", None, 405, ["Method Not Allowed"]),
], ids=["broken-json", "not-an-object", "unknown-route", "wrong-method"])
def test_malformed_http_gets_an_openai_error_object(api, method, path, body, status, words):
    reply = httpx.request(method, f"{api.url}{path}", content=body, timeout=30)

    error = reply.json()["error"]
    assert reply.status_code == status
    assert set(error) == {"message", "type", "param", "code"}
    assert all(word in error["message"] for word in words)


@pytest.mark.timeout(120)
def test_penalties_reach_the_model_which_applies_them_or_refuses_them_by_name(client):
    try:
        reply = client.completions.create(model="paged_llm", prompt="Hi", max_tokens=4, presence_penalty=0.5,
                                          frequency_penalty=0.5)
    except openai.BadRequestError as refused:  # a model without penalties names the parameter
        assert "presence_penalty" in refused.message
    else:
        assert reply.usage.completion_tokens >= 1
    neutral = client.completions.create(model="paged_llm", prompt="Hi", max_tokens=4, presence_penalty=0.0,
                                        frequency_penalty=0.0)
    assert neutral.usage.completion_tokens >= 1  # neutral values are not sent: any model serves them


@pytest.mark.timeout(120)
def test_logit_bias_reaches_the_model(client, tokenizer):
    token = tokenizer.encode(" blue", add_special_tokens=False)[0]

    reply = client.completions.create(model="paged_llm", prompt=PROMPT, max_tokens=3, temperature=0,
                                      logit_bias={str(token): 100}, extra_body={"ignore_eos": True})

    assert reply.choices[0].text == tokenizer.decode([token] * 3)


@pytest.mark.timeout(120)
def test_logprobs_are_refused_by_name_when_the_model_has_no_logprobs_output(triton, client):
    assert "logprobs" not in model_outputs(triton, "older_llm")
    plain = client.chat.completions.create(model="older_llm", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2)

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="older_llm", messages=[{"role": "user", "content": "Hi"}],
                                       logprobs=True, top_logprobs=2)

    assert plain.choices[0].message.content is not None
    assert "logprobs are not supported by model older_llm" in refused.value.message


@pytest.mark.timeout(120)
def test_logprobs_end_to_end(triton, client):
    assert "logprobs" in model_outputs(triton)
    kwargs, extra = split({**GREEDY, "max_tokens": 6})

    completion = client.completions.create(model="paged_llm", prompt=PROMPT, logprobs=2, extra_body=extra,
                                           **kwargs).choices[0]
    chat = client.chat.completions.create(model="paged_llm", messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=2, extra_body=extra, **kwargs).choices[0]

    lp = completion.logprobs
    assert "".join(lp.tokens) == completion.text and len(lp.tokens) == 6
    assert all(t == max(top.values()) for t, top in zip(lp.token_logprobs, lp.top_logprobs))  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    content = chat.logprobs.content
    assert "".join(c.token for c in content) == chat.message.content and len(content) == 6
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)


# ---------------------------------------------------------------- disconnects

@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_hangs_up_cancels_its_request_and_frees_its_kv_blocks(triton, api, stream):
    max_tokens = 400   # far more than are generated before the hang-up is seen
    before = wait_for_metric(triton, "generation_tokens_total", lambda v: True)
    body = {"model": "paged_llm", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}

    async def hang_up():
        async with openai.AsyncOpenAI(base_url=api.base_url, api_key="unused", max_retries=0) as c:
            request = asyncio.ensure_future(c.completions.create(**{k: v for k, v in body.items()
                                                                    if k != "ignore_eos"},
                                                                 extra_body={"ignore_eos": True}))
            if stream:
                chunks = await request
                received = [await chunks.__anext__() for _ in range(3)]
                in_use = await asyncio.to_thread(wait_for_metric, triton, "kv_blocks_used", lambda v: v > 0)
                await chunks.close()
                return received, in_use
            in_use = await asyncio.to_thread(wait_for_metric, triton, "kv_blocks_used", lambda v: v > 0)
            request.cancel()  # closes the connection mid-request
            await asyncio.gather(request, return_exceptions=True)
            return [], in_use

    received, in_use = asyncio.run(hang_up())

    assert in_use > 0 and (len(received) == 3 or not stream)
    assert wait_for_metric(triton, "kv_blocks_used", lambda v: v == 0) == 0
    assert metric(triton, "num_requests_running") == 0
    generated = metric(triton, "generation_tokens_total") - before
    assert 0 < generated < max_tokens   # cancelled, not run to the end


# ---------------------------------------------------------------- locust

@pytest.mark.timeout(300)
def test_a_short_locust_run_through_the_openai_api_has_no_failures(triton, api, tmp_path, tiny_model_dir):
    from loadtest.run_locust import run_locust

    summary = run_locust(triton.http_url, triton.grpc_url, tmp_path, users=2, run_time="200s", max_requests=6,
                         workload="alpaca", protocol="openai", openai_url=api.url, max_output_tokens=8,
                         tokenizer=str(tiny_model_dir), timeout=240)

    log = (tmp_path / "locust.log").read_text()[-3000:]
    assert summary["failures"] == 0, log
    assert summary["requests"] == 6, log
    assert summary["seconds"] < 180, log  # it ended with its last request
    for name in ("ttft", "e2e"):
        m = summary["metrics"][name]
        assert m["count"] > 0 and 0 < m["p50_ms"] <= m["p99_ms"]
    assert summary["output_tokens"] > 0


# ---------------------------------------------------------------- make serve



@pytest.mark.timeout(300)
def test_make_serve_starts_triton_and_the_openai_api_and_sigterm_stops_both(tiny_model_dir, tmp_path):
    ports = {name: free_port() for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT")}
    env = {**os.environ, "PAGEDBACKEND_MODEL": str(tiny_model_dir), "PAGEDBACKEND_NUM_KV_BLOCKS": "64",
           "PAGEDBACKEND_DEVICE": "cpu"}
    log_path = tmp_path / "make.log"
    with open(log_path, "wb") as log:
        # -o: a test never reinstalls the environment
        make = subprocess.Popen(["make", "-s", "-C", str(REPO), "-o", ".venv/.installed", "-o", ".venv/.step-built", "serve",
                                 *(f"{k}={v}" for k, v in ports.items())],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{ports['OPENAI_PORT']}"
    try:
        deadline, health = time.monotonic() + 240, None
        while time.monotonic() < deadline and make.poll() is None and health != 200:
            try:
                health = httpx.get(f"{base}/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.5)
        assert health == 200, log_path.read_text(errors="replace")[-3000:]
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60).json()
        tritonserver = processes_mentioning(f"--grpc-port={ports['GRPC_PORT']}")
        launcher = processes_mentioning(f"--grpc-port\0{ports['GRPC_PORT']}")
        api = processes_mentioning(f"--port\0{ports['OPENAI_PORT']}")
        stubs = children_of(tritonserver)  # the model's Python backend stub
        started = tritonserver + stubs + launcher + api

        make.send_signal(signal.SIGTERM)
        make.wait(timeout=120)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()

    assert reply["usage"]["completion_tokens"] == 3
    assert len(tritonserver) == len(launcher) == len(api) == 1 and stubs
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in started if alive(pid)] == []
