"""One run on a CUDA machine (under 10 minutes): are the Triton-lang kernels
right there, how fast is decode attention, and what does the engine do.

1. Checks: ``paged_attention`` (Triton-lang) against its torch reference twin
   and against PyTorch's ``scaled_dot_product_attention`` on contiguous K/V,
   for fp32 / fp16 / bf16, mixed prefill-and-decode batches, two head shapes
   (SmolLM2's GQA and a Llama-7B-like MHA); ``write_kv`` against its twin.
2. Decode attention: one query token per sequence over the paged cache, timed
   with CUDA events against SDPA over the same K/V laid out contiguously
   (padded, ``enable_gqa``) and against the memory-bandwidth limit (the K/V
   bytes read divided by the bandwidth of a large device-to-device copy).
3. Offline: the seeded 32-request Alpaca-like token-id workload through
   ``LLM.generate`` (greedy, EOS ignored, all at once) per dtype, with
   decode steps replayed from CUDA graphs, and once more for the first dtype
   with the graphs dropped: the same tokens, and what the graphs save.

Without CUDA it exits at once with a message; nothing is measured on a CPU.
"""
import argparse
import math
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

from loadtest import workloads

from .common import write_result

SHAPES = {"smollm2 (9 q / 3 kv heads, dim 64)": (9, 3, 64),
          "llama-7b-like (32 q / 32 kv heads, dim 128)": (32, 32, 128)}
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def paged_batch(lens: List[Tuple[int, int]], block_size: int, heads: Tuple[int, int, int],
                dtype: torch.dtype, seed: int, device="cuda") -> dict:
    """Sequences given as (q_len, seq_len): K/V drawn contiguous, scattered into
    shuffled physical blocks; unused cache positions hold NaN."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    nblocks = [math.ceil(s / block_size) for _, s in lens]
    total_blocks = sum(nblocks) + 1
    order = torch.randperm(total_blocks, generator=gen, device=device).to(torch.int32)
    shape = (total_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    tables = torch.full((len(lens), max(nblocks)), int(order[-1]), dtype=torch.int32, device=device)
    keys, values, used = [], [], 0
    for s, ((_, seq_len), n) in enumerate(zip(lens, nblocks)):
        tables[s, :n] = order[used:used + n]
        used += n
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        pos = torch.arange(seq_len, device=device)
        blocks = tables[s, pos // block_size].long()
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        keys.append(k)
        values.append(v)
    q_lens = torch.tensor([q for q, _ in lens], dtype=torch.int32, device=device)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen, device=device).to(dtype)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32, device=device)
    return {"args": (q, k_cache, v_cache, tables, cu, seq_lens), "keys": keys, "values": values}


def sdpa_reference(batch: dict) -> torch.Tensor:
    """fp32 causal attention per sequence on its contiguous K/V."""
    q, _, _, _, cu, _ = batch["args"]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu.tolist()
    for s, (k, v) in enumerate(zip(batch["keys"], batch["values"])):
        qs = q[bounds[s]:bounds[s + 1]].float().transpose(0, 1)
        q_len, seq_len = qs.shape[1], k.shape[0]
        visible = (torch.arange(seq_len, device=q.device)[None, :]
                   <= torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None])
        o = F.scaled_dot_product_attention(qs, k.float().transpose(0, 1), v.float().transpose(0, 1),
                                           attn_mask=visible, enable_gqa=True)
        out[bounds[s]:bounds[s + 1]] = o.transpose(0, 1)
    return out


def check_kernels(seed: int = 0) -> List[dict]:
    from pagedbackend.kernels import kv_write, paged_attention as pa
    lens = [(1, 1), (1, 17), (1, 300), (7, 7), (33, 80), (16, 16), (130, 300), (1, 1025)]
    rows = []
    for dname, dtype in DTYPES.items():
        for shape_name, heads in SHAPES.items():
            for block_size in (16, 32):
                batch = paged_batch(lens, block_size, heads, dtype, seed)
                expected = sdpa_reference(batch)
                for name, fn in (("triton", pa.paged_attention), ("reference", pa.paged_attention_ref)):
                    got = fn(*batch["args"]).float()
                    err = (got - expected).abs().max().item()
                    rows.append({"check": f"paged_attention {name}", "dtype": dname, "shape": shape_name,
                                 "block_size": block_size, "max_abs_err": err,
                                 "ok": bool(err <= 2 * TOL[dtype])})
        n_slots, (_, kv_heads, dim) = 64, SHAPES["smollm2 (9 q / 3 kv heads, dim 64)"]
        key = torch.randn(n_slots, kv_heads, dim, device="cuda").to(dtype)
        value = torch.randn(n_slots, kv_heads, dim, device="cuda").to(dtype)
        cache = torch.zeros(16, 16, kv_heads, dim, dtype=dtype, device="cuda")
        slots = torch.randperm(256, device="cuda")[:n_slots]
        k1, v1, k2, v2 = cache.clone(), cache.clone(), cache.clone(), cache.clone()
        kv_write.write_kv(key, value, k1, v1, slots)
        kv_write.write_kv_ref(key, value, k2, v2, slots)
        rows.append({"check": "write_kv", "dtype": dname, "ok": bool(torch.equal(k1, k2) and torch.equal(v1, v2))})
    return rows


def cuda_time_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() * 4 / (ms / 1000) / 1e9


def time_decode(bandwidth: float, dtype=torch.bfloat16) -> List[dict]:
    from pagedbackend.kernels import paged_attention as pa
    rows = []
    for shape_name, heads in SHAPES.items():
        num_heads, num_kv_heads, head_dim = heads
        for batch_size, context in ((32, 512), (64, 2048), (256, 1024), (32, 8192)):
            batch = paged_batch([(1, context)] * batch_size, 16, heads, dtype, seed=1)
            args = batch["args"]
            plan = pa.plan_paged_attention(args[4].cpu(), args[5].cpu(), num_heads, num_kv_heads, "cuda")
            paged_ms = cuda_time_ms(lambda: pa.paged_attention(*args, plan=plan))
            k = torch.stack(batch["keys"]).transpose(1, 2).contiguous()    # [B, kv_heads, L, D]
            v = torch.stack(batch["values"]).transpose(1, 2).contiguous()
            q = args[0].unsqueeze(2)                                         # [B, heads, 1, D]
            sdpa_ms = cuda_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            kv_bytes = 2 * batch_size * context * num_kv_heads * head_dim * k.element_size()
            bound_ms = kv_bytes / (bandwidth * 1e9) * 1000
            rows.append({"shape": shape_name, "dtype": str(dtype).split(".")[-1], "batch": batch_size,
                         "context": context, "paged_triton_ms": round(paged_ms, 4),
                         "sdpa_contiguous_ms": round(sdpa_ms, 4), "bandwidth_bound_ms": round(bound_ms, 4),
                         "paged_share_of_bandwidth": round(bound_ms / paged_ms, 3),
                         "paged_vs_sdpa": round(sdpa_ms / paged_ms, 3)})
    torch.cuda.empty_cache()
    return rows


def offline(dtypes: List[str], requests: int, seed: int, compile_step: bool) -> List[dict]:
    """The offline workload per dtype with decode steps replayed from CUDA
    graphs (the default), then the first dtype again with the graphs
    dropped after load (the same compiled step, launched op by op): same
    tokens, and the graphs' speed-up."""
    from pagedbackend import LLM, SamplingParams
    trace = workloads.alpaca_like(requests, seed)
    lengths = [r.output_len for r in trace]
    rows, reference = [], None
    runs = [(dtype, True) for dtype in dtypes] + [(dtypes[0], False)]
    for dtype, graphs in runs:
        started = time.perf_counter()
        llm = LLM(model="default", device="cuda", dtype=dtype, max_num_seqs=256, compile=compile_step)
        init_s = time.perf_counter() - started
        runner = llm.engine.runner
        captured = runner.graphs.sizes if runner.graphs is not None else []
        if not graphs:
            runner.graphs = None
        prompts = workloads.make_prompt_token_ids(trace, llm.engine.vocab_size, seed)
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outs]
        reference = reference or tokens
        replays = sum(runner.graphs.replays.values()) if runner.graphs is not None else 0
        rows.append({"dtype": dtype, "cuda_graphs": graphs, "captured_sizes": len(captured),
                     "graph_replays": replays, "init_s": round(init_s, 1), "seconds": round(seconds, 3),
                     "output_tokens_per_s": sum(lengths) / seconds,
                     "same_tokens_as_first_dtype": sum(a == b for a, b in zip(tokens, reference)) / requests})
        print(f"offline {dtype} ({'CUDA graphs' if graphs else 'no graphs'}, {len(captured)} sizes "
              f"captured, {replays} replays): {rows[-1]['output_tokens_per_s']:.0f} tokens/s "
              f"(init {init_s:.0f} s)", flush=True)
        del llm, runner
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="offline engine dtypes")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="offline engine without torch.compile")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("loadtest.bench gpu: no CUDA device here (torch.cuda.is_available() is False); "
                         "nothing was measured. Run it on a machine with an NVIDIA GPU.")
    started = time.perf_counter()
    result: Dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    checks = check_kernels()
    failed = [c for c in checks if not c["ok"]]
    print(f"kernel checks: {len(checks) - len(failed)}/{len(checks)} passed", flush=True)
    for c in failed:
        print(f"  FAILED {c}", flush=True)
    bandwidth = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {bandwidth:.0f} GB/s", flush=True)
    decode = time_decode(bandwidth)
    for r in decode:
        print(f"decode {r['shape'][:14]:14s} B={r['batch']:3d} L={r['context']:5d}: paged "
              f"{r['paged_triton_ms']:.3f} ms, SDPA {r['sdpa_contiguous_ms']:.3f} ms, bound "
              f"{r['bandwidth_bound_ms']:.3f} ms ({100 * r['paged_share_of_bandwidth']:.0f} % of bandwidth)",
              flush=True)
    result.update({"kernel_checks": checks, "kernel_checks_failed": len(failed),
                   "copy_bandwidth_gbs": round(bandwidth, 1), "decode_attention": decode})
    if not args.skip_offline:
        result["offline"] = offline(args.dtypes.split(","), args.requests, args.seed, not args.no_compile)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(f"wrote {write_result(args.out, 'gpu', result)}")
    if failed:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
