"""Speculative decoding served by a real tritonserver: ``speculative_config``
as JSON text in config.pbtxt, streamed greedy text equal to the offline
engine's plain decoding, and the acceptance counters on ``/metrics`` under
vLLM's names (with one counter per draft position) and ours; under a
constraint, log-probabilities of ruled-out tokens come back finite (vLLM's
-9999.0) in Triton's logprobs output."""
import json
import re
import time

import httpx
import pytest

from client import generate
from pagedbackend import LLM, SamplingParams
from loadtest.harness.triton import TritonServer
from pagedbackend.serving.repository import make_model_repository
from strict_json import strict_loads

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire."
PROMPT = f"<|im_start|>user\nRepeat this sentence three times: {TEXT}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}


def counters(text: str) -> dict:
    """Metric lines as {name with labels but model/version: value}."""
    values = {}
    for line in text.splitlines():
        match = re.match(r'^([a-z_:]+)\{([^}]*)\} (\S+)$', line)
        if match and "spec_decode" in match.group(1):
            labels = ",".join(part for part in match.group(2).split(",") if part.startswith("position"))
            values[match.group(1) + (f"{{{labels}}}" if labels else "")] = float(match.group(3))
    return values


def test_served_speculation_streams_plain_greedy_text_and_counts_acceptance(tmp_path, default_model_dir):
    with LLM(model=str(default_model_dir), num_kv_blocks=128, compile=False) as llm:
        expected = llm.generate([PROMPT], SamplingParams(**GREEDY))[0].outputs[0].text
    repo = make_model_repository(tmp_path / "repo", {"model": str(default_model_dir), "num_kv_blocks": 128,
                                                     "compile": False, "speculative_config": json.dumps(SPEC)})
    with TritonServer(repo, ready_timeout_s=300) as server:
        streamed = generate(PROMPT, GREEDY, url=server.grpc_url, protocol="grpc", stream=True, timeout=120)
        deadline, values, previous = time.monotonic() + 10, {}, None
        while time.monotonic() < deadline and (values != previous or not values):   # until they stand still
            previous, values = values, counters(server.metrics())
            time.sleep(0.3)
        text = server.metrics()
        logprobs = constrained_logprobs(server)
    assert streamed.texts == [expected]
    assert any(v == -9999.0 for v in logprobs) and all(-9999.0 <= v <= 0 for v in logprobs)
    drafts, accepted = values["vllm:spec_decode_num_draft_tokens_total"], values["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafts and values["vllm:spec_decode_num_drafts_total"] > 0
    per_position = [values.get(f'vllm:spec_decode_num_accepted_tokens_per_pos{{position="{i}"}}', 0) for i in range(4)]
    assert sum(per_position) == accepted and per_position[0] >= per_position[-1], text
    assert values["pagedbackend:spec_decode_num_accepted_tokens_total"] == accepted


def constrained_logprobs(server) -> list:
    """The top log-probabilities of a streamed request whose regex allows
    only the sentence (a few tokens at each position), verified from n-gram
    drafts, read as standard JSON."""
    sentence = TEXT.replace(".", "\\.")
    params = {"max_tokens": 24, "temperature": 0.0, "logprobs": 20,
              "structured_outputs": {"regex": f"({sentence} ?)+"}}
    body = {"text_input": PROMPT, "stream": True, "return_logprobs": True,
            "sampling_parameters": json.dumps(params)}
    values = []
    with httpx.stream("POST", f"{server.http_url}/v2/models/paged_llm/generate_stream", json=body,
                      timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                event = strict_loads(line[len("data:"):])
                assert "error" not in event, event
                values += [e["logprob"] for step in strict_loads(event["logprobs"]) or [] for e in step.values()]
    return values
