"""``python -m loadtest.bench NAME [options]``; ``NAME --help`` for its options.
``python -m loadtest.bench all --quick [--out DIR]`` runs every benchmark small."""
import importlib
import sys
import time
import traceback

BENCHMARKS = {
    "memory": "KV position utilisation: paged vs Orca Max/Pow2/Oracle reservation (Fig. 2)",
    "capacity": "sustainable request rate and batch size under one KV budget (Figs. 12, 13)",
    "blocksize": "block-size sweep; swap vs recompute preemption (Figs. 18, 19)",
    "hf": "continuous batching vs Hugging Face generate with static batches",
    "server": "the same workload through tritonserver vs the in-process engine",
    "sharing": "KV memory saved by parallel sampling and beam search sharing (Fig. 15)",
    "prefix": "prefix-cache speed-up on shared-prefix (1-shot, 5-shot) workloads (Fig. 16)",
    "overhead": "scheduler time per step outside the model forward",
    "broadcast": "tensor parallelism: per-step cost of the step message on two CPU ranks",
    "openai_api": "time to first token added by the OpenAI-compatible API over direct gRPC",
    "contention": "serving tok/s, TTFT and TPOT idle and beside 1 and 2 busy processes, ours and vLLM's",
    "fairness": "canary latency beside an 8k-token prompt, n=64, preempted groups, grammar bombs, deep "
                "schemas, large /tokenize calls, a 64-prompt request; stub memory over 1,000 schemas",
    "structured": "JSON-schema constrained decoding against free decoding at 32 requests; grammar compile times",
    "specdecode": "speculative decoding (ngram, self_int4) against none: TPOT and tok/s, copying and chat, with peers",
    "priority": "high-priority TTFT under a full KV pool, scheduling_policy fcfs against priority",
    "startup": "time from starting the launcher to ready, to a first token, and to the compiled step",
    "aiperf": "NVIDIA's AIPerf against our OpenAI API and vLLM's, concurrency 1, 8 and 32",
    "eval": "lm-evaluation-harness through our OpenAI API beside its hf model: log-likelihoods, accuracy",
    "peers": "offline tokens/s and serving TTFT/TPOT/ITL beside vLLM's CPU build and llama.cpp",
    "gpu": "on a CUDA machine: Triton-lang kernel checks, decode attention timing, offline run",
    "quant_kernels": "weight-only int8 / int4 and bf16 matmuls vs fp32 on SmolLM2's linear shapes",
    "quant_quality": "quantization none / int8 / int4: perplexity, greedy agreement, offline tokens/s",
    "bf16_gemm": "bfloat16 products per Llama-3.2-1B shape: the paired kernel, the kernel on the loaded layout, torch's GEMM",
    "gguf_gemm": "GGUF products per Llama-3.2-1B shape and block type: exact, int8 activations from blocks and from panels",
    "cpu_kernels": "packed fp32 linear and C decode attention vs F.linear and the gather path",
    "kv_cache_dtype": "KV cache in bfloat16 / int8 vs float32: decode kernel time at 4k and 16k, quality, capacity",
    "kv_formats": "int8 KV row layouts narrower than the cache's, simulated: K/V rounding error, greedy agreement, "
                  "perplexity against today's layout",
    "kv_memory": "per kv_cache_dtype, the whole engine: sequences that fit kv_cache_bytes at 4k / 16k / 32k "
                 "context, decode tok/s paired against the model's dtype",
    "fleet": "replicas behind Dynamo's KV router vs round-robin and random on multi-turn chat; the hop's cost",
    "moe": "mixture of experts: decode and prefill tok/s beside HF, a dense model and vLLM; expert bytes read",
    "lora": "multi-LoRA at 32 streams: 0, 1, 4, 16 adapters of rank 8 and 64 against the base model",
    "models": "per model family: decode-batch step time, ours against Hugging Face's forward",
    "embed": "embeddings: sentences/s on 256 mixed-length texts and single-request latency, ours against "
             "sentence-transformers (and vLLM's CPU build where given)",
    "vision": "LLaVA ~0.5 B with images: TTFT and tok/s at 1, 8, 32 requests vs HF generate; encoder and prefix caches",
    "scale": "a Llama-3.2-1B-shaped model in bf16 and as GGUF Q8_0/Q4_0/Q4_K_M: decode tok/s at 1 and 32 streams "
             "against the memory and compute rooflines, start-up, beside vLLM and llama.cpp",
}
NEEDS_CUDA = {"gpu"}
# Each installs a client of its own from PyPI on first use: run them by name only.
NOT_IN_ALL = {"aiperf", "eval"}

# Small settings for `all --quick` (benchmarks without a --quick flag of their own).
QUICK_ARGS = {
    "sharing": ["--requests", "2", "--widths", "2", "--max-output", "16"],
    "prefix": ["--model", "tiny", "--requests", "4"],
    "overhead": ["--seqs", "32", "--steps", "5"],
    "peers": ["--quick", "--model", "tiny"],
    "contention": ["--quick", "--model", "tiny"],
    "fairness": ["--quick", "--model", "tiny"],
    "fleet": ["--quick"],
    "models": ["--quick", "--hidden", "64", "--layers", "2"],
    "scale": ["--quick", "--eager", "--startup-settings", "Q4_0"],
}


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def run_all(argv) -> int:
    """Every benchmark in turn; one that fails is reported and the rest still run."""
    quick = "--quick" in argv
    passed = [a for a in argv if a != "--quick"]
    failed = []
    for name in BENCHMARKS:
        if name in NOT_IN_ALL:
            print(f"== {name}: skipped in 'all' (python -m loadtest.bench {name} runs it)", flush=True)
            continue
        if name in NEEDS_CUDA and not _has_cuda():
            print(f"== {name}: skipped, no CUDA device", flush=True)
            continue
        args = list(passed)
        if quick:
            args = QUICK_ARGS.get(name, ["--quick"]) + args
        print(f"== {name} {' '.join(args)}", flush=True)
        start = time.perf_counter()
        saved, sys.argv = sys.argv, [sys.argv[0], name, *args]   # the command each result records
        try:
            importlib.import_module(f"loadtest.bench.{name}").main(args)
        except SystemExit as exc:   # argparse errors and deliberate exits
            if exc.code not in (0, None):
                failed.append(name)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        finally:
            sys.argv = saved
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "all":
        sys.exit(run_all(sys.argv[2:]))
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help") or sys.argv[1] not in BENCHMARKS:
        print(__doc__.strip() + "\n")
        for name, what in BENCHMARKS.items():
            print(f"  {name:10s} {what}")
        sys.exit(0 if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help") else 2)
    # sys.argv stays whole: each result records "python -m loadtest.bench NAME ..." from it.
    importlib.import_module(f"loadtest.bench.{sys.argv[1]}").main(sys.argv[2:])


if __name__ == "__main__":
    main()
