"""Multi-LoRA serving: what adapters cost a full batch.

Two in-process engines on the same model, one without LoRA and one with it
(its pool holds 16 adapters of rank 64), serve a closed loop of
``--streams`` requests (each stream sends its next request when the last
one ends; seeded token prompts, seeded output lengths, EOS ignored):

- the base model, LoRA off, and the base model, LoRA on (steps without
  adapters: the acceptance is "within noise" of LoRA off);
- 1, 4 and 16 distinct adapters, rank 8 and rank 64, the requests spread
  over them (acceptance: 16 adapters keep at least 0.7x base throughput);
- half the streams on the base model beside half on 16 rank-8 adapters:
  the base requests' TPOT against the base model alone.

Every configuration runs once per round, in an order rotated each round;
figures are medians over rounds of each run's ratio to the same round's
base run (LoRA off), so a neighbour's load on the shared machine hits both
sides of a ratio alike; tokens per CPU second of the engine (its process
time, one thread by default) give the same ratios without the neighbours'
share of the cores. The adapters are random PEFT-format folders written
once under the cache. The pool's choice (adapter pages in a pool of their
own, not in the KV block pool) is measured by what a rank page weighs in KV
blocks and what paging an adapter in costs beside a step.

With ``--vllm-python`` (or ``BENCH_VLLM_PYTHON``) vLLM's CPU build serves the
same loop through its OpenAI server with ``--enable-lora --max-loras N``
(N = the adapter count) beside our server (tritonserver, ``multi_lora.json``);
without it that part is skipped with a message.
"""
import argparse
import json
import os
import pathlib
import random
import statistics
import time
from typing import Dict, List, Optional

from .common import add_common_args, bench_model, set_threads, write_result

KINDS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapters(model_dir: str, rank: int, count: int, root: pathlib.Path) -> List[str]:
    """``count`` random rank-``rank`` LoRA adapters of every projection, in
    PEFT's folder format, written once under ``root``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, config.num_attention_heads * head_dim), "k_proj": (hidden, kv),
              "v_proj": (hidden, kv), "o_proj": (config.num_attention_heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    folders = []
    for i in range(count):
        folder = root / f"rank{rank}-{i}"
        folders.append(str(folder))
        if (folder / "adapter_model.safetensors").exists():
            continue
        g = torch.Generator().manual_seed(rank * 1000 + i)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for block, projections in KINDS.items():
                for proj in projections:
                    n_in, n_out = shapes[proj]
                    key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                    tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
                    tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": [p for ps in KINDS.values() for p in ps]}))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folders


def jobs(args, seed: int, adapters: List, base_share: float = 0.0) -> List[dict]:
    """The requests of one run: prompts of ``args.prompt_len`` +- a quarter,
    outputs of ``args.max_tokens`` +- a quarter; every request past the base
    share runs with the next adapter."""
    rng = random.Random(seed)
    out = []
    for i in range(args.requests):
        plen = rng.randint(args.prompt_len * 3 // 4, args.prompt_len * 5 // 4)
        base = not adapters or i % 2 == 0 and base_share > 0
        out.append({"prompt": [rng.randint(100, 40000) for _ in range(plen)],
                    "max_tokens": rng.randint(args.max_tokens * 3 // 4, args.max_tokens * 5 // 4),
                    "lora": None if base else adapters[(i // (2 if base_share else 1)) % len(adapters)]})
    return out


def closed_loop(engine, work: List[dict], streams: int) -> dict:
    """Serve ``work`` with ``streams`` requests in flight; tok/s and TPOT (all
    requests, and the base model's alone)."""
    from pagedbackend import SamplingParams
    pending, live, tpot = list(work), {}, {"all": [], "base": []}
    tokens, started, cpu = 0, time.perf_counter(), time.process_time()
    while pending or live:
        while pending and len(live) < streams:
            job = pending.pop(0)
            request_id = f"lora-bench-{id(job)}-{len(pending)}"
            engine.add_request(request_id, job["prompt"], SamplingParams(
                max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True), lora_request=job["lora"])
            live[request_id] = job
        for out in engine.step():
            if out.finished:
                job, m = live.pop(out.request_id), out.metrics
                n = out.outputs[0].num_tokens
                tokens += n
                if n > 1:
                    per_token = (m.finished_time - m.first_token_time) / (n - 1)
                    tpot["all"].append(per_token)
                    if job["lora"] is None:
                        tpot["base"].append(per_token)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"tok_s": tokens / seconds, "tok_per_cpu_s": tokens / cpu,
            "tpot_ms": 1000 * statistics.median(tpot["all"]),
            "base_tpot_ms": 1000 * statistics.median(tpot["base"]) if tpot["base"] else None}


