"""The same workload through tritonserver (gRPC streaming, ``client/``) and
through the in-process ``AsyncLLMEngine``: output tokens/s and median time to
first token, to show what the server path (Triton, the Python-backend stub,
gRPC, detokenised text) costs.

Both get the same text prompts (sized from a seeded Alpaca-like trace), the
same engine settings and the same arrival times: all at once (``inf``) for
throughput, and a Poisson rate for latency under load. Every request
generates exactly its trace output length (greedy, EOS ignored). The two runs
take turns, never overlapping, on the same CPU cores; the server's engine gets
the same number of torch threads (OMP_NUM_THREADS).
"""
import argparse
import asyncio
import math
import statistics
import tempfile
import time

from tqdm import tqdm

from loadtest import workloads

from . import plots
from .common import add_common_args, bench_model, set_threads, write_result


def engine_settings(model: str, args) -> dict:
    return dict(model=model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                enable_prefix_caching=False, dtype="float32", device="cpu")


def sampling(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def summarise(records, seconds: float) -> dict:
    tokens = sum(r["tokens"] for r in records)
    ttfts = [r["ttft"] for r in records if r["ttft"] is not None]
    return {"requests": len(records), "seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tokens_per_s": tokens / seconds if seconds else 0.0,
            "median_ttft_s": statistics.median(ttfts) if ttfts else None,
            "p90_ttft_s": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            "mean_latency_s": statistics.fmean(r["latency"] for r in records)}


async def drive(send, prompts, lengths, arrivals, desc: str):
    """Send request i at ``arrivals[i]`` through ``send(i) -> async iterator of
    (new_tokens, text)``; record its first-token time, latency and tokens."""
    bar = tqdm(total=len(prompts), desc=desc, leave=False)
    start = time.perf_counter()

    async def one(i):
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        sent = time.perf_counter()
        first, tokens, text = None, 0, []
        async for n, piece in send(i):
            if n and first is None:
                first = time.perf_counter() - sent
            tokens += n
            text.append(piece)
        bar.update(1)
        return {"ttft": first, "latency": time.perf_counter() - sent, "tokens": tokens,
                "text": "".join(text)}

    records = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    seconds = time.perf_counter() - start
    bar.close()
    return records, seconds


def run_in_process(settings: dict, prompts, lengths, arrival_sets) -> list:
    from pagedbackend import AsyncLLMEngine, SamplingParams
    from pagedbackend.config import EngineConfig
    engine = AsyncLLMEngine(EngineConfig(**settings))
    engine.wait_for_compile()   # the compiled step, as in the server
    out = []
    try:
        for _ in engine.add_request("warm-up", prompts[0], SamplingParams(**sampling(4))):
            pass
        for k, arrivals in enumerate(arrival_sets):
            def send(i, k=k):
                params = SamplingParams(**sampling(lengths[i]))
                stream = engine.add_request(f"p{k}-{i}", prompts[i], params)

                async def deltas():
                    async for delta in stream:
                        if delta.error:
                            raise RuntimeError(delta.error)
                        o = delta.outputs[0]
                        yield len(o.token_ids), o.text
                return deltas()
            out.append(asyncio.run(drive(send, prompts, lengths, arrivals, "in-process")))
    finally:
        engine.shutdown()
    return out


def run_server(settings: dict, prompts, lengths, arrival_sets, threads: int) -> list:
    from client import generate, grpc_stream_async
    from loadtest.harness.triton import TritonServer
    from pagedbackend.serving.repository import make_model_repository
    import tritonclient.grpc.aio as aioclient

    out = []
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        repo = make_model_repository(tmp, settings)
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        with TritonServer(repo, env=env, ready_timeout_s=600,
                          wait_for_compiled_step=settings.get("compile", True)) as server:
            generate(prompts[0], sampling(4), url=server.grpc_url, timeout=120)   # warm-up
            for arrivals in arrival_sets:
                async def go(arrivals=arrivals):
                    client = aioclient.InferenceServerClient(server.grpc_url)

                    def send(i):
                        async def deltas():
                            async for d in grpc_stream_async(prompts[i], sampling(lengths[i]),
                                                             url=server.grpc_url, client=client,
                                                             timeout=600):
                                yield d.num_tokens, d.text
                        return deltas()
                    try:
                        return await drive(send, prompts, lengths, arrivals, "tritonserver")
                    finally:
                        await client.close()
                out.append(asyncio.run(go()))
    return out


def plot(result: dict, out_dir: str):
    fig, (a, b) = plots.figure(ncols=2, width=5.0, height=4.0)
    labels = [p["label"] for p in result["points"]]
    plots.grouped_bars(a, labels, {s: [p[s]["output_tokens_per_s"] for p in result["points"]]
                                   for s in ("in_process", "server")}, ylabel="output tokens/s")
    plots.grouped_bars(b, labels, {s: [1000 * (p[s]["median_ttft_s"] or 0) for p in result["points"]]
                                   for s in ("in_process", "server")}, ylabel="median TTFT (ms)")
    return plots.save(fig, out_dir, "server",
                      f"tritonserver vs in-process engine ({result['model']} model, CPU)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny",
                    help="'tiny' (fast; shows the server overhead), 'default' or a folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rates", default="inf,4", help="arrival rates in req/s; inf sends all at once")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rates = 8, "inf"
    set_threads(args.threads)
    started = time.perf_counter()
    model = bench_model(args.model)
    from transformers import AutoTokenizer
    from pagedbackend.models.default_model import resolve_model_path
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model), local_files_only=True)
    trace = workloads.alpaca_like(args.requests, args.seed)
    prompts = workloads.make_text_prompts(trace, tokenizer, args.seed)
    lengths = [r.output_len for r in trace]
    rates = [float(r) for r in args.rates.split(",")]
    arrival_sets = [workloads.poisson_arrivals(r, len(trace), args.seed) for r in rates]
    settings = engine_settings(model, args)

    local = run_in_process(settings, prompts, lengths, arrival_sets)
    try:
        remote = run_server(settings, prompts, lengths, arrival_sets, args.threads)
        error = None
    except Exception as exc:  # no tritonserver here, or it failed: report the in-process half
        remote, error = None, f"{type(exc).__name__}: {exc}"
        print(f"tritonserver run failed: {error}")
    points = []
    for k, rate in enumerate(rates):
        point = {"rate": "inf" if math.isinf(rate) else rate,
                 "label": "all at once" if math.isinf(rate) else f"{rate:g} req/s",
                 "in_process": summarise(*local[k])}
        if remote is not None:
            point["server"] = summarise(*remote[k])
            same = sum(a["text"] == b["text"] for a, b in zip(local[k][0], remote[k][0]))
            point["same_text"] = same / len(prompts)
        points.append(point)
        for side in ("in_process", "server"):
            if side in point:
                s = point[side]
                print(f"{point['label']:12s} {side:10s} {s['output_tokens_per_s']:7.1f} tokens/s, "
                      f"median TTFT {1000 * s['median_ttft_s']:.0f} ms, "
                      f"mean latency {s['mean_latency_s']:.2f} s")
    result = {"model": args.model, "requests": args.requests, "settings": {**settings, "model": args.model},
              "prompt_tokens_approx": sum(r.prompt_len for r in trace), "points": points,
              "server_error": error, "seconds": round(time.perf_counter() - started, 1)}
    path = write_result(args.out, "server", result)
    if remote is not None:
        print(f"wrote {path} and {plot(result, args.out)}")
    else:
        print(f"wrote {path} (no figure: the server half did not run)")
    if error:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
