"""Mixture-of-experts serving on this CPU: decode tok/s at 1, 8 and 32
streams and prefill tok/s of a random Qwen3-MoE-shaped checkpoint (0.99 B
parameters, 0.19 B active per token: top-8 of 64 experts, 12 layers, hidden
1024) that the benchmark writes itself, for

- our engine (experts through ``kernels/csrc/fused_moe.c``);
- our engine on a dense model of the same active size (one MLP as wide as
  the eight chosen experts, the same attention, embedding and depth);
- Hugging Face's forward in PyTorch's eager mode (``generate``) on the same
  folder, with its default experts (``grouped_mm``) and its expert loop (``eager``);
- vLLM's CPU build on the same folder, where ``--vllm-python`` /
  ``BENCH_VLLM_PYTHON`` names its Python (skipped with a message otherwise).

Every system runs the same seeded prompts (token ids), greedy, EOS ignored,
every request at once, float32, the same threads. Decode tok/s is, for
every system, ``streams x (N - 1) / (t(N) - t(1))``: a run of N tokens minus
a run of one, so the prefill is left out however a system schedules it (ours
computes 32 waiting prompts in two or more steps to give first tokens
sooner, Hugging Face's and vLLM's in one). Prefill tok/s is one
prompt's tokens over the time to its first token. The in-process systems run
in paired rounds (each round: every system, every stream count); vLLM runs
its rounds in a process of its own afterwards (it cannot share the memory).

The checkpoint is written in bfloat16 and every system loads it in float32;
our kernel keeps the experts in bfloat16 (every value is one: widened exactly
in registers, the same sums, half the bytes), the others hold float32 copies.
Bytes of expert weights read per decode step are counted by the C kernel
(each active expert's packed weights, once per step; a run of N tokens minus
a run of one, which reads exactly its prefill's) and set against the
active-parameter floor: a step of one sequence needs its top-k experts of
every layer, unpadded, in the dtype the kernel holds them in. Our MoE
engine's greedy tokens are compared with Hugging Face's (``same_tokens_as_hf``).
"""
import argparse
import dataclasses
import gc
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

import torch

from loadtest import moe_model

from . import peer_servers
from .common import add_common_args, set_threads, write_result

VLLM_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_timing.py")
# A small MoE for --quick (and `all --quick`): the same proportions, 16 experts, 4 layers.
QUICK_MOE = dict(moe_model.BENCH_QWEN3_MOE, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                 num_experts_per_tok=4)
QUICK_DENSE = dict(moe_model.BENCH_DENSE, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2)


def checkpoint(name: str, cfg: dict, seed: int) -> pathlib.Path:
    """The benchmark's checkpoint ``name`` under the cache, written on first use."""
    from pagedbackend.config import cache_root
    path = cache_root() / name
    if not (path / "config.json").exists():
        print(f"writing {path} (once)...", flush=True)
        moe_model.write_large_qwen(path, cfg, seed=seed)
    return path


@dataclasses.dataclass
class Run:
    """One timed ``generate`` of every stream at once."""
    seconds: float          # the whole call
    tokens: List[List[int]]  # each stream's generated tokens


class Ours:
    """Our engine, offline: ``LLM.generate`` with every request at once."""

    def __init__(self, name: str, folder: pathlib.Path, max_num_seqs: int, enforce_eager: bool = False):
        from pagedbackend import LLM
        self.name = name
        self.llm = LLM(model=str(folder), max_num_seqs=max_num_seqs, enable_prefix_caching=False,
                       max_model_len=2048, enforce_eager=enforce_eager)

    def run(self, prompts, tokens: int) -> Run:
        from pagedbackend import SamplingParams
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        return Run(seconds, [list(o.outputs[0].token_ids) for o in outputs])

    def close(self) -> None:
        self.llm.shutdown()


class HuggingFace:
    """transformers' forward in PyTorch's eager mode through ``generate``
    (static batch, equal prompt lengths), its experts as ``experts`` says:
    ``default`` for its own choice (``grouped_mm`` where torch has it),
    ``eager`` for its loop over the active experts. One loaded model serves
    every variant (transformers dispatches per call)."""

    def __init__(self, model, experts: str):
        self.model = model
        if experts != "default":
            model.set_experts_implementation(experts)
        self.experts = model.config._experts_implementation
        self.name = f"Hugging Face (MoE, experts_implementation={self.experts})"

    @staticmethod
    def load(folder: pathlib.Path):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def run(self, prompts, tokens: int) -> Run:
        self.model.set_experts_implementation(self.experts)
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                      min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
        return Run(seconds, out[:, ids.shape[1]:].tolist())

    def close(self) -> None:
        self.model = None


def decode_rate(streams: int, tokens: int, t_n: float, t_short: float, short: int = 1) -> Optional[float]:
    """Decode tok/s: a run of ``tokens`` minus a run of ``short`` (None when
    noise made the longer run no slower)."""
    return streams * (tokens - short) / (t_n - t_short) if t_n > t_short else None


