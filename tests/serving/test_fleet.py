"""``make fleet``: two replicas of the tiny random model behind NVIDIA Dynamo's
frontend and KV-aware router, through the official ``openai`` client. The
frontend serves completions and chat with the replica's greedy tokens; what a
worker cannot honour is refused by name; a prefix sent again reaches the
replica that holds it; a replica killed mid-stream loses no request silently,
the survivors take new requests and the replica rejoins when it is back; SIGTERM
to make stops every process. One fleet for the module."""
import asyncio
import os
import pathlib
import random
import signal
import threading
import time
import urllib.request

import openai
import pytest

from pagedbackend.serving.dynamo.replica import parse_load
from pagedbackend.serving.fleet import frontend_workers
from loadtest.harness.fleet import FleetProcess
from pagedbackend.serving.openai.triton_client import Triton
from processes import alive, children_of

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
BLOCK = 16
ENGINE = {"PAGEDBACKEND_COMPILE": "false", "PAGEDBACKEND_DEVICE": "cpu", "PAGEDBACKEND_NUM_KV_BLOCKS": "160",
          "PAGEDBACKEND_MAX_NUM_SEQS": "16", "PAGEDBACKEND_BLOCK_SIZE": str(BLOCK)}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    env = {**os.environ, **ENGINE, "PAGEDBACKEND_MODEL": str(tiny_model_dir)}
    with FleetProcess(2, env=env, make_in=REPO, ready_timeout_s=600) as running:
        yield running


@pytest.fixture(scope="module")
def client(fleet):
    with openai.OpenAI(base_url=fleet.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def replica_load(fleet, i: int):
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.state()['replicas'][i]['metrics']}/metrics",
                                timeout=5) as reply:
        return parse_load(reply.read().decode(), "paged_llm")


def direct_tokens(fleet, prompt_ids, max_tokens) -> list:
    """Greedy tokens straight from replica 0's tritonserver (``input_ids`` in, ``output_ids`` out)."""
    async def run():
        triton = Triton(f"127.0.0.1:{fleet.state()['replicas'][0]['grpc']}")
        await triton.open()
        try:
            ids = []
            params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
            async for update in triton.stream("paged_llm", prompt_ids, params, False, output_ids=True):
                ids += update.token_ids[0]
            return ids
        finally:
            await triton.close()
    return asyncio.run(run())


