"""Replicas behind NVIDIA Dynamo's KV-aware router against round-robin and
random routing, on multi-turn chat (``make fleet``'s fleet).

One fleet of ``--replicas`` replicas (each tritonserver with KV events on,
the cores split between them) and their Dynamo workers; one Dynamo frontend
per routing mode (``kv``, ``round-robin``, ``random``), all on the same
replicas. The workload: ``--conversations`` chats run at once, each of
``--turns`` turns that resend the whole history (``/v1/chat/completions``,
streamed), chats starting as a Poisson process (``--chat-rate``); user turns have ShareGPT-like lengths (mean 161 tokens, heavy
tail, capped at ``--max-user-tokens``), answers ShareGPT-like lengths capped
at ``--max-answer`` tokens (EOS ignored), synthetic text, seeded. Each round
draws new chats and runs them through every mode, the order rotating from
round to round; every mode-round has its own cache salt, so no run finds
another's blocks (salts hash apart in the engines and in the router).

Figures per mode: prefix-cache hit rate (``cached_tokens / prompt_tokens``
from each response's usage), prompt tokens computed per request (what TTFT
grows with), TTFT p50/p99 and output tok/s; and the oracle
hit rate (every earlier turn of every chat cached: full blocks of the longest
prefix shared with any earlier prompt plus its answer). Then what the
frontend and worker hop costs: single short requests, one at a time, straight
to a replica over gRPC, through ``make serve``'s OpenAI API on that replica,
and through Dynamo's frontend and worker. Last (``--kill``), the kv workload
once more with one replica's tritonserver SIGKILLed mid-run: every request
finishes, moves to the survivor, or ends with an explicit error; none hangs.
"""
import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np

from loadtest import workloads

from .common import bench_model, write_result

MODES = ("kv", "round-robin", "random")


def chat_workload(tokenizer, conversations: int, turns: int, seed: int, max_user: int, max_answer: int):
    """Per chat, per turn: (user text, answer length)."""
    trace = workloads.sharegpt_like(conversations * turns, seed)
    trace = [workloads.Request(min(r.prompt_len, max_user), min(r.output_len, max_answer)) for r in trace]
    texts = workloads.make_text_prompts(trace, tokenizer, seed)
    return [[(texts[c * turns + t], trace[c * turns + t].output_len) for t in range(turns)]
            for c in range(conversations)]


def template_ids(tokenizer, messages) -> list:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class PrefixOracle:
    """A cache that never forgets: every earlier sequence's full blocks."""

    def __init__(self, block: int):
        self.block, self.seen = block, set()

    def cached(self, ids) -> int:
        n, limit = 0, (len(ids) - 1) // self.block   # the last prompt token is always computed
        while n < limit and tuple(ids[:(n + 1) * self.block]) in self.seen:
            n += 1
        return n * self.block

    def add(self, ids) -> None:
        for n in range(1, len(ids) // self.block + 1):
            self.seen.add(tuple(ids[:n * self.block]))


async def run_chats(url: str, chats, salt: str, timeout_s: float, starts=None):
    """The chats, chat c starting ``starts[c]`` seconds in (all at once without
    ``starts``), each turn after the previous one's answer; one record per request."""
    import openai
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=timeout_s)
    records = []

    async def chat(c: int, turns):
        await asyncio.sleep(starts[c] if starts else 0.0)
        messages = []
        for t, (text, answer_len) in enumerate(turns):
            messages.append({"role": "user", "content": text})
            start, first, answer, usage, error = time.perf_counter(), None, [], None, None
            try:
                stream = await client.chat.completions.create(
                    model="paged_llm", messages=messages, max_tokens=answer_len, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "nvext": {"cache_salt": salt}})
                async for part in stream:
                    piece = part.choices[0].delta.content if part.choices else None
                    if piece and first is None:
                        first = time.perf_counter() - start
                    answer.append(piece or "")
                    usage = part.usage or usage
            except Exception as exc:   # recorded: an explicit error, never a silent loss
                error = f"{type(exc).__name__}: {exc}"[:300]
            records.append({"chat": c, "turn": t, "messages": list(messages), "answer": "".join(answer),
                            "started": start, "finished": time.perf_counter(),
                            "ttft": first, "latency": time.perf_counter() - start, "error": error,
                            "prompt_tokens": usage.prompt_tokens if usage else None,
                            "completion_tokens": usage.completion_tokens if usage else 0,
                            "cached_tokens": (usage.prompt_tokens_details.cached_tokens or 0)
                            if usage and usage.prompt_tokens_details else 0})
            if error:
                return
            messages.append({"role": "assistant", "content": "".join(answer)})

    start = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(chat(c, turns) for c, turns in enumerate(chats))),
                               timeout_s * len(chats[0]) + 60)
    finally:
        await client.close()
    return records, time.perf_counter() - start


