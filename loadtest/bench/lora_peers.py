"""``bench lora``'s side-by-side with vLLM's CPU build: the same closed loop
of text prompts through vLLM's OpenAI server (``--enable-lora --max-loras N
--max-lora-rank R --lora-modules name=path ...``, each adapter a model) and
through our tritonserver (``enable_lora``, ``max_loras`` N, the adapters in
``multi_lora.json``, ``lora_name`` per request), one server at a time, for
the base model and 1, 4 and 16 adapters of each rank."""
import json
import pathlib
import random
import tempfile
from typing import Dict, List

from loadtest.harness.triton import free_port

from . import peer_servers
from .specdecode import closed_loop, summarise

WORDS = ("river stone garden window lantern harbor meadow engine pocket ladder violin orchard canyon "
         "compass blanket thunder marble feather anchor candle").split()


def prompts(n: int, words: int, seed: int) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def stream_ours(url: str, lora: str, max_tokens: int):
    from client import http_stream
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if lora:
        params["lora_name"] = lora

    def stream(prompt):
        for delta in http_stream(prompt, params, url=url, exclude_input=True, timeout=600):
            yield delta.num_tokens
    return stream


def ours(args, model: str, loras: List, rank: int):
    settings = {"max_num_seqs": max(64, args.streams), "num_kv_blocks": max(64, args.streams * 20),
                "enable_prefix_caching": "false"}
    if loras:
        settings.update(enable_lora="true", max_loras=len(loras), max_lora_rank=rank)
    repo = tempfile.mkdtemp(prefix="lora-bench-repo-")
    server = peer_servers.ours(model, free_port(), args.threads, settings, repo)
    folder = pathlib.Path(repo) / "paged_llm" / "1"
    (folder / "multi_lora.json").write_text(json.dumps({a.lora_name: a.lora_path for a in loras}))
    return server, lambda name: stream_ours(server.url, name, args.max_tokens)


def vllm(args, python: str, model: str, loras: List, rank: int):
    server = peer_servers.vllm(python, model, free_port(), args.threads, max(64, args.streams))
    if loras:
        server.command += ["--enable-lora", "--max-loras", str(len(loras)), "--max-lora-rank", str(rank),
                           "--max-cpu-loras", str(len(loras)), "--lora-modules",
                           *[f"{a.lora_name}={a.lora_path}" for a in loras]]
    return server, lambda name: (lambda prompt: peer_servers.stream_vllm(
        server.url, name or model, prompt, args.max_tokens, 600))


def run(args, python: str, model: str, adapters: Dict[int, List]) -> dict:
    """Per system and configuration: tok/s and TPOT, and the ratio to the system's base run."""
    configs = {"base": (0, [])}
    for rank, loras in adapters.items():
        for count in args.counts:
            configs[f"{count} x rank {rank}"] = (rank, loras[:count])
    work = prompts(args.requests, max(8, args.prompt_len // 2), args.seed)
    position = {p: i for i, p in enumerate(work)}   # request i runs with adapter i mod the count
    out = {}
    for system in ("ours", "vllm"):
        for name, (rank, loras) in configs.items():
            server, stream_for = (ours(args, model, loras, rank) if system == "ours"
                                  else vllm(args, python, model, loras, rank))
            names = [a.lora_name for a in loras] or [None]
            try:
                with server:
                    closed_loop(lambda p: stream_for(names[0])(p), work[:args.streams], args.streams)   # warm
                    records = closed_loop(lambda p: stream_for(names[position[p] % len(names)])(p), work,
                                          args.streams)
                out[f"{system}/{name}"] = summarise(records)
            except Exception as exc:   # one system or setting that fails is named, the rest still run
                out[f"{system}/{name}"] = {"error": peer_servers.error_text(exc)}
            print(f"{system}/{name}: {out[f'{system}/{name}']}", flush=True)
    for key, row in out.items():
        base = out.get(key.split("/")[0] + "/base", {})
        if "tok_s" in row and base.get("tok_s"):
            row["tok_s_vs_own_base"] = round(row["tok_s"] / base["tok_s"], 3)
    out["note"] = "one run per setting; TPOT is the median of per-request means (specdecode.summarise)"
    return out

