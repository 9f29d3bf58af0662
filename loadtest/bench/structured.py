"""Structured outputs: what a JSON-schema constraint costs a decoding batch,
and how long grammars take to compile.

One in-process engine on the default model decodes ``--concurrency``
requests at once, greedy, the same chat prompts with a JSON schema
constraint and without, in paired rounds (the order alternates; one
unmeasured round first compiles the grammar and warms the step). The figure
is decode throughput at full batch: generated tokens over step time, summed
over the steps that decode every request and nothing else (a constrained
request may finish earlier; those steps do not count), plus the time spent
filling and applying the grammar masks. Then grammar compile times for a
small and a large schema, each compiled cold (a distinct schema each time,
so the cache never answers).
"""
import argparse
import json
import statistics
import time

from pagedbackend import LLMEngine, SamplingParams
from pagedbackend.config import EngineConfig

from .common import add_common_args, bench_model, set_threads, write_result

TOPICS = ["a novel", "a city", "a recipe", "a film", "a mountain", "a river", "a painter", "a song",
          "a planet", "a bird", "a car", "a museum", "a sport", "a language", "a festival", "a bridge"]
# Open strings and an open array, so constrained outputs run about as long as free ones.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "summary": {"type": "string"},
    "facts": {"type": "array", "items": {"type": "string"}}}, "required": ["title", "summary", "facts"]}


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts(n: int) -> list:
    return [chat(f"Describe {TOPICS[i % len(TOPICS)]} (number {i}) as JSON with a title, a long "
                 "summary and a list of facts.") for i in range(n)]


def large_schema(tag: int, properties: int = 60) -> dict:
    """A wide, nested schema: strings with patterns, bounded numbers, enums, arrays of objects."""
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0, "maximum": 1000},
             {"type": "number", "minimum": -1, "maximum": 1}, {"enum": ["low", "mid", "high"]},
             {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}, {"type": "boolean"},
             {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
                 "id": {"type": "integer"}, "name": {"type": "string"}}, "required": ["id", "name"]}}]
    props = {f"field_{tag}_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)[:properties // 2]}


def small_schema(tag: int) -> dict:
    # Property names carry the tag: xgrammar caches compiled schemas by their structure.
    return {"type": "object", "properties": {
        f"name_{tag}": {"type": "string", "maxLength": 20}, f"age_{tag}": {"type": "integer", "minimum": 0,
                                                                            "maximum": 120}},
        "required": [f"name_{tag}", f"age_{tag}"]}


def run_batch(engine: LLMEngine, texts: list, max_tokens: int, constrained: bool, tag: str) -> dict:
    """Decode ``texts`` together; full-batch decode tokens/s and mask time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs={"json": SCHEMA} if constrained else None)
    for i, text in enumerate(texts):
        engine.add_request(f"{tag}-{i}", text, params)
    full = len(texts)
    tokens = seconds = masked = 0.0
    steps = 0
    generated_before = engine.stats.generation_tokens
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        mask_before = engine.sampler.mask_seconds
        engine.step()
        if running == full and engine.stats.last_step_tokens == full:   # decodes only, every request
            tokens += full
            seconds += engine.last_step_seconds
            masked += engine.sampler.mask_seconds - mask_before
            steps += 1
    return {"decode_tok_s": tokens / seconds if seconds else float("nan"), "full_batch_steps": steps,
            "step_ms": 1000 * seconds / steps if steps else float("nan"),
            "mask_ms_per_step": 1000 * masked / steps if steps else float("nan"),
            "generated_tokens": engine.stats.generation_tokens - generated_before}


def compile_times(engine: LLMEngine, make, count: int) -> list:
    from pagedbackend.structured.params import StructuredOutputsParams
    times = []
    for i in range(count):
        spec = StructuredOutputsParams.build({"json": make(int(time.time() * 1e6) + i)})
        job = engine.grammars.submit(spec)
        job.future.result()
        times.append(job.seconds)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench structured", description=__doc__)
    add_common_args(ap, threads=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", choices=["true", "false"], default="true",
                    help="the compiled model step, as the server runs it once it has taken over")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.max_tokens, args.rounds = min(args.concurrency, 8), min(args.max_tokens, 16), 1
    set_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=bench_model(args.model), num_kv_blocks=2048,
                                    max_num_seqs=args.concurrency, compile=args.compile == "true"))
    texts = prompts(args.concurrency)
    run_batch(engine, texts, args.max_tokens, True, "warm")   # compiles the grammar and warms the step
    rounds = []
    for r in range(args.rounds):
        pair = {}
        for constrained in ((False, True) if r % 2 == 0 else (True, False)):
            pair["json_schema" if constrained else "free"] = run_batch(
                engine, texts, args.max_tokens, constrained, f"r{r}-{int(constrained)}")
        pair["ratio"] = pair["json_schema"]["decode_tok_s"] / pair["free"]["decode_tok_s"]
        rounds.append(pair)
        print(f"round {r}: free {pair['free']['decode_tok_s']:.1f} tok/s "
              f"({pair['free']['step_ms']:.1f} ms/step), json_schema "
              f"{pair['json_schema']['decode_tok_s']:.1f} tok/s ({pair['json_schema']['step_ms']:.1f} ms/step, "
              f"masks {pair['json_schema']['mask_ms_per_step']:.2f} ms), ratio {pair['ratio']:.3f}", flush=True)
    count = 1 if args.quick else 3
    small, large = compile_times(engine, small_schema, count), compile_times(engine, large_schema, count)
    result = {"model": args.model, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "compile_step": args.compile == "true", "rounds": rounds,
              "ratio_median": statistics.median(p["ratio"] for p in rounds),
              "mask_share_median": statistics.median(
                  p["json_schema"]["mask_ms_per_step"] / p["json_schema"]["step_ms"] for p in rounds),
              "compile_s_small": small, "compile_s_large": large,
              "large_schema_properties": len(large_schema(0)["properties"])}
    print(f"json_schema / free decode throughput at {args.concurrency} requests: median "
          f"{result['ratio_median']:.3f} over {len(rounds)} paired rounds; masks "
          f"{100 * result['mask_share_median']:.1f} % of a constrained step")
    print(f"grammar compile: small schema {statistics.median(small) * 1000:.0f} ms, large "
          f"({result['large_schema_properties']} properties) {statistics.median(large) * 1000:.0f} ms (medians)")
    print(f"wrote {write_result(args.out, 'structured', result)}")
    engine.grammars.shutdown()
    return result


if __name__ == "__main__":
    main()
