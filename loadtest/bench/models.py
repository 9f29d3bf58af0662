"""Model families: the step time of a decode batch, ours against Hugging
Face's forward on the same random checkpoint.

Per family (``loadtest.tiny_families``, the text decoder widened to
``--hidden`` and ``--layers``), ``--batch`` sequences of ``--context``
tokens are prefilled, then each decode step computes one token per
sequence: ours through the model runner over its paged cache (eager, SDPA
attention: the CPU serving path, ``--compile`` for the compiled one), HF's
as one ``forward`` of the batch with its own KV cache. The two take turns
(paired rounds), the same tokens each step; the table gives the median step
of each and HF / ours.
"""
import argparse
import os
import pathlib
import statistics
import time
from typing import Dict, List

import torch

from .common import add_common_args, set_threads, write_result

# One case per family (a family's RoPE variants change no step time), Llama first for scale.
FAMILY_CASES = ["llama", "qwen3", "gemma3_text", "gemma3", "gemma2", "phi3", "mistral3", "ministral3", "smollm3",
                "granite"]


def checkpoint(case: str, hidden: int, layers: int) -> pathlib.Path:
    """The case's random checkpoint at this shape, built once into the cache."""
    from loadtest.tiny_families import CASES, build_tiny_family
    from loadtest.tiny_model import build_tiny_llama
    from pagedbackend.config import cache_root
    path = cache_root() / "bench-families" / f"{case}-h{hidden}-l{layers}"
    if not (path / "config.json").exists():
        shape = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                     max_position_embeddings=4096)
        settings = CASES[case][1]
        if "sliding_window" in settings.get("text_config", settings):
            shape["sliding_window"] = 4096   # wider than any context here: every layer attends in full
        if case == "llama":
            build_tiny_llama(path, **shape)
        else:
            build_tiny_family(path, case, shape=shape)
    return path


def measure(case: str, folder, batch: int, context: int, steps: int, rounds: int,
            compile_step: bool = False) -> Dict[str, float]:
    """Median decode-step seconds of ours and HF's on ``folder`` (paired rounds)."""
    from loadtest.tiny_families import load_hf
    from pagedbackend.config import EngineConfig
    from pagedbackend.worker.model_runner import ModelRunner, SeqEntry
    from transformers import AutoModelForCausalLM, DynamicCache

    blocks = -(-(context + steps * rounds + 1) // 16)
    runner = ModelRunner(EngineConfig(model=str(folder), block_size=16, num_kv_blocks=batch * blocks + 1,
                                      dtype="float32", device="cpu", attention_backend="sdpa",
                                      compile=compile_step, max_model_len=context + steps * rounds + 1))
    hf = (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval() if case == "llama"
          else load_hf(folder, case))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, runner.vocab_size, (batch, context), generator=g)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(batch)]
    runner.execute_model([SeqEntry(p.tolist(), 0, t, True) for p, t in zip(prompts, tables)])
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        hf(input_ids=prompts, cache=cache, use_cache=True)
    ours: List[float] = []
    theirs: List[float] = []
    position = context
    for _ in range(rounds):
        tokens = torch.randint(3, runner.vocab_size, (steps, batch), generator=g)
        start = time.perf_counter()
        for i in range(steps):
            runner.execute_model([SeqEntry([int(t)], position + i, table, True)
                                  for t, table in zip(tokens[i], tables)])
        ours.append((time.perf_counter() - start) / steps)
        start = time.perf_counter()
        with torch.no_grad():
            for i in range(steps):
                hf(input_ids=tokens[i][:, None], cache=cache, use_cache=True,
                   position_ids=torch.full((batch, 1), position + i))
        theirs.append((time.perf_counter() - start) / steps)
        position += steps
    return {"ours_ms": 1000 * statistics.median(ours), "hf_ms": 1000 * statistics.median(theirs),
            "params_m": sum(p.numel() for p in hf.parameters()) / 1e6}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench models", description=__doc__)
    ap.add_argument("--cases", default=",".join(FAMILY_CASES), help="comma-separated families to run")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of each family's text decoder")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="sequences decoding at once")
    ap.add_argument("--context", type=int, default=128, help="tokens already cached per sequence")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (ours, then HF's)")
    ap.add_argument("--compile", action="store_true", help="our step compiled (torch.compile)")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.batch = 2, 3, 4
    set_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for case in args.cases.split(","):
        folder = checkpoint(case, args.hidden, args.layers)
        row = {"case": case, **measure(case, folder, args.batch, args.context, args.steps, args.rounds,
                                       args.compile)}
        row["hf_over_ours"] = row["hf_ms"] / row["ours_ms"]
        rows.append(row)
        print(f"{case:12s} {row['params_m']:6.1f} M params  ours {row['ours_ms']:7.2f} ms  "
              f"HF {row['hf_ms']:7.2f} ms  HF / ours {row['hf_over_ours']:.2f}", flush=True)
    settings = {k: getattr(args, k) for k in ("hidden", "layers", "batch", "context", "steps", "rounds",
                                              "compile", "threads")}
    print(f"wrote {write_result(args.out, 'models', {'settings': settings, 'rows': rows})}")
    return rows


if __name__ == "__main__":
    main()