def configurations(args, adapters: Dict[int, List]) -> Dict[str, tuple]:
    """name -> (engine key, adapters, base share)."""
    out = {"base, LoRA off": ("off", [], 0.0), "base, LoRA on": ("on", [], 0.0)}
    for rank in args.ranks:
        for count in args.counts:
            out[f"{count} x rank {rank}"] = ("on", adapters[rank][:count], 0.0)
    top = max(args.counts)
    out[f"half base + {top} x rank {min(args.ranks)}"] = ("on", adapters[min(args.ranks)][:top], 0.5)
    return out


def pool_figures(engine, adapters: Dict[int, List]) -> dict:
    """What the separate adapter pool weighs against the KV pool, and what
    paging an adapter in costs (LoRAModel.write, median of 5)."""
    runner, manager = engine.runner, engine.lora
    elem = next(iter(runner.lora.shards.values())).A.element_size()
    page = sum((s.in_features + s.out_features) * elem for s in runner.lora.shards.values())
    out = {"rank_page_bytes": page, "kv_block_bytes": runner.kv_bytes_per_block,
           "rank_page_in_kv_blocks": round(page / runner.kv_bytes_per_block, 3),
           "pool_pages": manager.pool.num_pages, "pool_bytes": page * manager.pool.num_pages,
           "kv_pool_bytes": runner.kv_bytes_per_block * runner.num_kv_blocks}
    for rank, folders in adapters.items():
        weights = manager.load(folders[0])
        pages = list(range(rank))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            runner.lora.write(weights, pages)
            times.append(time.perf_counter() - start)
        out[f"page_in_ms_rank{rank}"] = round(1000 * statistics.median(times), 2)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench lora", description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--model", default="default", help='"default", "tiny" or a model folder')
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64, help="requests per run")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--counts", default="1,4,16", help="distinct adapters per run")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="eager steps (no torch.compile)")
    ap.add_argument("--adapters", help="folder for the random adapters (default: under the cache)")
    ap.add_argument("--vllm-python", default=os.environ.get("BENCH_VLLM_PYTHON"),
                    help="vLLM's CPU build (its venv's python) for the side-by-side")
    args = ap.parse_args(argv)
    if args.quick:
        args.model = "tiny" if args.model == "default" else args.model
        args.streams, args.requests, args.rounds = 4, 8, 1
        args.counts, args.ranks, args.max_tokens, args.prompt_len = "1,2", "8", 8, 16
    args.counts = [int(c) for c in args.counts.split(",")]
    args.ranks = [int(r) for r in args.ranks.split(",")]
    return args


