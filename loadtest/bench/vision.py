"""Vision-language serving: a LLaVA-shaped random checkpoint of ~0.5 B
(a CLIP ViT tower, a Llama decoder), images through ``LLM.generate`` with
vLLM's prompt dicts, beside Hugging Face ``generate`` on the same folder.

- Concurrency 1, 8 and 32: that many requests at once, each with an image
  of its own (seeded, never seen before: the vision tower runs for each), the
  same short question, ``--max-tokens`` output tokens with EOS ignored. Our
  engine takes them all at once (continuous batching); HF runs them as one
  batch padded on the left, at the sizes in ``--hf-batches``. TTFT is from
  handing the requests over (the processor included) to each one's first
  token; output tok/s counts the requested tokens over the whole run.
- The encoder cache: a new image with question A (cold), then the same
  image with question B (the question comes before the image, so no prefix
  block holds the image: its placeholders are computed again, but the
  tower's embeddings come from the encoder cache), then B again (the whole
  prompt in the prefix cache). The tower's run count proves the skip.

Both run fp32, our step eager (``compile=False``, as HF's is; the engine's
default compiles: ``--compile``). Each round runs every case ``--pairs``
times, ours then HF's on the same images; ratios are medians of the pairs'.
"""
import argparse
import os
import statistics
import subprocess
import time
from typing import Dict, List

import torch

from .common import add_common_args, built_once, set_threads, write_result

# The bench checkpoint's shape: text and vision settings over loadtest.tiny_vision's LLaVA.
SHAPE = dict(
    text=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=30, num_attention_heads=16,
              num_key_value_heads=8, max_position_embeddings=2048),
    vision=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                image_size=224, patch_size=14, projection_dim=512),
    std=0.02)
QUESTIONS = ("What is in this picture?", "Which colours stand out, and where?")


def cpu_model() -> str:
    """lscpu's model name (the machine the figures are of)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def checkpoint(model: str) -> str:
    """``default``: the bench's LLaVA (built once into the cache); ``tiny``:
    tiny_vision's own; anything else is a folder."""
    if model not in ("default", "tiny"):
        return model
    from loadtest.tiny_vision import build_tiny_vision
    from pagedbackend.config import cache_root
    shape = SHAPE if model == "default" else {}
    path = cache_root() / "bench-vision" / f"llava-{model}"
    return str(built_once(path, lambda scratch: build_tiny_vision(scratch, "llava", **shape)))


def describe(folder: str, hf) -> Dict:
    """The checkpoint's shape in words and numbers."""
    v, t = hf.config.vision_config, hf.config.text_config
    per_image = (v.image_size // v.patch_size) ** 2
    tower = sum(p.numel() for p in hf.model.vision_tower.parameters())
    total = sum(p.numel() for p in hf.parameters())
    decoder = sum(p.numel() for p in hf.model.language_model.parameters()) + hf.lm_head.weight.numel()
    words = (f"LLaVA {total / 1e9:.2f} B fp32: CLIP ViT {v.num_hidden_layers} x {v.hidden_size} at "
             f"{v.image_size} px / {v.patch_size} = {per_image} image tokens ({tower / 1e6:.0f} M), "
             f"Llama {t.num_hidden_layers} x {t.hidden_size} (heads {t.num_attention_heads}/"
             f"{t.num_key_value_heads}, MLP {t.intermediate_size}, vocab {t.vocab_size}) {decoder / 1e9:.2f} B")
    return {"words": words, "params": total, "tower_params": tower, "decoder_params": decoder,
            "image_tokens": per_image}


def prompt(question: str) -> str:
    # The question before the image: another question changes every block from the image on.
    return f"USER: {question}\n<image>\nASSISTANT:"


def image(seed: int):
    from loadtest.tiny_vision import random_image
    return random_image(seed, 320, 240)


def run_ours(llm, seeds: List[int], question: str, max_tokens: int) -> Dict:
    from pagedbackend import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    requests = [{"prompt": prompt(question), "multi_modal_data": {"image": [image(s)]}} for s in seeds]
    rows = llm.engine.runner.image_rows
    runs = rows.encoded_images
    start = time.time()
    outs = llm.generate(requests, params)
    seconds = time.time() - start
    return {"seconds": seconds, "ttft_s": statistics.mean(o.metrics.first_token_time - start for o in outs),
            "tok_s": len(seeds) * max_tokens / seconds, "tower_runs": rows.encoded_images - runs,
            "cached_prompt_tokens": statistics.mean(o.metrics.num_cached_prompt_tokens for o in outs),
            "prompt_tokens": len(outs[0].prompt_token_ids), "tokens": [o.outputs[0].token_ids for o in outs]}


class FirstToken:
    """A generate streamer that notes when the first new tokens arrive (its
    first ``put`` is the prompt)."""
    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.time()

    def end(self) -> None:
        pass


def run_hf(hf, processor, seeds: List[int], question: str, max_tokens: int) -> Dict:
    start = time.time()
    inputs = processor(text=[prompt(question)] * len(seeds), images=[image(s) for s in seeds],
                       padding=True, return_tensors="pt")
    streamer = FirstToken()
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                          streamer=streamer, pad_token_id=processor.tokenizer.pad_token_id)
    seconds = time.time() - start
    width = inputs["input_ids"].shape[1]
    return {"seconds": seconds, "ttft_s": streamer.first - start, "tok_s": len(seeds) * max_tokens / seconds,
            "tokens": [row[width:].tolist() for row in out]}


