"""kv_cache_dtype: what a bfloat16, int8 or fp8 (e4m3, e5m2) KV cache costs and saves against
the model's float32 one, on SmolLM2-135M (docs/kv_cache_dtype.md).

- ``kernel``: the C decode kernel alone (``kernels/csrc/paged_decode.c``)
  over L layers' caches in turn (read from memory, as a step reads them) for
  N sequences of one context length, per cache dtype, interleaved round by
  round; the same queries, caches encoded from the same float32 values.
  ``--against REV``: the kernel of ``paged_decode.c`` at git revision REV
  runs too, interleaved with this tree's, its outputs checked equal, and its
  time over this tree's reported per dtype.
- ``quality``: the default model, dtype float32, greedy: how many of 32
  prompts keep all of their first 32 tokens, and how many of the 1,024
  tokens are equal (the prompts, shorter than a chunk, are prefilled
  whole); and the perplexity of a text of its own (a sampled continuation
  by the float32 cache, 512 tokens) scored as prompt log-probabilities in
  chunks of 32, so that each chunk reads the earlier ones through the cache.
  ``--model`` runs it on a tiny random checkpoint of a family instead
  (``loadtest.tiny_families.CASES`` or ``loadtest.moe_model.TINY_MOE``,
  seed 0): e.g. ``gemma3_text`` (sliding windows of 16 beside full layers,
  so every sequence runs past its window) or ``qwen3_moe`` (experts); its
  text is as long as the checkpoint's positions allow.
- ``capacity``: the tokens ``kv_cache_bytes`` holds per dtype.
- ``offload`` (not in the default parts): time to first token of a prompt
  whose ~4,000-token prefix is in the pool, in the disk tier
  (``kv_offload_dir``; the same engine after another prompt evicted it, and
  a fresh engine on the folder), or recomputed (no tier); medians of
  ``--rounds``, eager steps, the model's default dtype and cache. The files
  are read back from the OS page cache as much as it holds them.
"""
import argparse
import math
import tempfile
from typing import List

import torch

from .common import add_common_args, set_threads, write_result
from .cpu_kernels import interleaved

HEADS, KV_HEADS, DIM, LAYERS_ALL = 9, 3, 64, 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QUALITY = ("auto", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")

# 32 prompts of the kinds the served model gets: facts, code, lists, chat, stories.
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Water boils at", "A haiku about autumn:",
    "The three primary colours are", "import numpy as np\n", "Once upon a time,", "The speed of light is",
    "List three fruits:", "SELECT name FROM users WHERE", "The largest planet in our solar system",
    "How do I reverse a list in Python?", "Photosynthesis is the process", "Dear hiring manager,",
    "The French Revolution began in", "class Stack:\n    def __init__(self):", "My favourite season is",
    "To make a cup of tea, first", "The mitochondria is", "Translate to Spanish: good morning",
    "Here is a short poem about the sea:", "The main causes of inflation are", "In 1969, astronauts",
    "for i in range(10):", "The recipe calls for two cups of", "Explain recursion to a child.",
    "The stock market fell today because", "A good night's sleep helps", "#include <stdio.h>\nint main() {",
    "The Great Wall of China", "Three tips for learning a language:", "The weather tomorrow will be",
]
assert len(PROMPTS) == 32 and len(set(PROMPTS)) == 32


def kernel_at(rev: str):
    """``paged_decode_kv`` of ``paged_decode.c`` as of git revision ``rev``, declared as this tree's."""
    from pagedbackend.kernels import sdpa_attention as sa
    from .cpu_kernels import source_at
    function, here = source_at(rev, "paged_decode").paged_decode_kv, sa.native_decode()
    function.argtypes, function.restype = here.argtypes, here.restype
    return function


