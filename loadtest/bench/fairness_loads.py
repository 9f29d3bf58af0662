"""The heavy loads of ``python -m loadtest.bench fairness`` that hostile
clients sent (issue 37), beside which the canary must still be served:

- ``grammar_bomb``: 500 nested ``( ... )*`` groups around one "a" (1.6 KB):
  refused at admission now (nesting limit); ``grammar_bomb_20``: the same at
  20 levels, admitted, its token masks growing with every token until its
  per-token budget ends it;
- ``deep_schema``: a JSON schema nested 600 levels (36 KB) as ``guided_json``:
  refused before it is decoded; ``deep_schema_30``: 30 levels, parsed and
  compiled off the intake thread;
- ``tokenize``: 8 concurrent OpenAI ``/tokenize`` calls of 960 KB each;
- ``many_prompts``: one OpenAI ``/v1/completions`` request with 64 prompts of
  about 366 tokens, ``echo``, ``logprobs`` 20, ``max_tokens`` 0;

and ``schemas``: resident memory of the model's stub after 100 and after
1,000 requests with distinct 150-property JSON schemas.
"""
import json
import pathlib
import threading
from typing import List

import numpy as np


def nested_grammar(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")*" * depth


def deep_schema_text(levels: int) -> str:
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


def prompts_of(tokenizer, count: int, tokens: int, seed: int) -> List[str]:
    from loadtest.workloads import _text_of_length
    rng = np.random.default_rng(seed)
    return [_text_of_length(tokenizer, rng, tokens) for _ in range(count)]


def extra_cases(tokenizer, quick: bool) -> List[dict]:
    scale = 8 if quick else 1
    return [
        {"name": "grammar_bomb", "prompts": ["Say a:"], "start": "sent",
         "params": {"max_tokens": 20, "structured_outputs": {"grammar": nested_grammar(500)}}},
        {"name": "grammar_bomb_20", "prompts": ["Say a:"], "start": "sent",
         "params": {"max_tokens": 400, "min_tokens": 400, "temperature": 0.0,
                    "structured_outputs": {"grammar": nested_grammar(20)}}},
        {"name": "deep_schema", "prompts": ["Give JSON:"], "start": "sent",
         "params": {"max_tokens": 8, "guided_json": deep_schema_text(600)}},
        {"name": "deep_schema_30", "prompts": ["Give JSON:"], "start": "sent",
         "params": {"max_tokens": 8, "temperature": 0.0, "guided_json": deep_schema_text(30)}},
        {"name": "tokenize", "api": "openai", "start": "sent", "params": {},
         "prompts": ["The quick brown fox jumps over the lazy dog. " * (21800 // scale)] * 8},
        {"name": "many_prompts", "api": "openai", "start": "sent_1s",
         "prompts": prompts_of(tokenizer, 64 // scale, 366, seed=12),
         "params": {"echo": True, "logprobs": 20, "max_tokens": 0}},
    ]


def run_openai(api_url: str, case: dict, params: dict, started: threading.Event, results: list) -> None:
    """The case's OpenAI load; ``results[0]``: its outcome (texts, or the error)."""
    import httpx
    started.set()
    if case["name"] == "tokenize":
        counts = [None] * len(case["prompts"])

        def one(i):
            reply = httpx.post(f"{api_url}/tokenize", json={"prompt": case["prompts"][i]}, timeout=900)
            counts[i] = reply.json().get("count", reply.text[:200])
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(counts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results[0] = counts
        return
    body = {"model": "paged_llm", "prompt": case["prompts"], **{k: v for k, v in params.items()
                                                                if k != "cache_salt"},
            "cache_salt": params["cache_salt"]}
    reply = httpx.post(f"{api_url}/v1/completions", json=body, timeout=1800)
    answer = reply.json()
    results[0] = [c["text"][:80] for c in answer["choices"]] if "choices" in answer else answer


def stub_rss_mb(server) -> float:
    """Resident memory of the server's Python backend stub(s)."""
    pid = server.process.pid
    children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    total = 0
    for child in children:
        if b"triton_python_backend_stub" in pathlib.Path(f"/proc/{child}/cmdline").read_bytes():
            total += int(pathlib.Path(f"/proc/{child}/statm").read_text().split()[1]) * 4096
    return total / 2 ** 20


def distinct_schemas(server, count: int = 1000, properties: int = 150, checkpoint: int = 100) -> dict:
    """Resident memory of the stub after ``checkpoint`` and after ``count``
    requests, each with a schema of ``properties`` fields seen nowhere before."""
    from client import ServerError, generate
    rss = {"start": round(stub_rss_mb(server))}
    failures = 0
    for i in range(count):
        schema = {"type": "object", "properties": {f"f{i}_{j}": {"type": ("string", "integer", "boolean")[j % 3]}
                                                   for j in range(properties)}}
        try:
            generate("Give JSON:", {"max_tokens": 1, "guided_json": json.dumps(schema)}, protocol="http",
                     url=server.http_url, timeout=300)
        except ServerError:
            failures += 1
        if i + 1 in (checkpoint, count):
            rss[str(i + 1)] = round(stub_rss_mb(server))
    return {"case": "schemas", "properties": properties, "rss_mb": rss, "failures": failures,
            "growth_after_first_mb": rss[str(count)] - rss[str(checkpoint)]}