def vllm_status() -> str:
    """Why vLLM's CPU build was not run beside us (it runs only where this venv imports it)."""
    try:
        import vllm   # noqa: F401
    except Exception as exc:   # any import failure is the reason
        return f"not run: `import vllm` fails in this venv ({type(exc).__name__}: {exc})"
    return "not run: vllm imports here, but this bench has no vLLM runner yet"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(pairs: Dict[int, List[Dict]], encoder: List[Dict]) -> Dict:
    """Medians over pairs per concurrency; ratios are medians of each pair's."""
    rows = []
    for c, runs in pairs.items():
        row = {"concurrency": c, "pairs": len(runs)}
        for side in ("ours", "hf"):
            for key in ("ttft_s", "tok_s"):
                row[f"{side}_{key}"] = median(r[side][key] if r.get(side) else None for r in runs)
        with_hf = [r for r in runs if r.get("hf")]
        row["tok_s_ours_over_hf"] = median(r["ours"]["tok_s"] / r["hf"]["tok_s"] for r in with_hf)
        row["ttft_hf_over_ours"] = median(r["hf"]["ttft_s"] / r["ours"]["ttft_s"] for r in with_hf)
        row["same_tokens_as_hf"] = (sum(a == b for r in with_hf for a, b in zip(r["ours"]["tokens"], r["hf"]["tokens"]))
                                    / sum(len(r["ours"]["tokens"]) for r in with_hf)) if with_hf else None
        rows.append(row)
    cache_rows = []
    for case, label in (("cold", "new image, question A"),
                        ("encoder", "same image, question B (encoder cache)"),
                        ("prefix", "same image, question B again (prefix cache)")):
        cache_rows.append({"case": case, "what": label,
                           "ttft_ms": 1000 * median(e[case]["ttft_s"] for e in encoder),
                           "over_cold": median(e[case]["ttft_s"] / e["cold"]["ttft_s"] for e in encoder),
                           "tower_runs": sum(e[case]["tower_runs"] for e in encoder),
                           "requests": len(encoder),
                           "cached_prompt_tokens": median(e[case]["cached_prompt_tokens"] for e in encoder),
                           "prompt_tokens": encoder[0][case]["prompt_tokens"]})
    return {"rows": rows, "encoder_rows": cache_rows}


