"""Embeddings on this CPU: sentences/s for a batch of mixed-length inputs and
the latency of single requests, our engine (``LLM.embed``) against
sentence-transformers' ``SentenceTransformer.encode`` on the same random
checkpoint, and vLLM's CPU build where ``--vllm-python`` /
``BENCH_VLLM_PYTHON`` names its Python (reported as not run otherwise).

The checkpoint is written once under the cache, with the
sentence-transformers files that name its pooler: ``bert`` is BERT-base
shaped (gte-base / bge-base: hidden 768, 12 layers, CLS pooling) and
``qwen3`` a Qwen3 decoder with last-token pooling (Qwen3-Embedding shaped,
hidden 1024, fewer layers than its 28 so that a round takes seconds).
``--quick`` shrinks either to a few layers of width 128.

Our engine runs once per ``--dtypes`` entry (float32, as sentence-transformers
runs, and bfloat16, whose products use AVX512-BF16 / AMX where the CPU has
them); each row says how far its embeddings are from sentence-transformers'.
Every system embeds the same seeded texts (``--inputs`` of 8 to 128 words),
float32, the same torch threads, in paired rounds: each round runs every
system once, in alternating order, on the batch and then on ``--singles``
texts one request at a time; the table gives each figure's median over
rounds and the median of the per-round ratios. sentence-transformers encodes
in its default batches of 32 (it sorts the inputs by length first); ours
takes the whole list at once and schedules it as it schedules prompts.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np
import torch

from .common import add_common_args, built_once, set_threads, write_result

SHAPES = {
    "bert": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "qwen3": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=3072, head_dim=64),
}
QUICK = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)

_VLLM_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM
job = json.load(open(sys.argv[1]))
# gpu_memory_utilization is the share of host memory the CPU build reserves
# (0.92 by default, refused when a little less is free; embeddings keep no KV)
llm = LLM(model=job["model"], runner="pooling", dtype="float32", seed=0, gpu_memory_utilization=0.5)
llm.embed(job["texts"][:4], use_tqdm=False)
rounds = []
for _ in range(job["rounds"]):
    start = time.perf_counter(); llm.embed(job["texts"], use_tqdm=False); batch = time.perf_counter() - start
    singles = []
    for text in job["singles"]:
        start = time.perf_counter(); llm.embed([text], use_tqdm=False); singles.append(time.perf_counter() - start)
    rounds.append({"batch_s": batch, "singles_s": singles})
print(json.dumps({"rounds": rounds}), flush=True)
"""


def checkpoint(kind: str, quick: bool) -> pathlib.Path:
    """The benchmark's random checkpoint of ``kind``, written once under the cache."""
    from pagedbackend.config import cache_root
    shape = dict(SHAPES[kind], **QUICK) if quick else SHAPES[kind]
    if kind == "qwen3" and quick:
        shape = dict(shape, num_key_value_heads=2, head_dim=32)
    name = f"bench-embed-{kind}-" + "-".join(f"{v}" for v in shape.values())
    return built_once(cache_root() / name, lambda scratch: _build(scratch, kind, shape))


def _build(path: pathlib.Path, kind: str, shape: dict) -> None:
    from loadtest.tiny_embedder import write_sentence_transformers_files
    if kind == "bert":
        from transformers import BertConfig, BertModel
        from loadtest.tiny_encoder import write_tokenizer
        torch.manual_seed(0)
        model = BertModel(BertConfig(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, **shape))
        model.eval().save_pretrained(path)
        write_tokenizer(path)
        write_sentence_transformers_files(path, "CLS", True)
    else:
        from loadtest.tiny_families import build_tiny_family
        build_tiny_family(path, "qwen3", std=0.02, shape=shape, use_sliding_window=False, sliding_window=None)
        write_sentence_transformers_files(path, "LAST", True)


def texts(count: int, seed: int) -> List[str]:
    """``count`` seeded texts of 8 to 128 words from the encoders' vocabulary."""
    from loadtest.tiny_encoder import WORDS
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 129)))) for _ in range(count)]


class Ours:
    def __init__(self, folder: pathlib.Path, dtype: str):
        from pagedbackend import LLM
        self.name = "ours (LLM.embed)" if dtype == "float32" else f"ours (LLM.embed, dtype={dtype})"
        self.llm = LLM(model=str(folder), runner="pooling", enable_prefix_caching=False, dtype=dtype)

    def embed(self, batch: List[str]) -> torch.Tensor:
        return torch.tensor([o.outputs.embedding for o in self.llm.embed(batch)])

    def close(self) -> None:
        self.llm.shutdown()


class SentenceTransformers:
    name = "sentence-transformers (encode, batches of 32)"

    def __init__(self, folder: pathlib.Path):
        from sentence_transformers import SentenceTransformer
        self.model = SentenceTransformer(str(folder), device="cpu")

    def embed(self, batch: List[str]) -> torch.Tensor:
        return self.model.encode(batch, batch_size=32, convert_to_tensor=True)

    def close(self) -> None:
        pass


def timed_round(system, batch: List[str], singles: List[str]) -> Dict:
    start = time.perf_counter()
    vectors = system.embed(batch)
    batch_s = time.perf_counter() - start
    single_s = []
    for text in singles:
        start = time.perf_counter()
        system.embed([text])
        single_s.append(time.perf_counter() - start)
    return {"batch_s": batch_s, "singles_s": single_s, "vectors": vectors}