def summarise(records, seconds: float) -> dict:
    done = [r for r in records if r["error"] is None]
    ttft_ms = {(r["chat"], r["turn"]): None if r["ttft"] is None else round(1000 * r["ttft"], 1) for r in done}
    ttfts = sorted(r["ttft"] for r in done if r["ttft"] is not None)
    prompt = sum(r["prompt_tokens"] or 0 for r in done)
    pick = lambda q: 1000 * ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None
    return {"requests": len(records), "errors": len(records) - len(done),
            "hit_rate": sum(r["cached_tokens"] for r in done) / prompt if prompt else 0.0,
            # what a request's TTFT grows with: the prompt tokens it computes
            "uncached_tokens_mean": (prompt - sum(r["cached_tokens"] for r in done)) / len(done) if done else None,
            "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None, "ttft_p99_ms": pick(0.99),
            "output_tok_s": sum(r["completion_tokens"] for r in done) / seconds, "seconds": round(seconds, 1),
            # chat, turn, prompt tokens, cached tokens, TTFT (ms)
            "requests": sorted([r["chat"], r["turn"], r["prompt_tokens"], r["cached_tokens"],
                                ttft_ms[(r["chat"], r["turn"])]] for r in done)}


def oracle_hit_rate(tokenizer, records, block: int) -> dict:
    """Hit rate of one cache that holds every request finished before a request
    starts (its prompt and answer) and never forgets, over the same requests."""
    oracle, cached, prompt, mismatched, rows = PrefixOracle(block), 0, 0, 0, []
    done = sorted(records, key=lambda r: r["finished"])
    for r in sorted(records, key=lambda r: r["started"]):
        while done and done[0]["finished"] <= r["started"]:
            earlier = done.pop(0)
            oracle.add(template_ids(tokenizer, earlier["messages"])
                       + tokenizer.encode(earlier["answer"], add_special_tokens=False))
        ids = template_ids(tokenizer, r["messages"])
        mismatched += r["prompt_tokens"] is not None and r["prompt_tokens"] != len(ids)
        hit = oracle.cached(ids)
        cached += hit
        prompt += len(ids)
        rows.append([r["chat"], r["turn"], len(ids), r["cached_tokens"], hit])
    return {"hit_rate": cached / prompt if prompt else 0.0, "template_length_mismatches": mismatched,
            "uncached_tokens_mean": (prompt - cached) / len(rows) if rows else None,
            "requests": sorted(rows)}   # chat, turn, prompt tokens, cached (kv), cached (oracle)