def table(result: Dict) -> str:
    def f(value, form):
        return "-" if value is None else format(value, form)
    lines = ["| requests at once | ours TTFT s | ours tok/s | HF TTFT s | HF tok/s | ours / HF tok/s "
             "| HF / ours TTFT | same tokens as HF |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {f(r['ours_ttft_s'], '.2f')} | {f(r['ours_tok_s'], '.2f')} "
                     f"| {f(r['hf_ttft_s'], '.2f')} | {f(r['hf_tok_s'], '.2f')} "
                     f"| {f(r['tok_s_ours_over_hf'], '.2f')} | {f(r['ttft_hf_over_ours'], '.2f')} "
                     f"| {f(r['same_tokens_as_hf'], '.0%')} |")
    lines += ["", "| one request | ours TTFT ms | / cold | tower runs | prompt tokens from the prefix cache |",
              "|---|---|---|---|---|"]
    for r in result["encoder_rows"]:
        lines.append(f"| {r['what']} | {r['ttft_ms']:.0f} | {r['over_cold']:.2f} | {r['tower_runs']} "
                     f"of {r['requests']} | {r['cached_prompt_tokens']:.0f} of {r['prompt_tokens']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench vision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default",
                    help="'default' (the ~0.5 B LLaVA built here), 'tiny' or a LLaVA folder")
    ap.add_argument("--concurrency", default="1,8,32", help="requests at once, each with its own image")
    ap.add_argument("--hf-batches", default="1,8", help="the concurrencies HF generate runs (one padded batch)")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (EOS ignored)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every case")
    ap.add_argument("--pairs", type=int, default=3, help="pairs (ours, HF) per case and round")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0, help="our KV cache (room for 32 requests)")
    ap.add_argument("--compile", action="store_true", help="our step compiled (torch.compile)")
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.pairs, args.concurrency, args.hf_batches = "tiny", 1, 1, "1,4", "1,4"
    set_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor
    from loadtest.tiny_vision import load_hf
    from pagedbackend import LLM

    started = time.perf_counter()
    folder = checkpoint(args.model)
    hf, processor = load_hf(folder), AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    shape = describe(folder, hf)
    machine = cpu_model()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    hf_batches = {int(c) for c in args.hf_batches.split(",")}
    llm = LLM(model=folder, dtype="float32", compile=args.compile, max_num_seqs=max(concurrency),
              kv_cache_bytes=int(args.kv_cache_gib * 2 ** 30))
    print(f"{shape['words']}\nmachine: {machine}, {torch.get_num_threads()} torch threads; our step "
          f"{'compiled' if llm.engine.runner.compiled_step else 'eager'}, HF eager", flush=True)
    load_before = os.getloadavg()[:1]   # other processes on the machine: the figures are beside them
    seed = iter(range(args.seed * 1_000_000, (args.seed + 1) * 1_000_000))
    warm = [next(seed)]
    run_ours(llm, warm, QUESTIONS[0], 2), run_hf(hf, processor, warm, QUESTIONS[0], 2)   # warm-up
    pairs: Dict[int, List[Dict]] = {c: [] for c in concurrency}
    encoder: List[Dict] = []
    for r in range(args.rounds):
        for c in concurrency:
            for _ in range(args.pairs):
                seeds = [next(seed) for _ in range(c)]
                ours = run_ours(llm, seeds, QUESTIONS[0], args.max_tokens)
                theirs = run_hf(hf, processor, seeds, QUESTIONS[0], args.max_tokens) if c in hf_batches else None
                pairs[c].append({"ours": ours, "hf": theirs})
                print(f"round {r + 1} x{c}: ours TTFT {ours['ttft_s']:.2f} s {ours['tok_s']:.2f} tok/s"
                      + (f"; HF TTFT {theirs['ttft_s']:.2f} s {theirs['tok_s']:.2f} tok/s" if theirs else ""),
                      flush=True)
        for _ in range(args.pairs):
            one = [next(seed)]
            encoder.append({"cold": run_ours(llm, one, QUESTIONS[0], 1), "encoder": run_ours(llm, one, QUESTIONS[1], 1),
                            "prefix": run_ours(llm, one, QUESTIONS[1], 1)})
            print(f"round {r + 1} encoder cache: TTFT cold / same image / whole prompt "
                  + " / ".join(f"{1000 * encoder[-1][k]['ttft_s']:.0f}" for k in ("cold", "encoder", "prefix"))
                  + " ms", flush=True)
    llm.shutdown()
    load = [round(x, 1) for x in (load_before + os.getloadavg()[:1])]
    result = {"model": args.model, "shape": shape, "cpu_model": machine, "compiled": args.compile,
              "load_average_1min_before_after": load,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "pairs": args.pairs,
              "prompt_tokens": pairs[concurrency[0]][0]["ours"]["prompt_tokens"],
              **summarise(pairs, encoder), "vllm": vllm_status(),
              "seconds": round(time.perf_counter() - started, 1)}
    print(f"\n{shape['words']}; {result['prompt_tokens']}-token prompts, {args.max_tokens} out, "
          f"{args.rounds} rounds x {args.pairs} pairs; {machine}, load average {load[0]} -> {load[1]}\n{table(result)}\nvLLM's CPU build: {result['vllm']}")
    print(f"wrote {write_result(args.out, 'vision', result)}")
    return result


if __name__ == "__main__":
    main()
