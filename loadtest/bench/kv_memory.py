"""kv_memory: what each ``kv_cache_dtype`` buys the whole engine (issue 56),
on SmolLM2-135M in float32 (docs/kv_cache_dtype.md):

- Capacity: one engine per dtype built with ``--kv-cache-bytes``; the blocks
  its block manager holds, and how many sequences of each context fit them
  (blocks // blocks of one sequence, ``ceil(context / block_size)``).
- Decode: ``--seqs`` sequences of each context decoding together, eager
  engine steps timed (scheduling, the forward with its decode attention over the
  cache, sampling, detokenising), one engine per dtype, each pool sized for
  the sequences (a float32 pool of ``--kv-cache-bytes`` may hold fewer).
  The engines take turns, ``--steps`` steps each, the order rotated round
  after round; tok/s = seqs x steps / seconds, and each round's ratio to
  ``auto``; medians over ``--rounds``. Greedy, EOS ignored.

The context is computed once: one prompt of random token ids (seeded)
prefilled in float32 by the model runner in chunks, as long as the longest
context. Each engine admits ``--seqs`` copies of it (prefix caching off:
blocks of their own), its one prefill step skipped (the runner's forward is
replaced for that step: zero logits, so the first token is id 0, not the
model's), and then every sequence's blocks receive that float32 K/V in the
engine's format (``kernels.kv_cache_dtype.encode``, the rule every KV write
follows; fp8 at scale 1, which is the default model's). A shorter context
reads the first blocks of the same prefill.

Contexts past the model's 8,192 positions run on a copy of its folder in the
cache (the files linked, config.json with ``max_position_embeddings``
raised): RoPE past its trained length makes the tokens meaningless, not the
step slower, so it times the same work.
"""
import argparse
import gc
import json
import statistics
import time
from typing import Dict, List, Sequence

import torch

from .common import add_common_args, built_once, set_threads, write_result

DTYPES = ("auto", "bfloat16", "int8", "fp8_e4m3")
CHUNK = 1024   # tokens a reference prefill step computes


def model_for(positions: int) -> str:
    """The default model's folder, or (past its positions) a copy of it in
    the cache whose config.json serves ``positions``, its other files linked."""
    from pagedbackend.config import cache_root
    from pagedbackend.models.default_model import prepare_default_model
    source = prepare_default_model()
    config = json.loads((source / "config.json").read_text())
    if positions <= config["max_position_embeddings"]:
        return str(source)

    def build(scratch):
        for item in source.iterdir():
            if item.name != "config.json":
                (scratch / item.name).symlink_to(item)
        (scratch / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}, indent=2))
    return str(built_once(cache_root() / f"bench-kv-memory-{source.name}-{positions}", build))


def settings(model: str, dtype: str) -> dict:
    """Every engine's: float32, eager steps, the cache in ``dtype``, prefix caching
    off (copies of one prompt hold blocks of their own), a prompt whole in one step."""
    return dict(model=model, dtype="float32", kv_cache_dtype=dtype, compile=False,
                enable_prefix_caching=False, tpot_target_s=0.0, long_prefill_token_threshold=0)


def make_prompt(length: int, seed: int) -> List[int]:
    """Random token ids (a context of the longest length; shorter ones are its beginning)."""
    return torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool_blocks(needed: int) -> int:
    """A pool with ``needed`` blocks usable for admission past the 1 % watermark, and two to spare."""
    return int((needed + 2) / 0.99) + 2