def run_in_process(systems, stream_prompts: Dict[int, List[List[int]]], prefill: List[int], tokens: int,
                   rounds: int) -> Dict[str, dict]:
    """Paired rounds: per round, every system at every stream count, then its prefill."""
    from pagedbackend.kernels import moe_cpu
    results = {s.name: {"decode": {n: [] for n in stream_prompts}, "prefill": [], "bytes_per_step": {},
                        "tokens": {}} for s in systems}
    for system in systems:   # warm-up: graphs, kernels, first-time allocations
        system.run(stream_prompts[max(stream_prompts)], 4)
    for r in range(rounds):
        for system in systems:
            for streams, prompts in stream_prompts.items():
                moe_cpu.bytes_read.reset()
                run = system.run(prompts, tokens)
                read_n = moe_cpu.bytes_read.bytes
                moe_cpu.bytes_read.reset()
                one = system.run(prompts, 1)   # the prefill alone
                rate = decode_rate(streams, tokens, run.seconds, one.seconds)
                results[system.name]["decode"][streams].append(rate)
                results[system.name]["tokens"][streams] = run.tokens
                if read_n:   # the experts' bytes of the decode steps alone: minus the prefill's
                    results[system.name]["bytes_per_step"].setdefault(streams, []).append(
                        (read_n - moe_cpu.bytes_read.bytes) / (tokens - 1))
                print(f"round {r + 1} {system.name}: {streams} streams "
                      f"{'-' if rate is None else f'{rate:.1f}'} tok/s", flush=True)
            seconds = system.run([prefill], 1).seconds
            results[system.name]["prefill"].append(len(prefill) / seconds)
            print(f"round {r + 1} {system.name}: prefill {len(prefill) / seconds:.0f} tok/s", flush=True)
    return results


