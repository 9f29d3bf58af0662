"""Time to first token through the OpenAI-compatible API against straight to
tritonserver over gRPC: what the API adds.

One tritonserver (prefix caching off, so a repeated prompt costs the same
each time) and the API server in front of it. Requests go one at a time; each
round sends one fresh Alpaca-like prompt by every path, in an order that
rotates from round to round:

- ``grpc``: gRPC streaming with tritonclient (``client.grpc_stream_async``, one
  shared connection), the prompt as is;
- ``completions``: ``/v1/completions`` server-sent events over one kept-alive
  httpx connection;
- ``completions_sdk``: the same through the official ``openai`` package
  (``AsyncOpenAI``), as a user would call it;
- ``grpc_chat_prompt``: gRPC with the prompt already through the chat template;
- ``chat``: ``/v1/chat/completions`` (the API applies the template).

Greedy, EOS ignored, ``--max-tokens`` tokens each. The added time to first
token of an API path is its difference to the gRPC request of the same round
(``chat`` against ``grpc_chat_prompt``, which has the same prompt tokens);
the table gives the median of those differences. The CPU time the API server
process used per request is reported too: unlike latency, it does not depend
on what else runs on the machine.
"""
import argparse
import asyncio
import json
import os
import pathlib
import statistics
import tempfile
import time

from loadtest import workloads

from . import plots
from .common import add_common_args, bench_model, set_threads, write_result

PATHS = ("grpc", "completions", "completions_sdk", "grpc_chat_prompt", "chat")
BASELINE = {"completions": "grpc", "completions_sdk": "grpc", "chat": "grpc_chat_prompt"}


def _summary(values):
    ordered = sorted(values)
    return {"median_ms": 1000 * statistics.median(ordered), "p10_ms": 1000 * ordered[int(0.1 * (len(ordered) - 1))],
            "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))]}


async def _grpc(client, url: str, prompt: str, params: dict):
    from client import grpc_stream_async
    start, first, text = time.perf_counter(), None, []
    async for delta in grpc_stream_async(prompt, params, url=url, client=client, timeout=120):
        if delta.num_tokens and first is None:
            first = time.perf_counter() - start
        text.append(delta.text)
    return first, time.perf_counter() - start, "".join(text)


async def _sse(http, url: str, body: dict):
    start, first, text = time.perf_counter(), None, []
    async with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code}: {(await reply.aread()).decode()}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
    return first, time.perf_counter() - start, "".join(text)


async def _sdk(sdk, prompt: str, max_tokens: int):
    start, first, text = time.perf_counter(), None, []
    stream = await sdk.completions.create(model="paged_llm", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.text and first is None:
                first = time.perf_counter() - start
            text.append(choice.text)
    return first, time.perf_counter() - start, "".join(text)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(grpc_url: str, api_url: str, prompts, chat_prompts, max_tokens: int, warmup: int = 3) -> dict:
    """Per path: the (ttft, latency, text) of each round after ``warmup`` rounds."""
    import httpx
    import openai
    import tritonclient.grpc.aio as aioclient

    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    grpc_client = aioclient.InferenceServerClient(grpc_url)
    http = httpx.AsyncClient(timeout=120)
    sdk = openai.AsyncOpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0)
    runs = {
        "grpc": lambda i: _grpc(grpc_client, grpc_url, prompts[i], params),
        "grpc_chat_prompt": lambda i: _grpc(grpc_client, grpc_url, chat_prompts[i], params),
        "completions": lambda i: _sse(http, f"{api_url}/v1/completions",
                                      {"prompt": prompts[i], "stream": True, **params}),
        "completions_sdk": lambda i: _sdk(sdk, prompts[i], max_tokens),
        "chat": lambda i: _sse(http, f"{api_url}/v1/chat/completions",
                               {"messages": [{"role": "user", "content": prompts[i]}], "stream": True, **params}),
    }
    records = {path: [] for path in PATHS}
    try:
        for i in range(len(prompts)):
            order = PATHS[i % len(PATHS):] + PATHS[:i % len(PATHS)]
            for path in order:
                result = await runs[path](i)
                if i >= warmup:
                    records[path].append(result)
    finally:
        await grpc_client.close()
        await http.aclose()
        await sdk.close()
    return records


