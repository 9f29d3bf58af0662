"""Continuous batching vs what a user would run instead on this machine:
Hugging Face ``generate`` with static batches.

The same prompts (token ids of a seeded Alpaca-like trace) and the same model
(default: SmolLM2-135M-Instruct, fp32, CPU) go through

- our engine: ``LLM.generate`` with every request at once (continuous batching:
  a finished request leaves the batch, a waiting one takes its place);
- ``transformers`` ``generate``: batches of B prompts in trace order, padded on
  the left; each batch runs until its longest output is done
  (``max_new_tokens`` = ``min_new_tokens`` = the longest in the batch).

EOS is ignored and each request asks for its trace output length, so both do
the same useful work: throughput counts only the tokens each request asked for
(HF's extra tokens in shorter rows are padding work, reported separately).
"""
import argparse
import time

import torch
from tqdm import tqdm

from loadtest import workloads

from . import plots
from .common import add_common_args, bench_model, set_threads, write_result


def run_engine(model: str, prompts, lengths, max_num_seqs: int) -> dict:
    from pagedbackend import LLM, SamplingParams
    llm = LLM(model=model, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # warm-up
    # min_tokens = max_tokens suppresses EOS as HF's min_new_tokens does, so both
    # pick the same tokens (ignore_eos alone would let EOS be chosen and continue).
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == list(lengths)
    return {"seconds": seconds, "tokens": tokens, "steps": llm.engine.get_stats().num_steps}


def hf_batches(prompts, lengths, batch_size: int):
    """Static batches in trace order: (prompts, requested lengths, new tokens to run)."""
    for i in range(0, len(prompts), batch_size):
        ps, ls = prompts[i:i + batch_size], lengths[i:i + batch_size]
        yield ps, ls, max(ls)


def left_pad(prompts, pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def run_hf(hf, pad_id: int, prompts, lengths, batch_size: int) -> dict:
    tokens, computed = [], 0
    batches = list(hf_batches(prompts, lengths, batch_size))
    start = time.perf_counter()
    for ps, ls, new in tqdm(batches, desc=f"HF batch {batch_size}", leave=False):
        ids, mask = left_pad(ps, pad_id)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=pad_id)
        for row, n in enumerate(ls):
            tokens.append(out[row, ids.shape[1]:ids.shape[1] + n].tolist())
        computed += new * len(ps)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "generated_tokens": computed}


def plot(result: dict, out_dir: str):
    fig, (ax,) = plots.figure(width=6.4, height=4.0)
    rows = result["rows"]
    plots.grouped_bars(ax, [r["system"] for r in rows],
                       {"output tokens/s": [r["output_tokens_per_s"] for r in rows]},
                       ylabel="requested output tokens / s")
    name = "SmolLM2-135M-Instruct" if result["model"] == "default" else result["model"]
    ax.set_title(f"{result['requests']} Alpaca-like requests, {name} fp32, "
                 f"{result['machine_threads']} thread(s)", fontsize=9)
    return plots.save(fig, out_dir, "hf", "Continuous batching vs HF generate (static batches)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny' or a folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,8,32", help="HF static batch sizes")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="engine batch cap")
    ap.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.batch_sizes, args.max_output = 8, "4", 32
    set_threads(args.threads)
    started = time.perf_counter()
    from transformers import AutoModelForCausalLM
    from pagedbackend.models.default_model import resolve_model_path
    model = bench_model(args.model)
    folder = resolve_model_path(model)
    trace = workloads.alpaca_like(args.requests, args.seed)
    lengths = [min(r.output_len, args.max_output or r.output_len) for r in trace]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = workloads.make_prompt_token_ids(trace, hf.config.vocab_size, args.seed)
    pad_id = hf.generation_config.pad_token_id or hf.config.eos_token_id or 0
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    useful = sum(lengths)
    hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=pad_id)  # warm-up

    engine = run_engine(model, prompts, lengths, args.max_num_seqs)
    rows = [{"system": f"engine (continuous, <= {args.max_num_seqs} seqs)",
             "seconds": round(engine["seconds"], 2),
             "output_tokens_per_s": useful / engine["seconds"], "steps": engine["steps"]}]
    print(f"engine: {useful} tokens in {engine['seconds']:.1f} s = "
          f"{rows[0]['output_tokens_per_s']:.1f} tokens/s")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        res = run_hf(hf, pad_id, prompts, lengths, b)
        same = sum(a == e for a, e in zip(res["tokens"], engine["tokens"])) / len(lengths)
        rows.append({"system": f"HF generate, static batch {b}", "batch_size": b,
                     "seconds": round(res["seconds"], 2), "output_tokens_per_s": useful / res["seconds"],
                     "generated_tokens": res["generated_tokens"],
                     "padding_waste": 1 - useful / res["generated_tokens"],
                     "same_tokens_as_engine": same})
        print(f"HF batch {b}: {useful} tokens in {res['seconds']:.1f} s = "
              f"{rows[-1]['output_tokens_per_s']:.1f} tokens/s ({res['generated_tokens']} generated, "
              f"{100 * rows[-1]['padding_waste']:.0f} % beyond what was asked; "
              f"{100 * same:.0f} % of requests token-identical to the engine)")
    best_hf = max(r["output_tokens_per_s"] for r in rows[1:])
    result = {"model": args.model, "dtype": "float32", "requests": args.requests,
              "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": useful,
              "machine_threads": torch.get_num_threads(), "rows": rows,
              "speedup_vs_best_hf": rows[0]["output_tokens_per_s"] / best_hf,
              "seconds": round(time.perf_counter() - started, 1)}
    print(f"engine / best HF: {result['speedup_vs_best_hf']:.2f}x")
    path = write_result(args.out, "hf", result)
    print(f"wrote {path} and {plot(result, args.out)}")
    return result


if __name__ == "__main__":
    main()