def test_completions_and_chat_through_dynamo_carry_the_replicas_greedy_tokens(fleet, client, tiny_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompt = [int(t) for t in tokenizer("The capital of France is")["input_ids"]]
    expected = direct_tokens(fleet, prompt, 8)
    assert len(expected) == 8
    reply = client.completions.create(model="paged_llm", prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 8

    chunks = list(client.chat.completions.create(
        model="paged_llm", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 6


def test_what_a_worker_cannot_honour_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match=r"n > 1"):
        client.completions.create(model="paged_llm", prompt="Hi", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match=r"stop_token_ids.*outside the vocabulary"):   # the replica's
        client.completions.create(model="paged_llm", prompt="Hi", max_tokens=2,
                                  extra_body={"stop_token_ids": [10 ** 6]})
    assert client.completions.create(model="paged_llm", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_prefix_sent_again_reaches_the_replica_holding_it(client):
    rng = random.Random(42)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(4 * BLOCK)] for _ in range(8)]
    for prefix in prefixes:
        client.completions.create(model="paged_llm", prompt=prefix + [11], max_tokens=2, temperature=0)
    time.sleep(0.5)   # the events reach the router
    cached = [client.completions.create(model="paged_llm", prompt=prefix + [22, 33], max_tokens=2,
                                        temperature=0).usage.prompt_tokens_details.cached_tokens
              for prefix in prefixes]
    assert sum(c >= 4 * BLOCK for c in cached) >= 7, cached


def test_workers_report_their_replicas_load_as_dynamo_metrics(fleet, client):
    client.completions.create(model="paged_llm", prompt=[7] * 40, max_tokens=2)
    time.sleep(1.5)   # the workers poll their replicas every 0.5 s
    for replica in fleet.state()["replicas"]:
        with urllib.request.urlopen(f"http://127.0.0.1:{replica['worker']}/metrics", timeout=5) as reply:
            page = reply.read().decode()
        assert "pagedbackend:num_requests_running" in page and "pagedbackend:num_requests_waiting" in page
        total = [line for line in page.splitlines() if line.startswith("dynamo_component_total_blocks")]
        assert total and float(total[0].rsplit(" ", 1)[1]) == 160


def generated_tokens(fleet) -> float:
    """Tokens generated by every replica so far."""
    total = 0.0
    for replica in fleet.state()["replicas"]:
        with urllib.request.urlopen(f"http://127.0.0.1:{replica['metrics']}/metrics", timeout=5) as reply:
            total += sum(float(line.rsplit(" ", 1)[1]) for line in reply.read().decode().splitlines()
                         if line.startswith("pagedbackend:generation_tokens_total{"))
    return total


def test_a_client_that_goes_away_cancels_its_request_on_the_replica(fleet, client):
    before = generated_tokens(fleet)
    stream = client.completions.create(model="paged_llm", prompt=[4000 + k for k in range(20)], max_tokens=480,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for _, _ in zip(stream, range(3)):
        pass
    stream.close()
    deadline = time.monotonic() + 60
    while any(replica_load(fleet, i).num_requests_running for i in range(2)):
        assert time.monotonic() < deadline, "the request still runs on its replica"
        time.sleep(0.2)
    assert generated_tokens(fleet) - before < 480


def test_a_replica_killed_mid_stream_loses_no_request_silently(fleet, client):
    state = fleet.state()
    results, started = {}, threading.Barrier(7)

    def stream(i):
        tokens, reason, error, first = 0, None, None, True
        try:
            for part in client.completions.create(
                    model="paged_llm", prompt=[2000 + 97 * i + k for k in range(40)], max_tokens=300,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                if first:
                    first = False
                    started.wait(60)
                if part.choices and part.choices[0].finish_reason:
                    reason = part.choices[0].finish_reason
                if part.usage is not None:
                    tokens = part.usage.completion_tokens
        except openai.APIError as exc:
            error = exc
        finally:
            if first:
                started.abort()
        results[i] = (tokens, reason, error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(60)   # every stream has its first tokens
    # The router may have put every stream on one replica: the busiest one is killed.
    deadline = time.monotonic() + 10   # the gauges are refreshed every 0.2 s
    while sum(running := [replica_load(fleet, i).num_requests_running for i in range(2)]) == 0:
        assert time.monotonic() < deadline, "no replica reports a running stream"
        time.sleep(0.2)
    victim = running.index(max(running))
    tritonserver = children_of([state["replicas"][victim]["serve_pid"]])
    assert tritonserver
    for pid in tritonserver:
        os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert len(results) == 6
    for tokens, reason, error in results.values():   # finished in full, or ended with an explicit error
        assert (error is None and reason == "length" and tokens == 300) or error is not None, (tokens, reason)
    assert sum(error is None for _, _, error in results.values()) >= 3   # the survivor's (and moved ones)

    # New requests go to the survivor at once.
    for j in range(4):
        assert client.completions.create(model="paged_llm", prompt=[3000 + j] * 20,
                                         max_tokens=3).usage.completion_tokens == 3

    # The fleet starts the replica again, and it rejoins: requests reach it.
    deadline = time.monotonic() + 300
    while fleet.state()["replicas"][victim]["worker_pid"] in (None, state["replicas"][victim]["worker_pid"]):
        assert time.monotonic() < deadline, fleet.log_tail(f"replica{victim}")
        time.sleep(1)
    while frontend_workers(fleet.openai_port) < 2:
        assert time.monotonic() < deadline, fleet.log_tail(f"worker{victim}")
        time.sleep(1)
    before = replica_load(fleet, victim).prefix_cache_queries_total
    for j in range(8):
        client.completions.create(model="paged_llm", prompt=[5000 + 31 * j + k for k in range(48)], max_tokens=2)
    assert replica_load(fleet, victim).prefix_cache_queries_total > before


def test_sigterm_to_make_stops_every_process(fleet):
    state = fleet.state()
    launchers = [r["serve_pid"] for r in state["replicas"]] + [r["worker_pid"] for r in state["replicas"]]
    started = [state["frontend_pid"], *launchers, *children_of([r["serve_pid"] for r in state["replicas"]])]
    started += children_of(started)   # tritonservers' Python backend stubs
    make = fleet.process.pid
    assert all(alive(pid) for pid in started)
    fleet.stop(timeout_s=120)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in started + [make]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in started + [make] if alive(pid)] == []
