"""kv_formats: int8 KV row layouts the cache could use, simulated on the
default model (SmolLM2-135M, dtype float32), against the one it uses
(``kv_cache_dtype=int8``: a float16 scale per 16 channels, 72 bytes a row at
head size 64: 1.78x the tokens of bfloat16's 128). Narrower rows hold more
tokens at the same ``kv_cache_bytes``; what each costs in quality is what
this measures (docs/kv_cache_dtype.md, "Capacity").

Layouts (bytes a row at head size 64; values int8 in [-127, 127]):

- ``f16x16`` (72): today's, ``kv_cache_dtype.quantize_rows``.
- ``f16x32`` (68): a float16 scale per 32 channels, rounded up as today's.
- ``log4x16`` (67): one power-of-two exponent ``E`` a row (a byte) and a
  4-bit step ``e`` per 16 channels (two bytes): a group's scale is
  ``2^(E - e / 4)``, the smallest such at least its ``absmax / 127``; a group
  more than 15 quarter-octaves below the row's largest keeps the smallest.
- ``f16row`` (66): one float16 scale a row.

Parts:

- ``error``: the relative error (Frobenius norm) of the K and of the V rows
  the model's float32 cache holds after a text (a sampled continuation, 512
  tokens), each layout rounding them: the same rows for every layout, so
  the figure does not move between runs.
- ``quality``: greedy tokens of 32 prompts (32 each) and the perplexity of
  that text (scored in chunks of 32), each layout simulated: every row a step
  writes is stored rounded, decodes read their own row rounded, a prefill
  attends to its own K/V as computed (as the C kernels do). A simulation
  keeps its own count: with today's layout it kept 29 of 32 prompts where
  the engine's own int8 cache keeps 30, so compare layouts within one run.
"""
import argparse
import math
from typing import Callable, Dict

import torch

from pagedbackend.kernels.kv_cache_dtype import decode, int8_scales, quantize_rows

from .common import add_common_args, set_threads, write_result
from .kv_cache_dtype import PROMPTS


def _round_groups(x: torch.Tensor, group: int, scale_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x`` [..., d] in groups of ``group`` channels, each stored as int8
    values times the scale ``scale_of(absmax)`` gives (at least absmax / 127)."""
    g = x.float().unflatten(-1, (-1, group))
    scale = scale_of(g.abs().amax(dim=-1, keepdim=True))
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(g * inv).clamp_(-127, 127) * scale).flatten(-2)


def log4_fields(x: torch.Tensor, group: int = 16):
    """``log4x16``'s stored fields of rows ``x`` [..., d]: the row exponent
    ``E`` [..., 1, 1], the steps ``e`` [..., d / group, 1] (0..15) and the
    values [..., d / group, group] (int8 range), and the scales they make."""
    g = x.float().unflatten(-1, (-1, group))
    need = g.abs().amax(dim=-1, keepdim=True) / 127.0
    top = need.amax(dim=-2, keepdim=True)
    E = torch.ceil(torch.log2(top.clamp_min(2.0 ** -120)))
    e = torch.floor(4 * (E - torch.log2(need.clamp_min(2.0 ** -120)))).clamp_(0, 15)
    scale = torch.exp2(E - e / 4)
    short = scale < need   # exp2 a hair below log2's promise: the next step up
    e = torch.where(short, (e - 1).clamp_min(0), e)
    scale = torch.where(top > 0, torch.exp2(E - e / 4), torch.zeros_like(top))
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    values = torch.round(g * inv).clamp_(-127, 127)
    return E, e, values, scale


def _log4(x: torch.Tensor) -> torch.Tensor:
    _, _, values, scale = log4_fields(x)
    return (values * scale).flatten(-2)


def _f16_up(absmax: torch.Tensor) -> torch.Tensor:
    return int8_scales(absmax).float()


# name -> (bytes a row at head size d, rows rounded as the layout stores them)
LAYOUTS: Dict[str, tuple] = {
    "f16x16": (lambda d: d + 2 * d // 16, lambda x: decode(quantize_rows(x), torch.float32)),
    "f16x32": (lambda d: d + 2 * d // 32, lambda x: _round_groups(x, 32, _f16_up)),
    "log4x16": (lambda d: d + 1 + math.ceil(4 * (d // 16) / 8), _log4),
    "f16row": (lambda d: d + 2, lambda x: _round_groups(x, x.shape[-1], _f16_up)),
}


class _Rounding:
    """Stands in for the runner's K/V scales (``models.fp8_scales``): a
    decode step's new K/V are rounded before they are written (the kernel
    reads its own row back from the cache), a prefill's are left as computed."""

    def __init__(self, layout: str):
        self.round = LAYOUTS[layout][1]

    def apply(self, layer, k, v, scale):
        from pagedbackend.models.attention import current_step
        if current_step().meta.plan.decode_all:
            return self.round(k).to(k.dtype), self.round(v).to(v.dtype), scale, 1.0
        return k, v, scale, 1.0

    def step_done(self) -> bool:
        return False

    def arm(self) -> None:
        pass

    def describe(self) -> dict:
        return {}


