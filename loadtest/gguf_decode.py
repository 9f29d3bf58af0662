"""One-stream decode speed per GGUF format on a random Llama-shaped checkpoint.

``python -m loadtest.gguf_decode [--hidden 1024 --layers 8 --intermediate 2816]``
writes the checkpoint as Q8_0, Q4_0 and Q4_K_M GGUF files (``tiny_gguf``) and
as a float32 safetensors folder, then times one stream per format: decode
tok/s as (time of ``--long`` new tokens - time of ``--short``) over the
difference, eager steps, the best of ``--repeats`` runs, formats interleaved.
"""
import argparse
import json
import pathlib
import tempfile
import time

import torch


def build(folder: pathlib.Path, hidden: int, layers: int, intermediate: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    from loadtest.tiny_gguf import FAMILIES, tiny_tokenizer, write_gguf
    _, arch, settings = FAMILIES["llama"]
    settings = dict(settings, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                    num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128)
    config = AutoConfig.for_model("llama", **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    cfg = {**config.to_dict(), "head_dim": 64, "rope_theta": 10000.0}
    files = {scheme: write_gguf(folder / f"bench-{scheme}.gguf", model.state_dict(), cfg, arch, scheme)
             for scheme in ("Q8_0", "Q4_0", "Q4_K_M")}
    model.save_pretrained(folder / "fp32")
    path = folder / "bench-Q8_0.gguf"
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder / "fp32")
    files["fp32 (packed)"] = folder / "fp32"
    return files


def decode_rate(llm, short: int, long: int) -> float:
    from pagedbackend import SamplingParams
    prompt = [[5 + i % 300 for i in range(16)]]

    def run(n):
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start
    run(4)
    return (long - short) / (run(long) - run(short))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--short", type=int, default=17)
    parser.add_argument("--long", type=int, default=81)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from pagedbackend import LLM
    with tempfile.TemporaryDirectory() as scratch:
        files = build(pathlib.Path(scratch), args.hidden, args.layers, args.intermediate)
        llms = {name: LLM(model=str(path), compile=False, num_kv_blocks=64) for name, path in files.items()}
        best = {name: 0.0 for name in files}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                best[name] = max(best[name], decode_rate(llm, args.short, args.long))
        sizes = {name: (path.stat().st_size if path.is_file() else
                        sum(f.stat().st_size for f in path.glob("*.safetensors"))) / 2 ** 20
                 for name, path in files.items()}
    print(json.dumps({"threads": torch.get_num_threads(), "shape": vars(args)}))
    print(f"{'format':>14} {'MiB':>8} {'decode tok/s':>13}")
    for name in files:
        print(f"{name:>14} {sizes[name]:8.1f} {best[name]:13.1f}")


if __name__ == "__main__":
    main()
