"""Time to first token of a short canary request beside requests that would
hold up every newcomer, through tritonserver with the shipped configuration.

Three cases, each first run alone (its greedy outputs are the reference),
then again with the canary ("The capital of France is", 8 tokens) sent while
it runs:

- ``long_prompt``: one prompt of about 8,180 tokens, 8 tokens out; the
  canary 0.5 s after it;
- ``wide``: one request with ``n: 64``, 64 tokens each, top-20 logprobs; the
  canary once its first tokens have come back;
- ``preempted``: four requests with ``n: 8``, 400 tokens each, more than the KV
  pool holds at once; the canary after the first preemption;

and the loads of ``fairness_loads`` (a grammar bomb, deep schemas, large
``/tokenize`` calls and a 64-prompt request through the OpenAI API, where
the canary goes through that API too), plus ``schemas`` (resident memory
over 1,000 distinct schemas).

Reported per case: the canary's TTFT and latency (8 tokens, end to end), the
heavy requests' time, whether their greedy outputs equal the run alone, and
the preemptions.
"""
import argparse
import json
import tempfile
import threading
import time
import urllib.request
from typing import Callable, List

from .common import write_result
from .fairness_loads import distinct_schemas, extra_cases, run_openai

CANARY = "The capital of France is"
CANARY_PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def counter(metrics_url: str, name: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        lines = [line for line in reply.read().decode().splitlines() if line.startswith(name + "{")]
    return sum(float(line.rsplit(" ", 1)[-1]) for line in lines)


def long_prompt(tokenizer, tokens: int) -> str:
    from loadtest.workloads import _text_of_length
    import numpy as np
    return _text_of_length(tokenizer, np.random.default_rng(11), tokens)


def cases(tokenizer, quick: bool) -> List[dict]:
    scale = 8 if quick else 1
    return [
        {"name": "long_prompt", "prompts": [long_prompt(tokenizer, 8180 // scale)],
         "params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}, "start": "sent"},
        {"name": "wide", "prompts": ["Write a list of animals:"],
         "params": {"n": 64 // scale, "max_tokens": 64 // scale, "temperature": 0.0, "ignore_eos": True,
                    "logprobs": 20}, "start": "first_token"},
        {"name": "preempted", "prompts": [f"Story {i}: once upon a time" for i in range(4)],
         "params": {"n": 8, "max_tokens": 400 // scale, "temperature": 0.0, "ignore_eos": True},
         "start": "preemption"},
        *extra_cases(tokenizer, quick),
    ]


def run_heavy(url: str, prompts: List[str], params: dict, started: threading.Event, results: list) -> None:
    from client import ServerError, collect, http_stream

    def one(i):
        stream = http_stream(prompts[i], params, url=url, exclude_input=True, timeout=900)
        try:
            first = next(stream)
        except ServerError as exc:   # refused
            started.set()
            results[i] = str(exc)
            return
        started.set()
        try:
            results[i] = collect(_chain(first, stream)).texts
        except ServerError as exc:   # ended by the server (a grammar over its budget)
            results[i] = str(exc)
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _chain(first, rest):
    yield first
    yield from rest


def measure(server, case: dict, with_canary: bool, api_url: str = None) -> dict:
    from client import generate
    url, metrics = server.http_url, server.metrics_url
    openai = case.get("api") == "openai"
    results = [None] * (1 if openai else len(case["prompts"]))
    started = threading.Event()
    # A salt per run: the run beside the canary meets no prefix the run alone left cached.
    params = {**case["params"], "cache_salt": f"{case['name']}-{'beside' if with_canary else 'alone'}"}
    preemptions = counter(metrics, "pagedbackend:num_preemptions_total")
    t0 = time.perf_counter()
    heavy = threading.Thread(target=run_openai if openai else run_heavy, daemon=True,
                             args=(api_url, case, params, started, results) if openai else
                             (url, case["prompts"], params, started, results))
    heavy.start()
    canary = None
    if with_canary:
        wait_for: Callable[[], bool] = {
            "sent": lambda: time.perf_counter() - t0 >= 0.5,
            "sent_1s": lambda: time.perf_counter() - t0 >= 1.0,
            "first_token": started.is_set,
            "preemption": lambda: counter(metrics, "pagedbackend:num_preemptions_total") > preemptions,
        }[case["start"]]
        while not wait_for() and heavy.is_alive():
            time.sleep(0.05)
        sent = time.perf_counter()
        result = generate(CANARY, CANARY_PARAMS, protocol="openai" if openai else "http",
                          url=api_url if openai else url, timeout=900)
        canary = {"sent_after_s": round(sent - t0, 2), "ttft_s": round(result.token_times[0][0], 3),
                  "latency_s": round(result.latency, 3), "tokens": result.num_output_tokens[0]}
    heavy.join()
    return {"heavy_s": round(time.perf_counter() - t0, 2), "canary": canary,
            "preemptions": counter(metrics, "pagedbackend:num_preemptions_total") - preemptions,
            "texts": results}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench fairness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--cases", default="long_prompt,wide,preempted,grammar_bomb,grammar_bomb_20,deep_schema,"
                                       "deep_schema_30,tokenize,many_prompts,schemas")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an engine setting for the server (e.g. tpot_target_s=0); repeatable")
    ap.add_argument("--quick", action="store_true", help="an eighth of every size (tiny model)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    from loadtest.bench.common import bench_model
    from pagedbackend.models.default_model import resolve_model_path
    from loadtest.harness.triton import TritonServer
    from loadtest.harness.openai import OpenAIServer
    from pagedbackend.serving.repository import make_model_repository
    model = bench_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(model)), local_files_only=True)
    chosen = [c for c in cases(tokenizer, args.quick) if c["name"] in args.cases.split(",")]
    rows, settings = [], dict(item.split("=", 1) for item in args.set)
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        repo = make_model_repository(tmp, {"model": model, **settings})   # the shipped settings otherwise
        with TritonServer(repo, ready_timeout_s=900, wait_for_compiled_step=True) as server, \
                OpenAIServer(server.grpc_url, tokenizer=str(resolve_model_path(model))) as api:
            from client import generate
            generate(CANARY, CANARY_PARAMS, protocol="http", url=server.http_url, timeout=300)   # warm-up
            generate(CANARY, CANARY_PARAMS, protocol="openai", url=api.url, timeout=300)
            for case in chosen:
                alone = measure(server, case, with_canary=False, api_url=api.url)
                beside = measure(server, case, with_canary=True, api_url=api.url)
                row = {"case": case["name"], "requests": len(case["prompts"]),
                       "params": {k: (v if len(json.dumps(v)) < 200 else f"{len(json.dumps(v))} characters")
                                  for k, v in case["params"].items()},
                       "canary": beside["canary"], "heavy_alone_s": alone["heavy_s"],
                       "heavy_with_canary_s": beside["heavy_s"], "preemptions": beside["preemptions"],
                       "greedy_outputs_unchanged": alone["texts"] == beside["texts"],
                       "outcome": str(beside["texts"])[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if "schemas" in args.cases.split(","):
                rows.append(distinct_schemas(server, count=100 if args.quick else 1000,
                                             checkpoint=10 if args.quick else 100))
                print(json.dumps(rows[-1]), flush=True)
    path = write_result(args.out, "fairness", {"model": args.model, "settings": settings, "rows": rows,
                                               "canary": {"prompt": CANARY, **CANARY_PARAMS}})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
