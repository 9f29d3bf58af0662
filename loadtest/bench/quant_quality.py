"""Weight-only quantisation against fp32: quality and speed, in one run.

For each ``quantization`` setting (default: none, int8, int4), one engine on
the default model (SmolLM2-135M-Instruct) measures

- perplexity of a fixed text: the first ``--ppl-tokens`` tokens of CPython's
  LICENSE.txt (shipped with every Python, so the text is the same everywhere),
  scored in one prefill, every position's logits;
- greedy agreement with fp32: 64 chat prompts (16 topics x 4 instructions),
  64 new tokens each (EOS ignored); per prompt the length of the common prefix
  with fp32's tokens, and how many of the 64 match position by position;
- offline output tokens/s on the seeded Alpaca-like workload of ``hf`` (32
  requests as token ids, all queued at once, greedy, each its trace length),
  run twice and timed the second time.

Settings run one after the other in one process (the same machine state);
``--order`` changes which goes first.
"""
import argparse
import gc
import math
import pathlib
import sysconfig
import time

import torch

from loadtest import workloads

from .common import add_common_args, bench_model, set_threads, settings_with_environment, write_result

TOPICS = ("the moon", "photosynthesis", "a rainy city", "the Roman empire", "prime numbers",
          "coffee", "volcanoes", "the internet", "honey bees", "chess", "the ocean tides",
          "electric cars", "friendship", "the printing press", "black holes", "bread baking")
INSTRUCTIONS = ("Explain {} in two sentences.", "Write a short poem about {}.",
                "List three facts about {}.", "What would a child ask about {}? Answer it.")


def agreement_prompts(tokenizer) -> list:
    """64 chat-formatted prompts as token ids."""
    texts = [form.format(topic) for topic in TOPICS for form in INSTRUCTIONS]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    return [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]