# ---------------------------------------------------------------- processes
def start_frontend(mode: str, port: int, discovery: str, block: int, log_path: str) -> subprocess.Popen:
    from pagedbackend.serving.fleet import NAMESPACE, dynamo_env
    command = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
               "--router-mode", mode, "--kv-cache-block-size", str(block), "--namespace", NAMESPACE]
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, env={**os.environ, **dynamo_env(discovery)}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def wait_for(probe, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(1.0)


def prompt_tokens_served(metrics_port: int) -> float:
    """The replica's prompt-token counter (what share of the work it got)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("pagedbackend:prompt_tokens_total{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def compiled(metrics_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            page = reply.read().decode()
    except OSError:
        return False
    return any(line.startswith("pagedbackend:model_step_compiled{") and line.endswith(" 1")
               for line in page.splitlines())


# ---------------------------------------------------------------- the hop
async def hop_costs(paths: dict, prompts, max_tokens: int, warmup: int = 3) -> dict:
    """TTFT of the same short request by each path, one at a time, paths rotating; fresh salt each."""
    records = {name: [] for name in paths}
    names = list(paths)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            ttft = await paths[name](prompt, f"hop-{i}-{name}", max_tokens)
            if i >= warmup:
                records[name].append(ttft)
    return records


async def via_openai(client, prompt: str, salt: str, max_tokens: int, dynamo: bool) -> float:
    extra = {"ignore_eos": True, **({"nvext": {"cache_salt": salt}} if dynamo else {"cache_salt": salt})}
    start, first = time.perf_counter(), None
    stream = await client.completions.create(model="paged_llm", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True, extra_body=extra)
    async for part in stream:
        if first is None and part.choices and part.choices[0].text:
            first = time.perf_counter() - start
    return first


async def via_grpc(triton, prompt: str, salt: str, max_tokens: int) -> float:
    start, first = time.perf_counter(), None
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "cache_salt": salt}
    async for update in triton.stream("paged_llm", prompt, params, False):
        if first is None and any(update.num_tokens):
            first = time.perf_counter() - start
    return first


async def measure_hop(grpc_url: str, api_url: str, dynamo_url: str, prompts, max_tokens: int) -> dict:
    import openai
    from pagedbackend.serving.openai.triton_client import Triton
    triton = Triton(grpc_url)
    await triton.open()
    api = openai.AsyncOpenAI(base_url=api_url, api_key="unused", max_retries=0, timeout=120)
    dynamo = openai.AsyncOpenAI(base_url=dynamo_url, api_key="unused", max_retries=0, timeout=120)
    try:
        records = await hop_costs({
            "grpc": lambda p, salt, n: via_grpc(triton, p, salt, n),
            "make_serve": lambda p, salt, n: via_openai(api, p, salt, n, dynamo=False),
            "dynamo": lambda p, salt, n: via_openai(dynamo, p, salt, n, dynamo=True)}, prompts, max_tokens)
    finally:
        await triton.close()
        await api.close()
        await dynamo.close()
    median = lambda xs: 1000 * statistics.median(xs)
    out = {name: {"ttft_p50_ms": median(xs)} for name, xs in records.items()}
    for name, base in (("make_serve", "grpc"), ("dynamo", "grpc"), ("dynamo", "make_serve")):
        out[f"{name}_minus_{base}_ms"] = median([a - b for a, b in zip(records[name], records[base])])
    return out


# ---------------------------------------------------------------- the run
def kill_mid_run(fleet, url: str, chats, salt: str, timeout_s: float, after_s: float) -> dict:
    """The kv workload with replica 1's tritonserver SIGKILLed ``after_s`` in."""
    from pagedbackend.serving.fleet import child_pids
    victim = fleet.state()["replicas"][-1]

    async def run():
        task = asyncio.ensure_future(run_chats(url, chats, salt, timeout_s))
        await asyncio.sleep(after_s)
        killed = child_pids(victim["serve_pid"])
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        records, seconds = await task
        return records, seconds, killed
    records, seconds, killed = asyncio.run(run())
    expected = sum(len(c) for c in chats)
    finished = sum(r["error"] is None for r in records)
    errors = [r["error"] for r in records if r["error"] is not None]
    # A chat stops at its first error: its later turns were never sent.
    not_sent = expected - len(records)
    return {"killed_pids": killed, "requests_planned": expected, "finished": finished,
            "explicit_errors": len(errors), "not_sent_after_an_error": not_sent, "error_samples": errors[:3],
            "seconds": round(seconds, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny' or a folder")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds, each through every mode (0: none)")
    ap.add_argument("--chat-rate", type=float, default=0.25,
                    help="chats start as a Poisson process of this rate per second (0: all at once)")
    ap.add_argument("--max-user-tokens", type=int, default=384)
    ap.add_argument("--max-answer", type=int, default=32)
    ap.add_argument("--hop-requests", type=int, default=30)
    ap.add_argument("--no-kill", dest="kill", action="store_false", help="skip the replica-kill run")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="engine setting for replicas")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 chats of 3 turns, one round")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.conversations, args.turns, args.rounds, args.hop_requests = "tiny", 4, 3, 1, 8
        args.set = ["compile=false"] + args.set
    started = time.perf_counter()

    def interrupted(signum, frame):   # SIGTERM stops the run as Ctrl-C does: the fleet is taken down
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    from transformers import AutoTokenizer

    from pagedbackend.models.default_model import resolve_model_path
    from pagedbackend.serving.fleet import frontend_workers
    from loadtest.harness.fleet import FleetProcess
    from loadtest.harness.triton import free_port
    from loadtest.harness.openai import OpenAIServer
    from pagedbackend.serving.fleet import stop as stop_process
    model = bench_model(args.model)
    folder = str(resolve_model_path(model))
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    block = 16
    fleet_args = ["--model", model, *sum((["--set", s] for s in args.set), [])]
    frontends, result = {}, {"model": args.model, "replicas": args.replicas, "conversations": args.conversations,
                             "turns": args.turns, "rounds": args.rounds, "max_user_tokens": args.max_user_tokens,
                             "max_answer": args.max_answer, "settings": args.set}
    with FleetProcess(args.replicas, fleet_args, ready_timeout_s=1800) as fleet:
        state = fleet.state()
        print(f"fleet ready ({time.perf_counter() - started:.0f} s); waiting for the compiled steps", flush=True)
        if not any(s.startswith("compile=false") for s in args.set):
            wait_for(lambda: all(compiled(r["metrics"]) for r in state["replicas"]), 1200, "compiled steps")
        urls = {"kv": fleet.base_url}
        discovery = str(fleet.work / "fleet" / "discovery")
        try:
            for mode in MODES[1:]:
                port = free_port()
                frontends[mode] = start_frontend(mode, port, discovery, block, str(fleet.work / f"{mode}.log"))
                urls[mode] = f"http://127.0.0.1:{port}/v1"
                wait_for(lambda: frontend_workers(port) >= args.replicas, 300, f"the {mode} frontend")
            rounds, all_records = [], {}
            for r in range(args.rounds):
                chats = chat_workload(tokenizer, args.conversations, args.turns, args.seed + r,
                                      args.max_user_tokens, args.max_answer)
                starts = workloads.poisson_arrivals(args.chat_rate, args.conversations, args.seed + r) \
                    if args.chat_rate > 0 else None
                row = {}
                for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                    before = [prompt_tokens_served(rep["metrics"]) for rep in state["replicas"]]
                    records, seconds = asyncio.run(run_chats(urls[mode], chats, f"{mode}-{r}-{args.seed}",
                                                             args.request_timeout, starts))
                    row[mode] = summarise(records, seconds)
                    row[mode]["prompt_tokens_per_replica"] = [
                        prompt_tokens_served(rep["metrics"]) - b for rep, b in zip(state["replicas"], before)]
                    all_records.setdefault(mode, []).extend(records)
                    if mode == "kv":
                        row["oracle"] = oracle_hit_rate(tokenizer, records, block)
                    print(f"round {r} {mode:11s} " + json.dumps(row[mode]), flush=True)
                row["kv_hit_over_oracle"] = row["kv"]["hit_rate"] / row["oracle"]["hit_rate"]
                row["kv_ttft_p50_over_round_robin"] = row["kv"]["ttft_p50_ms"] / row["round-robin"]["ttft_p50_ms"]
                # Prompt tokens computed per request, set against round-robin's: kv's, and
                # the oracle's (the least any routing computes: the floor under kv's TTFT ratio).
                for who, summary in (("kv", row["kv"]), ("oracle", row["oracle"])):
                    row[f"{who}_uncached_over_round_robin"] = (summary["uncached_tokens_mean"]
                                                               / row["round-robin"]["uncached_tokens_mean"])
                print(f"round {r}: oracle hit rate {row['oracle']['hit_rate']:.3f}; kv/oracle "
                      f"{row['kv_hit_over_oracle']:.3f}; kv/round-robin TTFT p50 "
                      f"{row['kv_ttft_p50_over_round_robin']:.3f}; uncached tokens / round-robin's: kv "
                      f"{row['kv_uncached_over_round_robin']:.3f}, oracle {row['oracle_uncached_over_round_robin']:.3f}",
                      flush=True)
                rounds.append(row)
            result["rounds_detail"] = rounds
            for key in ("kv_hit_over_oracle", "kv_ttft_p50_over_round_robin", "kv_uncached_over_round_robin",
                        "oracle_uncached_over_round_robin") if rounds else ():
                result[key] = statistics.median(row[key] for row in rounds)
            # Every round's requests together, per mode (the figures of the table).
            result["pooled"] = {}
            if rounds:
                result["pooled"] = {mode: {k: v for k, v in summarise(records, 1.0).items()
                                           if k in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "errors")}
                                    for mode, records in all_records.items()}
                result["pooled"]["oracle_hit_rate"] = statistics.mean(row["oracle"]["hit_rate"] for row in rounds)
                for mode in MODES:
                    result["pooled"][mode]["output_tok_s"] = statistics.mean(row[mode]["output_tok_s"]
                                                                             for row in rounds)
                result["pooled_kv_ttft_p50_over_round_robin"] = (result["pooled"]["kv"]["ttft_p50_ms"]
                                                                 / result["pooled"]["round-robin"]["ttft_p50_ms"])

            replica0 = state["replicas"][0]
            grpc_url = f"127.0.0.1:{replica0['grpc']}"
            prompts = workloads.make_text_prompts(workloads.alpaca_like(args.hop_requests, args.seed), tokenizer,
                                                  args.seed)
            with OpenAIServer(grpc_url, tokenizer=folder) as api:
                result["hop"] = asyncio.run(measure_hop(grpc_url, api.base_url, urls["kv"], prompts, 8))
            print("hop: " + json.dumps(result["hop"]), flush=True)

            if args.kill:
                chats = chat_workload(tokenizer, args.conversations, args.turns, args.seed + 1000,
                                      args.max_user_tokens, args.max_answer)
                result["kill"] = kill_mid_run(fleet, urls["kv"], chats, f"kill-{args.seed}", args.request_timeout,
                                              after_s=20.0 if args.model != "tiny" else 2.0)
                print("kill: " + json.dumps(result["kill"]), flush=True)
        finally:
            for process in frontends.values():
                stop_process(process, 30.0)
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.rounds:
        print(f"kv hit rate / oracle {result['kv_hit_over_oracle']:.3f} (>= 0.9 wanted); kv TTFT p50 / "
              f"round-robin {result['kv_ttft_p50_over_round_robin']:.3f}, all rounds pooled "
              f"{result['pooled_kv_ttft_p50_over_round_robin']:.3f} (<= 0.6 wanted); uncached prompt tokens "
              f"/ round-robin's: kv {result['kv_uncached_over_round_robin']:.3f}, oracle "
              f"{result['oracle_uncached_over_round_robin']:.3f}")
        print("pooled: " + json.dumps(result["pooled"]))
    print(f"wrote {write_result(args.out, 'fleet', result)}")
    return result


if __name__ == "__main__":
    main()