def bench_kernel(contexts: List[int], seqs: int, layers: int, rounds: int, seed: int,
                 against: str = "") -> List[dict]:
    """``against``: a git revision whose kernel runs too, interleaved (each
    dtype's ``<dtype> @rev`` beside it; ``_x_rev``: its time over this tree's)."""
    from pagedbackend.kernels import sdpa_attention as sa
    from pagedbackend.kernels.kv_cache_dtype import encode
    old, here = (kernel_at(against), sa.native_decode()) if against else (None, None)
    block_size, rows = 16, []
    for context in contexts:
        gen = torch.Generator().manual_seed(seed + context)
        lens = torch.full((seqs,), context, dtype=torch.int32)
        max_blocks = -(-context // block_size)
        num_blocks = seqs * max_blocks
        tables = torch.randperm(num_blocks, generator=gen).view(seqs, max_blocks).to(torch.int32)
        plan = sa.plan_sdpa_attention(torch.arange(seqs + 1, dtype=torch.int32), lens, block_tables=tables,
                                      slot_mapping=torch.zeros(seqs, dtype=torch.long), block_size=block_size,
                                      num_heads=HEADS, num_kv_heads=KV_HEADS)
        q = torch.randn(seqs, HEADS, DIM, generator=gen)
        caches = {name: [] for name in DTYPES}
        for _ in range(layers):   # one layer's float32 values, then each encoding of them
            k, v = (torch.randn(num_blocks, block_size, KV_HEADS, DIM, generator=gen) for _ in range(2))
            for name, dtype in DTYPES.items():
                caches[name].append((encode(k, dtype), encode(v, dtype)))
            del k, v

        def run(name, function=None):
            if function is not None:   # the revision's kernel in the tree's place
                sa._natives["paged_decode_kv"] = function
            try:
                return [sa._decodes(q, k, v, plan, DIM ** -0.5) for k, v in caches[name]]
            finally:
                if function is not None:
                    sa._natives["paged_decode_kv"] = here

        timed = {name: (lambda n=name: run(n)) for name in DTYPES}
        if old is not None:
            timed.update({f"{name} @rev": (lambda n=name: run(n, old)) for name in DTYPES})
        medians = interleaved(timed, rounds)
        reference = run("float32")
        row = {"context": context, "seqs": seqs, "layers": layers}
        for name in DTYPES:
            row[f"{name}_ms"] = medians[name] * 1e3
            row[f"{name}_speedup"] = medians["float32"] / medians[name]
            if old is not None:
                row[f"{name}_x_rev"] = medians[f"{name} @rev"] / medians[name]
                assert all(torch.equal(a, b) for a, b in zip(run(name, old), run(name))), \
                    f"--against {against}: its {name} decode differs from this tree's"
            row[f"{name}_max_abs_error"] = max((a - b).abs().max().item() for a, b in zip(run(name), reference))
            row[f"{name}_cache_mb"] = sum(k.nbytes + v.nbytes for k, v in caches[name]) / 2 ** 20
        rows.append(row)
        del caches
    return rows


def tiny_checkpoint(family: str, folder) -> str:
    """A tiny random checkpoint of ``family`` (seed 0) written into ``folder``."""
    from loadtest.moe_model import TINY_MOE, build_tiny_moe
    from loadtest.tiny_families import CASES, build_tiny_family
    if family in TINY_MOE:
        return str(build_tiny_moe(folder, family))
    if family in CASES:
        return str(build_tiny_family(folder, family))
    raise ValueError(f"--model must be default or a tiny family ({', '.join([*CASES, *TINY_MOE])}); got {family!r}")


def bench_quality(prompts: List[str], max_tokens: int, text_tokens: int, names=QUALITY,
                  model: str = "default") -> dict:
    """``model``: "default" or a model folder (a tiny family's: ``tiny_checkpoint``)."""
    from pagedbackend import LLM, SamplingParams
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    result, tokens = {}, {}
    text = None
    for name in ("auto",) + tuple(n for n in names if n != "auto"):
        kv, _, calc = name.partition(":")   # "fp8_e4m3:calc": calculate_kv_scales (models/fp8_scales.py)
        with LLM(model=model, compile=False, dtype="float32", kv_cache_dtype=kv, num_kv_blocks=128,
                 calculate_kv_scales=calc == "calc",
                 long_prefill_token_threshold=32) as llm:   # prompts of 32 prompts' size are never split
            # The text: as many tokens as asked, within the checkpoint's positions.
            text_tokens = min(text_tokens, llm.engine.runner.max_model_len - 16)
            outs = llm.generate(prompts, greedy)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            longest = max(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
            if text is None:   # the float32 cache's own continuation: a text the model finds likely
                seed = SamplingParams(max_tokens=text_tokens, temperature=0.8, seed=1, ignore_eos=True)
                text = llm.generate(["Write a long story about a lighthouse keeper."], seed)[0]
                text = text.prompt_token_ids + text.outputs[0].token_ids
            scored = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
            logprobs = [entry[tok].logprob for entry, tok in zip(scored.prompt_logprobs[1:], text[1:])]
            result[name] = {"perplexity": math.exp(-sum(logprobs) / len(logprobs)),
                            "median_margin": _median_margin(outs)}
    for name in result:
        pairs = list(zip(tokens[name], tokens["auto"]))
        result[name].update({"prompts_equal": sum(a == b for a, b in pairs), "prompts": len(pairs),
                             "tokens_equal": sum(x == y for a, b in pairs for x, y in zip(a, b)),
                             "tokens": sum(len(b) for _, b in pairs)})
        result[name]["perplexity_change_pct"] = 100 * (result[name]["perplexity"] / result["auto"]["perplexity"] - 1)
    result["text_tokens"] = len(text)
    result["longest_sequence"] = longest   # past a windowed model's window, or its windows serve nothing
    return result


def _median_margin(outs) -> float:
    """The median, over every greedy step, of the log-probability gap between
    the two likeliest tokens: how near the ties are that a cache's rounding can turn."""
    import statistics
    gaps = []
    for out in outs:
        for step in out.outputs[0].logprobs:
            top = sorted((entry.logprob for entry in step.values()), reverse=True)
            gaps.append(top[0] - top[1])
    return statistics.median(gaps)


def bench_offload(prefix_len: int, rounds: int, seed: int) -> dict:
    import statistics
    import tempfile
    import time
    from pagedbackend import LLM, SamplingParams
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    # Two prompts that each fill most of the pool: running one evicts the other.
    prompts = [torch.randint(100, 40000, (prefix_len + 7,), generator=gen).tolist() for _ in range(2)]
    blocks = -(-(prefix_len + 8) // 16) + 8
    settings = dict(model="default", compile=False, num_kv_blocks=blocks, max_model_len=16 * blocks)

    def ttft(llm, prompt):
        start = time.perf_counter()
        llm.generate([prompt], first)
        return time.perf_counter() - start

    times = {"pool": [], "disk": [], "disk_fresh_engine": [], "recomputed": []}
    with tempfile.TemporaryDirectory(prefix="kv_tier_") as folder:
        with LLM(kv_offload_dir=folder, kv_offloading_size=4.0, **settings) as llm:
            for prompt in prompts:   # both computed once; the second evicts the first to disk
                llm.generate([prompt], first)
            for i in range(rounds):
                prompt = prompts[i % 2]   # on disk: the other one evicted it
                assert llm.engine.kv_tier.flush()
                loaded = llm.engine.get_stats().kv_offload_loaded
                times["disk"].append(ttft(llm, prompt))
                assert llm.engine.get_stats().kv_offload_loaded > loaded, "the prefix did not come from disk"
                times["pool"].append(ttft(llm, prompt))
            stats = llm.engine.get_stats()
        for _ in range(rounds):
            with LLM(kv_offload_dir=folder, kv_offloading_size=4.0, **settings) as fresh:
                times["disk_fresh_engine"].append(ttft(fresh, prompts[0]))
                assert fresh.engine.get_stats().kv_offload_loaded > 0
    with LLM(**settings) as plain:
        for i in range(rounds + 1):
            seconds = ttft(plain, prompts[i % 2])   # the other prompt evicted it: computed again
            if i:
                times["recomputed"].append(seconds)
    result = {name: {"median_s": statistics.median(t), "runs_s": t} for name, t in times.items()}
    result.update(prefix_tokens=prefix_len, blocks_on_disk_per_prompt=prefix_len // 16,
                  block_bytes=stats.kv_offload_bytes // max(1, stats.kv_offload_saved), saved=stats.kv_offload_saved)
    return result


def capacity(kv_cache_bytes: int) -> dict:
    from types import SimpleNamespace
    from pagedbackend.worker.loader import kv_block_bytes
    args = SimpleNamespace(num_layers=LAYERS_ALL, head_dim=DIM)
    return {name: kv_cache_bytes // kv_block_bytes(args, 16, KV_HEADS, dtype) * 16 for name, dtype in DTYPES.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench kv_cache_dtype", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="kernel,quality,capacity")
    ap.add_argument("--contexts", default="4096,16384", help="context lengths of the kernel part")
    ap.add_argument("--seqs", type=int, default=4, help="sequences of the kernel part")
    ap.add_argument("--layers", type=int, default=4, help="layers' caches the kernel part walks in turn")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quality-dtypes", default=",".join(QUALITY),
                    help="kv_cache_dtypes of the quality part (fp8_e4m3:calc: with calculate_kv_scales)")
    ap.add_argument("--model", default="default",
                    help="the quality part's model: default, or a tiny random family (e.g. gemma3_text, qwen3_moe)")
    ap.add_argument("--prefix-tokens", type=int, default=4000, help="the prefix of the offload part")
    ap.add_argument("--against", metavar="REV", default="",
                    help="the kernel part also times paged_decode.c at git revision REV, interleaved")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.seqs, args.layers, args.rounds = "512", 2, 2, 3
    set_threads(args.threads)
    parts = args.parts.split(",")
    result = {"threads": torch.get_num_threads()}
    if "kernel" in parts:
        result["kernel"] = bench_kernel([int(c) for c in args.contexts.split(",")], args.seqs, args.layers,
                                        args.rounds, args.seed, args.against)
        for row in result["kernel"]:
            print(f"context {row['context']:>6} x {row['seqs']} seqs x {row['layers']} layers: " + ", ".join(
                f"{n} {row[f'{n}_ms']:.2f} ms ({row[f'{n}_speedup']:.2f}x"
                + (f"; @{args.against} {row[f'{n}_x_rev']:.2f}x this tree's time" if args.against else "") + ")"
                for n in DTYPES))
    if "quality" in parts:
        quick = args.quick
        with tempfile.TemporaryDirectory(prefix="kv_quality_") as folder:
            model = "default" if args.model == "default" else tiny_checkpoint(args.model, folder)
            result["quality"] = bench_quality(PROMPTS[:4] if quick else PROMPTS, 8 if quick else 32,
                                              64 if quick else 512, tuple(args.quality_dtypes.split(",")), model)
        result["model"] = args.model
        for name, row in result["quality"].items():
            if isinstance(row, dict):
                print(f"{name}: {row['prompts_equal']}/{row['prompts']} prompts, {row['tokens_equal']}/"
                      f"{row['tokens']} tokens equal; perplexity {row['perplexity']:.4f} "
                      f"({row['perplexity_change_pct']:+.2f} %); median top-2 gap {row['median_margin']:.3f}")
    if "offload" in parts:
        result["offload"] = bench_offload(512 if args.quick else args.prefix_tokens, args.rounds, args.seed)
        print(f"TTFT of a {result['offload']['prefix_tokens']}-token prefix (medians): " + ", ".join(
            f"{name} {row['median_s'] * 1e3:.0f} ms" for name, row in result["offload"].items()
            if isinstance(row, dict)))
    if "capacity" in parts:
        result["capacity_tokens_256mib"] = capacity(256 * 2 ** 20)
        print("tokens in 256 MiB:", result["capacity_tokens_256mib"])
    write_result(args.out, "kv_cache_dtype", result)
    return result


if __name__ == "__main__":
    main()
