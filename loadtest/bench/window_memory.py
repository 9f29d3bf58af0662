"""KV memory of a sliding-window model, with and without giving back the
blocks that left the window (``python -m loadtest.bench memory --model
gemma3-like``).

A Gemma-3-shaped config: of every six layers five attend to the last 1,024
positions and one to everything. A tiny random checkpoint of that shape
(a Qwen2-class config with ``layer_types``, saved by transformers) runs
through the engine twice per context length: with KV groups (windowed
layers give blocks back) and with ``disable_hybrid_kv_cache_manager`` (one
table for every layer, every block kept: full allocation). Two requests of
``context - new_tokens`` prompt tokens each generate ``new_tokens`` greedy
tokens (their prompts go in 2,048-token chunks side by side, so they stay
abreast); after every step the pool's used blocks are read, and the figures
are those of the step with the most live tokens (every sequence within a
token of the full context).

Reported per context: KV bytes per live token both ways, the paper's
arithmetic for full allocation (2 x layers x KV heads x head size x bytes
per position), and the blocks held as a fraction of what full attention
holds (counted in one-layer blocks, since a KV group's block holds fewer
layers than a block of one table for every layer). Every run also checks
that nothing leaks (every block back in the pool at the end) and, up to
``--hf-max-context``, that the tokens equal Hugging Face's greedy tokens.
"""
import pathlib
import time
from typing import Dict, List

from pagedbackend.config import cache_root

WINDOW = 1024
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
GEMMA3_LIKE = dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                   layer_types=LAYERS, num_hidden_layers=len(LAYERS), hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                   max_position_embeddings=40960, tie_word_embeddings=True)
BLOCK_SIZE = 16


def gemma3_like_model() -> pathlib.Path:
    """The tiny Gemma-3-shaped checkpoint, built once in the cache."""
    from loadtest.tiny_model import build_tiny_llama
    path = cache_root() / "bench-gemma3-like"
    if not (path / "config.json").exists():
        build_tiny_llama(path, seed=7, **GEMMA3_LIKE)
    return path


def kv_bytes_per_position() -> int:
    """The paper's arithmetic: K and V of every layer for one position (fp32)."""
    return 2 * GEMMA3_LIKE["num_hidden_layers"] * GEMMA3_LIKE["num_key_value_heads"] * GEMMA3_LIKE["head_dim"] * 4


def run_context(model: pathlib.Path, context: int, free: bool, prompts: List[List[int]],
                new_tokens: int) -> Dict:
    """Generate with the engine; the pool's use at the last step, and the tokens."""
    from pagedbackend import SamplingParams
    from pagedbackend.config import EngineConfig
    from pagedbackend.engine.llm import merge_delta
    from pagedbackend.engine.llm_engine import LLMEngine
    budget = int(1.2 * len(prompts) * context * kv_bytes_per_position()) + (1 << 20)
    engine = LLMEngine(EngineConfig(
        model=str(model), block_size=BLOCK_SIZE, kv_cache_bytes=budget, max_model_len=context,
        max_num_batched_tokens=2048 * len(prompts), long_prefill_token_threshold=2048,
        enable_prefix_caching=False,
        compile=False, dtype="float32", disable_hybrid_kv_cache_manager=not free, seed=0))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    bm, started, steps = engine.block_manager, time.perf_counter(), 0
    last, merged = {}, {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            merge_delta(merged, delta)
        steps += 1
        lengths = [s.num_computed_tokens for g in engine.scheduler.running for s in g.seqs]
        if sum(lengths) > last.get("live_tokens", 0):
            last = {"used_blocks": bm.num_used_blocks, "live_tokens": sum(lengths), "lengths": lengths}
    runner = engine.runner
    leaks = engine.scheduler.idle_leaks()
    layers_per_block = runner.kv_layout.slots
    used_bytes = last["used_blocks"] * runner.kv_bytes_per_block
    return {"context": context, "free_out_of_window": free, "kv_groups": len(runner.kv_layout.groups),
            "layers_per_block": layers_per_block, "used_blocks": last["used_blocks"],
            "layer_blocks": last["used_blocks"] * layers_per_block, "live_tokens": last["live_tokens"],
            "lengths": last["lengths"],
            "kv_bytes": used_bytes, "kv_bytes_per_live_token": used_bytes / last["live_tokens"],
            "leaks": leaks, "steps": steps, "seconds": round(time.perf_counter() - started, 1),
            "tokens": [merged[str(i)].outputs[0].token_ids for i in range(len(prompts))]}


def hf_greedy(model: pathlib.Path, prompts: List[List[int]], new_tokens: int) -> List[List[int]]:
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, pad_token_id=0)
        tokens.append(out[0, len(prompt):].tolist())
    return tokens


def run(contexts: List[int], seqs: int, new_tokens: int, hf_max_context: int, seed: int) -> Dict:
    import torch
    model = gemma3_like_model()
    gen = torch.Generator().manual_seed(seed)
    paper = kv_bytes_per_position()
    layers = GEMMA3_LIKE["num_hidden_layers"]
    rows = []
    for context in contexts:
        prompts = [torch.randint(100, 40000, (context - new_tokens,), generator=gen).tolist() for _ in range(seqs)]
        freed, full = (run_context(model, context, free, prompts, new_tokens) for free in (True, False))
        # full attention, every layer, at the same lengths
        full_layer_blocks = layers * sum(-(-n // BLOCK_SIZE) for n in freed["lengths"])
        row = {"context": context, "seqs": seqs, "lengths": freed["lengths"],
               "bytes_per_live_token_freed": freed["kv_bytes_per_live_token"],
               "bytes_per_live_token_kept": full["kv_bytes_per_live_token"],
               "bytes_per_token_paper_full": paper,
               "layer_blocks_freed": freed["layer_blocks"], "layer_blocks_kept": full["layer_blocks"],
               "layer_blocks_full_attention": full_layer_blocks,
               "blocks_vs_full_attention": freed["layer_blocks"] / full_layer_blocks,
               "same_tokens_both_ways": freed["tokens"] == full["tokens"],
               "leaks": freed["leaks"] + full["leaks"], "runs": [freed, full]}
        if context <= hf_max_context:
            row["equals_hugging_face"] = freed["tokens"] == hf_greedy(model, prompts, new_tokens)
        rows.append(row)
        print(f"context {context:6d}: {row['bytes_per_live_token_freed']:7.1f} B/token freed, "
              f"{row['bytes_per_live_token_kept']:7.1f} kept, paper {paper} B; blocks "
              f"{100 * row['blocks_vs_full_attention']:.1f} % of full attention; "
              f"HF equal: {row.get('equals_hugging_face', 'not run')}; leaks: {row['leaks'] or 'none'}",
              flush=True)
    return {"model": "gemma3-like", "config": {k: v for k, v in GEMMA3_LIKE.items()},
            "block_size": BLOCK_SIZE, "new_tokens": new_tokens, "rows": rows}