def fixed_text_ids(tokenizer, num_tokens: int) -> list:
    text = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = list(getattr(ids, "ids", ids))
    if len(ids) < num_tokens:
        raise ValueError(f"LICENSE.txt has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def perplexity(llm, token_ids: list) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]`` given the prefix,
    in one prefill through the engine's model (before any request: its KV
    blocks are all free)."""
    from pagedbackend.models.attention import step_context
    from pagedbackend.worker.batch import SeqEntry

    runner = llm.engine.runner
    blocks = list(range(1, 1 + math.ceil(len(token_ids) / runner.block_size)))
    batch = runner.prepare([SeqEntry(token_ids, 0, blocks)]).to(runner.device)
    forward, logits_of = runner.model.forward, runner.model.compute_logits
    if runner.compiled is not None:
        forward, logits_of = runner.compiled.forward, runner.compiled.logits
    with torch.inference_mode(), step_context(runner.kv_caches, batch.meta, runner.attention_ops):
        logits = logits_of(forward(batch.input_ids, batch.positions)).float()
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1], targets)
    return math.exp(nll.item())


def greedy(llm, prompts, lengths, exact: bool = False):
    """Greedy outputs of ``lengths[i]`` tokens, EOS ignored; ``exact`` also
    forbids EOS (min_tokens), so every setting does the same work."""
    from pagedbackend import SamplingParams
    params = [SamplingParams(max_tokens=n, min_tokens=n if exact else 0, ignore_eos=True,
                             temperature=0.0) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(mode: str, args, agree_prompts, text_ids, work_prompts, work_lengths) -> dict:
    from pagedbackend import LLM
    start = time.perf_counter()
    setting, _, backend = mode.partition("/")
    quantization, _, activations = setting.partition(":")
    extra = {"int4_activations": activations} if activations else {}
    llm = LLM(**settings_with_environment(dict(
        model=args.model, quantization=quantization, linear_backend=backend or "auto", compile=args.compile, **extra,
        max_num_seqs=64, enable_prefix_caching=False, seed=args.seed)))
    load_s = time.perf_counter() - start
    ppl = perplexity(llm, text_ids)
    tokens, agree_s = greedy(llm, agree_prompts, [args.new_tokens] * len(agree_prompts))
    # The workload twice, the second timed: a compiled step meets new step
    # shapes (and may recompile) the first time through.
    _, warm_s = greedy(llm, work_prompts, work_lengths, exact=True)
    _, work_s = greedy(llm, work_prompts, work_lengths, exact=True)
    print(f"{mode}: load {load_s:.0f} s, perplexity {ppl:.3f}, agreement run {agree_s:.0f} s, "
          f"workload {warm_s:.1f} s then {work_s:.1f} s", flush=True)
    llm_backend = llm.engine.runner.linear_backend
    params = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in llm.engine.runner.model.buffers())
    llm.shutdown()
    del llm
    gc.collect()
    return {"quantization": mode, "linear_backend": llm_backend, "load_s": round(load_s, 1), "perplexity": ppl,
            "tokens": tokens, "agreement_seconds": round(agree_s, 1),
            "offline_first_pass_seconds": round(warm_s, 2), "offline_seconds": round(work_s, 2), "offline_tokens_per_s": sum(work_lengths) / work_s,
            "weight_bytes": params + buffers}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench quant_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--order", default="none,int8,int4",
                    help="settings, in run order; SETTING/BACKEND also sets linear_backend (int8/torch), "
                         "int4:ACTIVATIONS int4_activations (int4:float, int4:int8)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=32, help="offline workload size")
    ap.add_argument("--compile", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                    help="the engine's compile setting (true | false)")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.new_tokens, args.ppl_tokens, args.requests, args.compile = 8, 128, 4, False
    set_threads(args.threads)
    args.model = bench_model(args.model)
    from transformers import AutoTokenizer
    from pagedbackend.models.default_model import resolve_model_path
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    agree_prompts = agreement_prompts(tokenizer)
    if args.quick:
        agree_prompts = agree_prompts[:8]
    text_ids = fixed_text_ids(tokenizer, args.ppl_tokens)
    trace = workloads.alpaca_like(args.requests, args.seed)
    work_prompts = workloads.make_prompt_token_ids(trace, tokenizer.vocab_size, args.seed)
    work_lengths = [r.output_len for r in trace]

    runs = {mode: measure(mode, args, agree_prompts, text_ids, work_prompts, work_lengths)
            for mode in args.order.split(",")}
    reference = runs.get("none")
    rows = []
    for mode, run in runs.items():
        row = {k: v for k, v in run.items() if k != "tokens"}
        if reference is not None:
            pairs = list(zip(reference["tokens"], run["tokens"]))
            prefixes = [common_prefix(a, b) for a, b in pairs]
            row["identical_outputs"] = sum(p == len(a) for p, (a, _) in zip(prefixes, pairs))
            row["mean_common_prefix"] = sum(prefixes) / len(prefixes)
            row["position_match"] = (sum(x == y for a, b in pairs for x, y in zip(a, b))
                                     / sum(len(a) for a, _ in pairs))
            row["tokens_per_s_vs_fp32"] = run["offline_tokens_per_s"] / reference["offline_tokens_per_s"]
        rows.append(row)
    print(f"{'setting':8s} {'ppl':>7s} {'same':>6s} {'prefix':>7s} {'pos':>6s} {'tok/s':>7s} "
          f"{'x fp32':>6s} {'MB':>6s} {'load s':>6s}")
    for r in rows:
        print(f"{r['quantization']:8s} {r['perplexity']:7.3f} {r.get('identical_outputs', 0):>3d}/"
              f"{len(agree_prompts):<2d} {r.get('mean_common_prefix', 0):7.1f} "
              f"{r.get('position_match', 0):6.3f} {r['offline_tokens_per_s']:7.1f} "
              f"{r.get('tokens_per_s_vs_fp32', 0):6.2f} {r['weight_bytes'] / 2**20:6.0f} {r['load_s']:6.1f}")
    result = {"model": args.model, "threads": torch.get_num_threads(), "compile": args.compile,
              "prompts": len(agree_prompts), "new_tokens": args.new_tokens,
              "ppl_text": f"first {args.ppl_tokens} tokens of CPython's LICENSE.txt",
              "offline_requests": args.requests, "offline_output_tokens": sum(work_lengths),
              "rows": rows}
    print(f"wrote {write_result(args.out, 'quant_quality', result)}")
    return result


if __name__ == "__main__":
    main()