def median_interval(values, seed: int = 0, resamples: int = 2000) -> list:
    """A 95 % bootstrap interval of the median, in ms."""
    import numpy as np
    rng = np.random.default_rng(seed)
    data = np.asarray(values)
    medians = np.median(rng.choice(data, size=(resamples, len(data))), axis=1)
    return [1000 * float(np.percentile(medians, 2.5)), 1000 * float(np.percentile(medians, 97.5))]


def summarise(records: dict) -> dict:
    paths = {path: {"ttft": _summary([r[0] for r in rows]), "latency": _summary([r[1] for r in rows])}
             for path, rows in records.items()}
    added = {}
    for path, base in BASELINE.items():
        diffs = [a[0] - b[0] for a, b in zip(records[path], records[base])]
        same = sum(a[2] == b[2] for a, b in zip(records[path], records[base])) / len(diffs)
        added[path] = {"against": base, "added_ttft": {**_summary(diffs), "median_95ci_ms": median_interval(diffs)},
                       "same_text": same}
    ttfts = {path: [round(1000 * r[0], 3) for r in rows] for path, rows in records.items()}
    return {"paths": paths, "added": added, "ttft_ms_per_round": ttfts}


def plot(result: dict, out_dir: str):
    fig, (ax,) = plots.figure(width=6.4, height=4.0)
    paths = list(result["paths"])
    plots.grouped_bars(ax, paths, {"median TTFT": [result["paths"][p]["ttft"]["median_ms"] for p in paths]},
                       ylabel="median time to first token (ms)")
    return plots.save(fig, out_dir, "openai_api",
                      f"OpenAI-compatible API vs direct gRPC ({result['model']} model, CPU)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench openai_api", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (steady timings), 'default' or a folder")
    ap.add_argument("--rounds", type=int, default=100, help="prompts, each sent by every path")
    ap.add_argument("--max-tokens", type=int, default=8)
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 12
    set_threads(args.threads)
    started = time.perf_counter()
    model = bench_model(args.model)
    from transformers import AutoTokenizer

    from pagedbackend.models.default_model import resolve_model_path
    from loadtest.harness.triton import TritonServer
    from pagedbackend.serving.repository import make_model_repository
    from loadtest.harness.openai import OpenAIServer
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(model)), local_files_only=True)
    prompts = workloads.make_text_prompts(workloads.alpaca_like(args.rounds, args.seed), tokenizer, args.seed)
    chat_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                  add_generation_prompt=True) for p in prompts]
    settings = dict(model=model, block_size=16, num_kv_blocks=512, max_num_seqs=16,
                    enable_prefix_caching=False, dtype="float32", device="cpu")
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        repo = make_model_repository(tmp, settings)
        with TritonServer(repo, env=env, ready_timeout_s=600, wait_for_compiled_step=True) as triton, \
                OpenAIServer(triton.grpc_url, tokenizer=model) as api:
            cpu_before = cpu_seconds(api.process.pid)
            records = asyncio.run(measure(triton.grpc_url, api.url, prompts, chat_prompts, args.max_tokens))
            api_requests = sum(len(records[p]) for p in BASELINE) + 3 * len(BASELINE)  # with the warm-up
            api_cpu_ms = 1000 * (cpu_seconds(api.process.pid) - cpu_before) / api_requests
    result = {"model": args.model, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "settings": {**settings, "model": args.model}, **summarise(records),
              "api_server_cpu_ms_per_request": round(api_cpu_ms, 2),
              "seconds": round(time.perf_counter() - started, 1)}
    for path, s in result["paths"].items():
        print(f"{path:17s} median TTFT {s['ttft']['median_ms']:6.2f} ms  "
              f"(p90 {s['ttft']['p90_ms']:6.2f})  median latency {s['latency']['median_ms']:7.2f} ms")
    for path, a in result["added"].items():
        low, high = a["added_ttft"]["median_95ci_ms"]
        print(f"{path:17s} adds {a['added_ttft']['median_ms']:+.2f} ms median TTFT over {a['against']} "
              f"(95 % interval {low:+.2f} to {high:+.2f}; p10 {a['added_ttft']['p10_ms']:+.2f}, "
              f"p90 {a['added_ttft']['p90_ms']:+.2f}); same text {100 * a['same_text']:.0f} %")
    print(f"the API server used {api_cpu_ms:.2f} ms of CPU per request ({args.max_tokens} tokens)")
    path = write_result(args.out, "openai_api", result)
    print(f"wrote {path} and {plot(result, args.out)}")
    return result


if __name__ == "__main__":
    main()