def run_vllm(python: str, env_file: Optional[str], folder: pathlib.Path, stream_prompts, prefill, tokens: int,
             rounds: int, threads: int, timeout_s: float, short: int = 1,
             dtype: str = "float32") -> Dict[str, object]:
    """vLLM's rounds in its own process (``vllm_timing.py``): decode tok/s per
    stream count (a run of ``tokens`` minus one of ``short``) and, where
    ``prefill`` is given, prefill tok/s."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as job:
        json.dump({"model": str(folder), "streams": {str(k): v for k, v in stream_prompts.items()},
                   "prefill": prefill, "decode_tokens": tokens, "short_tokens": short, "dtype": dtype,
                   "rounds": rounds, "max_model_len": 2048, "max_num_seqs": max(stream_prompts)}, job)
    try:
        done = subprocess.run([python, VLLM_SCRIPT, job.name], capture_output=True, text=True,
                              env=peer_servers.vllm_env(threads, env_file, offline=True), timeout=timeout_s)
    finally:
        os.unlink(job.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed ({peer_servers.exit_description(done.returncode)}): "
                           f"{done.stderr[-2000:]}")
    runs = json.loads(lines[-1])["runs"]
    result = {"decode": {n: [] for n in stream_prompts}, "prefill": []}
    by_streams: Dict[int, dict] = {}
    for run in runs:
        if "prefill" in run:
            result["prefill"].append(run["prefill"] / run["seconds"])
            continue
        pair = by_streams.setdefault(run["streams"], {})
        pair[run["tokens"]] = run["seconds"]
        if len(pair) == 2:
            result["decode"][run["streams"]].append(
                decode_rate(run["streams"], tokens, pair[tokens], pair[short], short))
            by_streams.pop(run["streams"])
    return result


def median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,32", help="concurrent sequences per decode run")
    ap.add_argument("--decode-tokens", type=int, default=24, help="tokens per sequence in a decode run")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of the decode runs")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="the prefill prompt's length")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (medians are reported)")
    ap.add_argument("--small", action="store_true",
                    help="the --quick checkpoints (16 experts, 4 layers, hidden 256) with the other settings as given")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="our engines' steps eager, without torch.compile (a check of the figures' form, "
                         "not of our speed)")
    ap.add_argument("--skip-hf", action="store_true", help="leave Hugging Face's forward out")
    ap.add_argument("--hf-experts", default="default,eager",
                    help="transformers' experts_implementation values to run (default: its own choice)")
    env = os.environ.get
    ap.add_argument("--vllm-python", default=env("BENCH_VLLM_PYTHON"), help="Python of vLLM's venv")
    ap.add_argument("--vllm-env", default=env("BENCH_VLLM_ENV"), help="shell file of exports for vLLM")
    ap.add_argument("--vllm-timeout", type=float, default=3600.0, help="seconds for vLLM's whole run")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.decode_tokens, args.prefill_tokens, args.rounds = "1,4", 8, 64, 1
    set_threads(args.threads)
    started = time.perf_counter()
    small = args.quick or args.small
    moe_cfg, dense_cfg = (QUICK_MOE, QUICK_DENSE) if small else (moe_model.BENCH_QWEN3_MOE, moe_model.BENCH_DENSE)
    suffix = "-quick" if small else ""
    moe_dir = checkpoint(f"bench-moe-qwen3{suffix}", moe_cfg, seed=0)
    dense_dir = checkpoint(f"bench-dense-qwen2{suffix}", dense_cfg, seed=1)
    g = torch.Generator().manual_seed(args.seed)
    streams = [int(s) for s in args.streams.split(",")]
    stream_prompts = {n: torch.randint(3, moe_cfg["vocab_size"], (n, args.prompt_tokens), generator=g).tolist()
                      for n in streams}
    prefill = torch.randint(3, moe_cfg["vocab_size"], (args.prefill_tokens,), generator=g).tolist()

    systems = [Ours("ours (MoE)", moe_dir, max(streams), args.enforce_eager),
               Ours("ours (dense, same active size)", dense_dir, max(streams), args.enforce_eager)]
    if not args.skip_hf:
        model = HuggingFace.load(moe_dir)
        systems += [HuggingFace(model, experts) for experts in args.hf_experts.split(",")]
    results = run_in_process(systems, stream_prompts, prefill, args.decode_tokens, args.rounds)
    from pagedbackend.models.moe import experts_of
    runner = systems[0].llm.engine.runner
    kernel = runner.moe_kernel
    layer = experts_of(runner.model)[0]
    weight_bytes, expert_dtype = layer.w13.element_size(), str(layer.w13.dtype).removeprefix("torch.")
    for system in systems:
        system.close()
    systems = None
    gc.collect()
    skipped = []
    if args.vllm_python and os.path.isfile(args.vllm_python) and not args.quick:
        try:
            results["vLLM CPU (MoE)"] = run_vllm(args.vllm_python, args.vllm_env, moe_dir, stream_prompts, prefill,
                                                 args.decode_tokens, args.rounds, args.threads, args.vllm_timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            skipped.append(f"vLLM: {str(exc).splitlines()[0]}")
    else:
        skipped.append("vLLM: no --vllm-python / BENCH_VLLM_PYTHON (or --quick)")
    counts = moe_model.parameter_counts(moe_cfg)
    # The floor in the dtype the kernel holds the experts in (bfloat16 where the checkpoint's are), unpadded.
    expert_bytes = counts["expert_bytes_fp32"] // 4 * weight_bytes
    floor_one = moe_cfg["num_hidden_layers"] * moe_cfg["num_experts_per_tok"] * expert_bytes
    every = moe_cfg["num_hidden_layers"] * moe_cfg["num_experts"] * expert_bytes
    rows = []
    for name, res in results.items():
        row = {"system": name, "prefill_tok_s": median(res["prefill"])}
        for n in streams:
            row[f"decode_tok_s_{n}"] = median(res["decode"][n])
        for n, values in res.get("bytes_per_step", {}).items():
            row[f"expert_bytes_per_step_{n}"] = median(values)
        rows.append(row)
    ours = rows[0]
    ratios = {}
    for other in rows[1:]:
        for n in streams:
            a, b = ours[f"decode_tok_s_{n}"], other[f"decode_tok_s_{n}"]
            if a and b:
                ratios[f"ours / {other['system']} at {n} streams"] = a / b
    hf_tokens = [res["tokens"] for name, res in results.items() if name.startswith("Hugging Face")]
    same_tokens = (all(tokens == results[ours["system"]]["tokens"] for tokens in hf_tokens)
                   if hf_tokens else None)
    read_one = ours.get(f"expert_bytes_per_step_{streams[0]}")
    result = {"model": {"moe": str(moe_dir), "dense": str(dense_dir), "moe_parameters": counts,
                        "dense_parameters": moe_model.parameter_counts(dense_cfg)},
              "expert_kernel": kernel, "expert_dtype": expert_dtype, "expert_bytes": expert_bytes,
              "streams": streams, "decode_tokens": args.decode_tokens,
              "prompt_tokens": args.prompt_tokens, "prefill_tokens": args.prefill_tokens, "rounds": args.rounds,
              "rows": rows, "ratios": ratios, "same_tokens_as_hf": same_tokens, "skipped": skipped,
              "active_expert_floor_bytes_one_stream": floor_one, "every_expert_bytes": every,
              "read_over_floor_one_stream": read_one / floor_one if read_one and streams[0] == 1 else None,
              "seconds": round(time.perf_counter() - started, 1)}
    for row in rows:
        cells = "  ".join(f"{n}: {row[f'decode_tok_s_{n}'] or 0:.1f}" for n in streams)
        print(f"{row['system']}: decode tok/s {cells}; prefill {row['prefill_tok_s'] or 0:.0f} tok/s")
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    if result["read_over_floor_one_stream"]:
        print(f"expert bytes per one-stream decode step: {read_one / 1e6:.1f} MB, "
              f"{result['read_over_floor_one_stream']:.3f}x the active experts' {floor_one / 1e6:.1f} MB "
              f"in {expert_dtype} (every expert: {every / 1e6:.0f} MB)")
    if same_tokens is not None:
        print(f"our MoE engine's greedy tokens {'equal' if same_tokens else 'differ from'} Hugging Face's")
    for line in skipped:
        print(f"skipped {line}")
    path = write_result(args.out, "moe", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