def _simulate(llm, layout: str) -> None:
    """Every row the runner's steps write is stored as ``layout`` rounds it."""
    runner = llm.engine.runner
    runner.kv_scales = _Rounding(layout)
    rounding, execute = LAYOUTS[layout][1], runner.execute_model

    def rounded_execute(*args, **kwargs):
        out = execute(*args, **kwargs)
        with torch.inference_mode():
            for k_cache, v_cache in runner.kv_caches:   # idempotent on rows already rounded
                k_cache.copy_(rounding(k_cache))
                v_cache.copy_(rounding(v_cache))
        return out
    runner.execute_model = rounded_execute


def bench(layouts, prompts, max_tokens: int, text_tokens: int, parts) -> dict:
    from pagedbackend import LLM, SamplingParams
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    result, tokens, text = {"bytes_at_64": {n: LAYOUTS[n][0](64) for n in layouts}}, {}, None
    for name in ("float32",) + tuple(layouts if "quality" in parts else ()):
        with LLM(model="default", compile=False, dtype="float32", num_kv_blocks=128,
                 long_prefill_token_threshold=32) as llm:
            if text is None:   # the float32 cache's own continuation
                out = llm.generate(["Write a long story about a lighthouse keeper."],
                                   SamplingParams(max_tokens=text_tokens, temperature=0.8, seed=1, ignore_eos=True))[0]
                text = out.prompt_token_ids + out.outputs[0].token_ids
                if "error" in parts:   # the rows that text left in the cache (its blocks freed, not cleared)
                    k = torch.stack([kc for kc, _ in llm.engine.runner.kv_caches])
                    v = torch.stack([vc for _, vc in llm.engine.runner.kv_caches])
                    used = k.abs().flatten(3).sum(-1) > 0
                    k, v = k[used], v[used]
                    result["error"] = {n: {"k": ((LAYOUTS[n][1](k) - k).norm() / k.norm()).item(),
                                           "v": ((LAYOUTS[n][1](v) - v).norm() / v.norm()).item()}
                                       for n in layouts}
                    result["error_rows"] = int(k.shape[0] * k.shape[1])
                if "quality" not in parts:
                    break
            if name != "float32":
                _simulate(llm, name)
            outs = llm.generate(prompts, greedy)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            scored = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
            logprobs = [entry[tok].logprob for entry, tok in zip(scored.prompt_logprobs[1:], text[1:])]
            result.setdefault("quality", {})[name] = {"perplexity": math.exp(-sum(logprobs) / len(logprobs))}
    for name, row in result.get("quality", {}).items():
        pairs = list(zip(tokens[name], tokens["float32"]))
        row.update(prompts_equal=sum(a == b for a, b in pairs), prompts=len(pairs),
                   tokens_equal=sum(x == y for a, b in pairs for x, y in zip(a, b)),
                   tokens=sum(len(b) for _, b in pairs),
                   perplexity_change_pct=100 * (row["perplexity"] / result["quality"]["float32"]["perplexity"] - 1))
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench kv_formats", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="error,quality")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    layouts = tuple(args.layouts.split(","))
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {', '.join(unknown)}; the layouts are {', '.join(LAYOUTS)}")
    parts = tuple(args.parts.split(","))
    result = bench(layouts, PROMPTS[:4] if args.quick else PROMPTS, 8 if args.quick else 32,
                   64 if args.quick else 512, parts)
    result["threads"] = torch.get_num_threads()
    for name in layouts:
        line = f"{name} ({result['bytes_at_64'][name]} bytes at head size 64)"
        if "error" in result:
            line += f": K error {result['error'][name]['k']:.5f}, V error {result['error'][name]['v']:.5f}"
        row = result.get("quality", {}).get(name)
        if row:
            line += (f"; {row['prompts_equal']}/{row['prompts']} prompts, {row['tokens_equal']}/{row['tokens']} "
                     f"tokens equal, perplexity {row['perplexity_change_pct']:+.3f} %")
        print(line, flush=True)
    print(f"wrote {write_result(args.out, 'kv_formats', result)}")
    return result


if __name__ == "__main__":
    main()