def capacity(model: str, dtypes: Sequence[str], kv_cache_bytes: int, contexts: Sequence[int]) -> Dict[str, dict]:
    """Per dtype: the blocks an engine built with ``kv_cache_bytes`` holds,
    their bytes, and the sequences of each context that fit them."""
    from pagedbackend import LLM
    rows = {}
    for dtype in dtypes:
        llm = LLM(**settings(model, dtype), kv_cache_bytes=kv_cache_bytes, max_model_len=min(contexts))
        manager, runner = llm.engine.block_manager, llm.engine.runner
        blocks, size = manager.num_total_blocks, runner.block_size
        assert blocks == runner.num_kv_blocks, "the block manager and the cache disagree"
        rows[dtype] = {"blocks": blocks, "tokens": blocks * size, "block_bytes": runner.kv_bytes_per_block,
                       "cache_dtype": str(runner.kv_cache.dtype),
                       "blocks_per_seq": {str(c): -(-c // size) for c in contexts},
                       "max_seqs": {str(c): blocks // -(-c // size) for c in contexts}}
        llm.shutdown()
        del llm, manager, runner
        gc.collect()
    return rows


def reference_kv(model: str, prompt: List[int]) -> tuple:
    """The float32 K/V of ``prompt`` ``[2, layers, blocks, block_size, kv_heads, head_dim]``,
    computed by an engine's runner in chunks of ``CHUNK`` (each reading the
    earlier ones from the cache), and the seconds it took."""
    from pagedbackend import LLM
    from pagedbackend.worker import SeqEntry
    n = -(-len(prompt) // 16)
    llm = LLM(**settings(model, "auto"), block_size=16, num_kv_blocks=pool_blocks(n + 1),
              max_model_len=len(prompt) + 1)
    runner = llm.engine.runner
    table = list(range(1, n + 1))   # block 0: the warm-ups' slot
    start = time.perf_counter()
    for pos in range(0, len(prompt), CHUNK):
        runner.execute_model([SeqEntry(prompt[pos:pos + CHUNK], pos, table, need_logits=False)])
    seconds = time.perf_counter() - start
    kv = runner.kv_cache[:, :, 1:n + 1].clone()
    llm.shutdown()
    del llm, runner
    gc.collect()
    return kv, seconds


def decode_engine(model: str, dtype: str, prompt: List[int], seqs: int, max_tokens: int, kv: torch.Tensor):
    """An engine whose ``seqs`` copies of ``prompt`` hold ``kv`` (float32
    rows) in its format, each with its first token: ready to decode."""
    from pagedbackend import LLM, SamplingParams
    from pagedbackend.kernels.kv_cache_dtype import encode
    length = len(prompt) + max_tokens
    llm = LLM(**settings(model, dtype), block_size=16, max_model_len=length,
              num_kv_blocks=pool_blocks(seqs * -(-length // 16)), max_num_seqs=seqs,
              max_num_batched_tokens=max(2048, seqs * len(prompt)))
    engine, runner = llm.engine, llm.engine.runner
    assert runner.kv_scales is None, "fp8 scales other than 1: the rows would need k / k_scale"
    tables = {}

    def skipped(entries, *rest):   # the prefill step: blocks allocated, nothing computed
        for entry in entries:
            assert entry.start_pos == 0 and len(entry.token_ids) == len(prompt), "a prompt split over steps"
            tables[entry.group.request_id] = list(entry.block_table)
        return torch.zeros(sum(e.num_logit_rows for e in entries), runner.vocab_size)

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"seq-{i}", prompt, params)
    runner.execute_model = skipped
    try:
        engine.step()
    finally:
        del runner.execute_model   # the runner's own method again
    assert len(tables) == seqs and engine.stats.last_step_tokens == seqs * len(prompt)
    n = -(-len(prompt) // 16)
    with torch.inference_mode():
        for table in tables.values():
            index = torch.tensor(table[:n])
            for kv_index in range(2):
                for slot in range(kv.shape[1]):   # a layer at a time: one float32 layer in flight
                    runner.kv_cache[kv_index, slot, index] = encode(kv[kv_index, slot, :n], runner.kv_cache.dtype)
    return llm


def timed_steps(llm, steps: int, seqs: int) -> float:
    """Seconds of ``steps`` engine steps, each decoding one token of every sequence."""
    engine = llm.engine
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    assert engine.stats.last_step_tokens == seqs, "a step that was not every sequence's decode"
    return seconds


def bench_decode(model: str, dtypes: Sequence[str], context: int, seqs: int, steps: int, rounds: int,
                 kv: torch.Tensor, prompt: List[int]) -> List[dict]:
    """Decode tok/s of ``seqs`` sequences of ``context`` per dtype, the engines by turns."""
    max_tokens = 1 + steps * (rounds + 1) + 4   # the skipped prefill's token, a warm-up, the rounds
    engines = {d: decode_engine(model, d, prompt[:context], seqs, max_tokens, kv) for d in dtypes}
    try:
        for llm in engines.values():
            timed_steps(llm, steps, seqs)   # warm-up: the first steps' one-off costs
        tok_s: Dict[str, List[float]] = {d: [] for d in dtypes}
        for r in range(rounds):
            for d in dtypes[r % len(dtypes):] + dtypes[:r % len(dtypes)]:
                tok_s[d].append(seqs * steps / timed_steps(engines[d], steps, seqs))
        blocks = {d: llm.engine.block_manager.num_total_blocks for d, llm in engines.items()}
        tokens = {d: list(llm.engine.groups["seq-0"].seqs[0].output_token_ids) for d, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.shutdown()
        engines.clear()
        gc.collect()
    base = tok_s.get("auto", tok_s[dtypes[0]])
    return [{"context": context, "kv_cache_dtype": d, "seqs": seqs, "steps": steps,
             "tok_s": statistics.median(tok_s[d]), "tok_s_rounds": tok_s[d],
             "vs_auto": statistics.median(a / b for a, b in zip(tok_s[d], base)),
             "vs_auto_rounds": [a / b for a, b in zip(tok_s[d], base)], "pool_blocks": blocks[d],
             "tokens": tokens[d]}   # the first sequence's: id 0 (the skipped prefill's), then greedy
            for d in dtypes]


def table(result: dict) -> str:
    """The figures as a markdown table."""
    gib = result["kv_cache_bytes"] / 2 ** 30
    lines = [f"| context | kv_cache_dtype | blocks in {gib:g} GiB | sequences that fit | decode tok/s "
             f"({result['seqs']} sequences) | vs auto (paired) |", "| --- | --- | --- | --- | --- | --- |"]
    for row in result["decode"]:
        cap = result["capacity"][row["kv_cache_dtype"]]
        context = str(row["context"])
        lines.append(f"| {row['context']:,} | `{row['kv_cache_dtype']}` | {cap['blocks']:,} "
                     f"| {cap['max_seqs'][context]} | {row['tok_s']:.2f} | {row['vs_auto']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench kv_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384", help="context lengths (tokens)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="kv_cache_dtypes (auto first: the ratios' base)")
    ap.add_argument("--seqs", type=int, default=4, help="sequences decoding together")
    ap.add_argument("--steps", type=int, default=8, help="engine steps an engine takes in its turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 * 2 ** 30, help="the capacity part's budget")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.seqs, args.steps, args.rounds, args.kv_cache_bytes = "256", 2, 2, 1, 32 * 2 ** 20
    set_threads(args.threads)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    dtypes = tuple(args.dtypes.split(","))
    model = model_for(contexts[-1] + 1 + args.steps * (args.rounds + 1) + 4)
    result = {"model": model, "dtype": "float32", "threads": torch.get_num_threads(), "seqs": args.seqs,
              "steps": args.steps, "rounds": args.rounds, "kv_cache_bytes": args.kv_cache_bytes,
              "compiled_step": False, "contexts": contexts}
    result["capacity"] = capacity(model, dtypes, args.kv_cache_bytes, contexts)
    for d, row in result["capacity"].items():
        print(f"{d}: {row['blocks']:,} blocks of {row['block_bytes']:,} bytes ({row['tokens']:,} tokens) in "
              f"{args.kv_cache_bytes:,} bytes; sequences: {row['max_seqs']}", flush=True)
    prompt = make_prompt(contexts[-1], args.seed)
    kv, seconds = reference_kv(model, prompt)
    result["reference_prefill"] = {"tokens": len(prompt), "seconds": seconds, "chunk": CHUNK}
    print(f"reference prefill: {len(prompt):,} tokens in {seconds:.1f} s", flush=True)
    result["decode"] = []
    for context in contexts:
        rows = bench_decode(model, dtypes, context, args.seqs, args.steps, args.rounds, kv, prompt)
        result["decode"] += rows
        for row in rows:
            print(f"context {context:,}: {row['kv_cache_dtype']} {row['tok_s']:.2f} tok/s "
                  f"({row['vs_auto']:.2f}x auto)", flush=True)
    print(table(result))
    write_result(args.out, "kv_memory", result)
    return result


if __name__ == "__main__":
    main()