def main(argv=None) -> dict:
    from pagedbackend import LLMEngine, LoRARequest
    from pagedbackend.config import EngineConfig, cache_root

    args = parse_args(argv)
    set_threads(args.threads)
    from pagedbackend.models.default_model import resolve_model_path
    model = str(resolve_model_path(bench_model(args.model)))
    top = max(args.counts)
    adapters = {}
    for rank in args.ranks:
        root = pathlib.Path(args.adapters) if args.adapters else cache_root() / "bench-lora" / pathlib.Path(model).name
        folders = write_adapters(model, rank, top, root)
        adapters[rank] = [LoRARequest(f"r{rank}-{i}", rank * 100 + i + 1, f) for i, f in enumerate(folders)]
    # No prefix caching: runs repeat their prompts, and a hit would skip the very work measured.
    settings = dict(model=model, num_kv_blocks=max(64, args.streams * 20), max_num_seqs=max(64, args.streams),
                    compile=not args.no_compile, enable_prefix_caching=False)
    engines = {"off": LLMEngine(EngineConfig(**settings)),
               "on": LLMEngine(EngineConfig(**settings, enable_lora=True, max_loras=top,
                                            max_lora_rank=max(args.ranks), max_cpu_loras=top * len(args.ranks)))}
    configs = configurations(args, adapters)
    for lora in [a for folders in adapters.values() for a in folders]:   # folders read before timing
        engines["on"].add_lora(lora)
    for name, (key, loras, share) in configs.items():   # a short unmeasured run each: graphs, pages
        closed_loop(engines[key], jobs(args, args.seed - 1, loras, share)[:4], args.streams)
    rounds = []
    for r in range(args.rounds):
        names = list(configs)
        names = names[r % len(names):] + names[:r % len(names)]
        runs = {}
        for name in names:
            key, loras, share = configs[name]
            runs[name] = closed_loop(engines[key], jobs(args, args.seed + r, loras, share), args.streams)
            print(f"round {r + 1}: {name:28s} {runs[name]['tok_s']:7.1f} tok/s  "
                  f"{runs[name]['tok_per_cpu_s']:7.1f} tok/CPU s  TPOT {runs[name]['tpot_ms']:6.1f} ms", flush=True)
        rounds.append(runs)
    table = summary(rounds, list(configs))
    result = {"settings": {k: v for k, v in vars(args).items() if k != "vllm_python"}, "model": model,
              "table": table, "rounds": rounds, "pool": pool_figures(engines["on"], adapters),
              "vllm": compare_vllm(args, model, adapters)}
    for line in table_lines(table):
        print(line)
    print(json.dumps(result["pool"]))
    write_result(args.out, "lora", result)
    return result


def summary(rounds: List[dict], names: List[str]) -> List[dict]:
    """Per configuration: medians over rounds of tok/s, TPOT and their ratios
    to the round's base run with LoRA off (and the base requests' TPOT)."""
    base = "base, LoRA off"
    rows = []
    for name in names:
        med = lambda f: statistics.median(f(run) for run in rounds)   # noqa: E731
        row = {"configuration": name, "tok_s": round(med(lambda r: r[name]["tok_s"]), 1),
               "tok_s_vs_base": round(med(lambda r: r[name]["tok_s"] / r[base]["tok_s"]), 3),
               "tok_per_cpu_s_vs_base": round(med(lambda r: r[name]["tok_per_cpu_s"] / r[base]["tok_per_cpu_s"]),
                                              3),
               "tpot_ms": round(med(lambda r: r[name]["tpot_ms"]), 1),
               "tpot_vs_base": round(med(lambda r: r[name]["tpot_ms"] / r[base]["tpot_ms"]), 3),
               "tok_s_vs_base_per_round": [round(r[name]["tok_s"] / r[base]["tok_s"], 3) for r in rounds]}
        if name.startswith("half base"):
            row["base_requests_tpot_vs_base_alone"] = round(
                med(lambda r: r[name]["base_tpot_ms"] / r[base]["tpot_ms"]), 3)
        rows.append(row)
    return rows


def table_lines(rows: List[dict]) -> List[str]:
    lines = ["| configuration | tok/s | vs base | per CPU s vs base | TPOT ms | vs base | tok/s vs base, per round |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        extra = (f" (base requests' TPOT {row['base_requests_tpot_vs_base_alone']}x base alone)"
                 if "base_requests_tpot_vs_base_alone" in row else "")
        lines.append(f"| {row['configuration']}{extra} | {row['tok_s']} | {row['tok_s_vs_base']}x | "
                     f"{row['tok_per_cpu_s_vs_base']}x | {row['tpot_ms']} | {row['tpot_vs_base']}x | "
                     f"{', '.join(str(v) for v in row['tok_s_vs_base_per_round'])} |")
    return lines


def compare_vllm(args, model: str, adapters: Dict[int, List]) -> Optional[dict]:
    """vLLM's CPU build beside our server, where it is installed (see the module docstring)."""
    from .peers import _executable
    python = _executable(args.vllm_python)
    if python is None:
        message = (f"vLLM: no Python at {args.vllm_python!r} (--vllm-python / BENCH_VLLM_PYTHON); "
                   "the side-by-side with vLLM's CPU build is skipped")
        print(message, flush=True)
        return {"skipped": message}
    from . import lora_peers
    return lora_peers.run(args, python, model, adapters)