def run_vllm(python: str, folder: pathlib.Path, batch: List[str], singles: List[str], rounds: int) -> Dict:
    with tempfile.TemporaryDirectory() as work:
        job, script = pathlib.Path(work) / "job.json", pathlib.Path(work) / "vllm_embed.py"
        job.write_text(json.dumps({"model": str(folder), "texts": batch, "singles": singles, "rounds": rounds}))
        script.write_text(_VLLM_SCRIPT)
        done = subprocess.run([python, str(script), str(job)], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"error": f"vLLM exited {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(rounds: List[Dict], inputs: int) -> Dict:
    per_s = [inputs / r["batch_s"] for r in rounds]
    p50 = [1000 * statistics.median(r["singles_s"]) for r in rounds]
    return {"sentences_per_s": statistics.median(per_s), "sentences_per_s_rounds": per_s,
            "single_p50_ms": statistics.median(p50), "single_p50_ms_rounds": p50}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench embed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, threads=os.cpu_count() or 1)
    ap.add_argument("--model", choices=sorted(SHAPES), default="bert")
    ap.add_argument("--inputs", type=int, default=256, help="texts in the batch")
    ap.add_argument("--singles", type=int, default=32, help="texts sent one request at a time")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="our engine's dtypes, one row each (sentence-transformers runs float32)")
    ap.add_argument("--vllm-python", default=os.environ.get("BENCH_VLLM_PYTHON"),
                    help="a Python with vLLM's CPU build installed")
    args = ap.parse_args(argv)
    if args.quick:
        args.inputs, args.singles, args.rounds = min(args.inputs, 32), min(args.singles, 4), min(args.rounds, 1)
    set_threads(args.threads)
    folder = checkpoint(args.model, args.quick)
    batch, singles = texts(args.inputs, args.seed), texts(args.singles, args.seed + 1)
    reference = SentenceTransformers(folder)
    systems = [Ours(folder, dtype) for dtype in args.dtypes.split(",")] + [reference]
    for system in systems:   # warm-up: first-call costs are not the steady state
        system.embed(batch[:8])
    results = {s.name: [] for s in systems}
    for round_index in range(args.rounds):
        for system in systems if round_index % 2 == 0 else systems[::-1]:
            results[system.name].append(timed_round(system, batch, singles))
    for system in systems:
        system.close()
    st = results[reference.name]
    table, ratios = {}, {}
    for name, rounds in results.items():
        table[name] = summary(rounds, args.inputs)
        table[name]["max_cosine_distance_to_st"] = max(
            float((1 - torch.nn.functional.cosine_similarity(r["vectors"].double(), s["vectors"].double())).max())
            for r, s in zip(rounds, st))
        ratios[name] = {"sentences_per_s": statistics.median(s["batch_s"] / r["batch_s"] for r, s in zip(rounds, st)),
                        "single_p50_ms": statistics.median(statistics.median(r["singles_s"]) /
                                                           statistics.median(s["singles_s"]) for r, s in zip(rounds, st))}
    if args.vllm_python:
        vllm = run_vllm(args.vllm_python, folder, batch, singles, args.rounds)   # a process of its own, after ours
        row = table["vLLM CPU build (LLM.embed)"] = vllm if "error" in vllm else summary(vllm["rounds"], args.inputs)
        if "error" not in row:   # not paired: the ratio of medians
            row["max_cosine_distance_to_st"] = float("nan")
            ratios["vLLM CPU build (LLM.embed)"] = {
                "sentences_per_s": row["sentences_per_s"] / table[reference.name]["sentences_per_s"],
                "single_p50_ms": row["single_p50_ms"] / table[reference.name]["single_p50_ms"]}
    else:
        table["vLLM CPU build (LLM.embed)"] = {"error": "not run: no --vllm-python / BENCH_VLLM_PYTHON given"}
    config = json.loads((folder / "config.json").read_text())
    print(f"\n## embed: {args.model} ({config['hidden_size']} wide, {config['num_hidden_layers']} layers), "
          f"{args.inputs} texts of 8-128 words, {args.singles} single requests, {args.rounds} rounds, "
          f"{args.threads} threads")
    print("| system | sentences/s (batch) | x sentence-transformers | single request p50 ms | x sentence-transformers "
          "| largest cosine distance to sentence-transformers |\n| --- | --- | --- | --- | --- | --- |")
    for name, row in table.items():
        if "error" in row:
            print(f"| {name} | {row['error']} | | | | |")
        else:
            print(f"| {name} | {row['sentences_per_s']:.1f} | {ratios[name]['sentences_per_s']:.2f}x "
                  f"| {row['single_p50_ms']:.1f} | {ratios[name]['single_p50_ms']:.2f}x "
                  f"| {row['max_cosine_distance_to_st']:.1e} |")
    print("(x sentence-transformers: the median of the per-round ratios; for the single-request time, below 1 is faster)")
    write_result(args.out, "embed", {"model": args.model, "config": {k: config[k] for k in SHAPES["bert"]},
                                     "inputs": args.inputs, "singles": args.singles, "rounds": args.rounds,
                                     "threads": args.threads, "systems": table, "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
