"""Our engine beside the CPU serving peers, on the same machine and workload.

Offline: the same seeded Alpaca-like requests as token ids (greedy, EOS
ignored, every request queued at once) through our ``LLM.generate``, vLLM's
CPU build (``LLM.generate`` in its own Python, ``vllm_offline.py``) and
llama.cpp's ``llama-server`` (every request posted at once to ``/completion``,
one GGUF after another). Output tokens/s counts the tokens each request asked for.
Our engine and vLLM first run a warm-up batch: prompts of the same sizes from
the next seed, all at once, a few tokens each.

Serving: text prompts sized from a seeded Alpaca-like trace, sent at a seeded
Poisson rate through each server's HTTP streaming API (``peer_servers.py``):
time to first token (TTFT), time per output token after the first (TPOT, per
request) and inter-token latency (ITL, gaps between token-bearing events),
bounded in request count and in time (requests still open at the limit are
counted as unfinished).

A peer is found through a flag or an environment variable (``--vllm-python`` /
``BENCH_VLLM_PYTHON``, ``--llama-server`` / ``BENCH_LLAMA_SERVER``, ``--gguf``
/ ``BENCH_GGUF``, comma-separated); a missing one is skipped with a message.
Every system gets the same number of threads, one at a time on the same cores.
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional

from loadtest import workloads

from . import peer_servers, plots
from .common import bench_model, set_threads, write_result

VLLM_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_offline.py")
# Tokens each warm-up prompt generates before the timed offline run.
WARM_TOKENS = 4


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _executable(path: Optional[str]) -> Optional[str]:
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return None


def find_peers(args) -> Dict[str, object]:
    """The peers present, and a message for each one that is not."""
    found, missing = {}, []
    vllm_python = _executable(args.vllm_python)
    if vllm_python:
        found["vllm"] = vllm_python
    else:
        missing.append(f"vLLM: no Python at {args.vllm_python!r} (--vllm-python / BENCH_VLLM_PYTHON)")
    server = _executable(args.llama_server)
    ggufs = [g for g in (args.gguf or "").split(",") if g]
    present = [g for g in ggufs if os.path.isfile(g)]
    if server and present:
        found["llama"] = (server, present)
    if not server:
        missing.append(f"llama.cpp: no llama-server at {args.llama_server!r} "
                       "(--llama-server / BENCH_LLAMA_SERVER)")
    elif not present:
        missing.append(f"llama.cpp: no GGUF file in {args.gguf!r} (--gguf / BENCH_GGUF)")
    for g in set(ggufs) - set(present):
        missing.append(f"llama.cpp: GGUF {g!r} not found")
    return {"found": found, "skipped": missing}


def gguf_label(path: str) -> str:
    name = os.path.basename(path).lower()
    for kind in ("q4_0", "q4_1", "q4_k", "q5", "q8_0", "f16", "bf16", "f32"):
        if kind in name:
            return f"llama.cpp {kind.upper() if kind.startswith('q') else kind}"
    return f"llama.cpp {os.path.basename(path)}"


def row(system: str, seconds: float, tokens: List[List[int]], lengths, reference=None, **extra) -> dict:
    """One offline result; ``same_first_8`` compares with our tokens."""
    useful = sum(min(len(t), n) for t, n in zip(tokens, lengths))
    out = {"system": system, "seconds": round(seconds, 2), "output_tokens": useful,
           "output_tokens_per_s": useful / seconds if seconds else 0.0, **extra}
    if reference is not None:
        out["same_first_8_tokens_as_ours"] = sum(
            a[:8] == b[:8] for a, b in zip(tokens, reference)) / len(reference)
    return out


# ---------------------------------------------------------------- offline

def offline_report(label: str, result: dict) -> str:
    """One line for a system's offline row: its tokens/s, or why it failed."""
    if "error" in result:
        return f"offline {label}: failed: {result['error'].splitlines()[0]}"
    return f"offline {label}: {result['output_tokens_per_s']:.1f} tokens/s"


def offline_ours(model: str, prompts, lengths, max_num_seqs: int, compile_step: bool,
                 quantization: str = "none", warm_prompts=None) -> dict:
    """``warm_prompts`` run first, all at once for ``WARM_TOKENS`` tokens each
    (the first prompt alone when not given): the timed batch then meets no
    first-time work (graphs for its shapes, lazily built kernels)."""
    from pagedbackend import LLM, SamplingParams
    started = time.perf_counter()
    llm = LLM(model=model, max_num_seqs=max_num_seqs, compile=compile_step, quantization=quantization)
    init_s = time.perf_counter() - started
    llm.generate(warm_prompts or [prompts[0]],
                 SamplingParams(max_tokens=WARM_TOKENS, ignore_eos=True, temperature=0.0))
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    llm.shutdown()
    return {"seconds": seconds, "tokens": tokens, "init_s": round(init_s, 1)}


def offline_vllm(python: str, model_dir: str, prompts, lengths, threads: int, max_num_seqs: int,
                 env_file: Optional[str], timeout_s: float, warm_prompts=None) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as job:
        json.dump({"model": model_dir, "prompts": prompts, "lengths": lengths,
                   "max_num_seqs": max_num_seqs, "max_model_len": 2048,
                   "warm_prompts": warm_prompts or prompts[:1], "warm_tokens": WARM_TOKENS}, job)
    try:
        done = subprocess.run([python, VLLM_SCRIPT, job.name], capture_output=True, text=True,
                              env=peer_servers.vllm_env(threads, env_file, offline=True),
                              timeout=timeout_s)
    finally:
        os.unlink(job.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM offline run failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(lines[-1])
    result["init_s"] = round(result["init_s"], 1)
    return result


def offline_llama(server: peer_servers.Server, prompts, lengths, timeout_s: float) -> dict:
    peer_servers.complete_llama(server.url, prompts[0], 4, timeout_s)   # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = list(pool.map(lambda i: peer_servers.complete_llama(server.url, prompts[i], lengths[i],
                                                                     timeout_s), range(len(prompts))))
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


# ---------------------------------------------------------------- serving

def drive(stream: Callable[[int], object], arrivals: List[float], time_limit_s: float) -> List[dict]:
    """Request i at ``arrivals[i]`` (seconds) in a thread of its own; each event's
    token count is stamped on arrival. Stops waiting at ``time_limit_s``."""
    records = [{"sent": None, "events": [], "error": None, "done": False} for _ in arrivals]
    start = time.perf_counter()

    def one(i):
        time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        rec = records[i]
        rec["sent"] = time.perf_counter()
        try:
            for n in stream(i):
                if n:
                    rec["events"].append((time.perf_counter() - rec["sent"], n))
            rec["done"] = True
        except Exception as exc:   # recorded, counted as unfinished
            rec["error"] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(arrivals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, time_limit_s - (time.perf_counter() - start)))
    for rec in records:
        rec["elapsed"] = time.perf_counter() - start
    return records


def _pct(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def summarise(system: str, records: List[dict], lengths: List[int]) -> dict:
    done = [r for r in records if r["done"]]
    ttft = [r["events"][0][0] for r in records if r["events"]]
    tpot, itl = [], []
    for r in done:
        times = [t for t, _ in r["events"]]
        n = sum(k for _, k in r["events"])
        if n > 1:
            tpot.append((times[-1] - times[0]) / (n - 1))
        itl.extend(b - a for a, b in zip(times, times[1:]))
    tokens = sum(k for r in records for _, k in r["events"])
    last = max((r["sent"] + r["events"][-1][0] for r in records if r["events"]), default=None)
    first_sent = min((r["sent"] for r in records if r["sent"] is not None), default=None)
    seconds = (last - first_sent) if last and first_sent else 0.0
    ms = lambda v: None if v is None else round(1000 * v, 1)   # noqa: E731
    return {"system": system, "requests": len(records), "finished": len(done),
            "errors": sorted({r["error"] for r in records if r["error"]})[:3],
            "output_tokens": tokens, "requested_tokens": sum(lengths), "seconds": round(seconds, 2),
            "output_tokens_per_s": tokens / seconds if seconds else 0.0,
            "ttft_ms_p50": ms(_pct(ttft, 0.5)), "ttft_ms_p90": ms(_pct(ttft, 0.9)),
            "tpot_ms_p50": ms(_pct(tpot, 0.5)), "tpot_ms_p90": ms(_pct(tpot, 0.9)),
            "tpot_ms_mean": ms(statistics.fmean(tpot)) if tpot else None,
            "itl_ms_p50": ms(_pct(itl, 0.5)), "itl_ms_p90": ms(_pct(itl, 0.9))}


def serve_one(system: str, server: peer_servers.Server, stream, prompts, lengths, arrivals,
              time_limit_s: float) -> dict:
    with server:
        for _ in stream(0, 4):   # warm-up, not timed
            pass
        before = server.engine_counters() if server.engine_counters else None
        records = drive(lambda i: stream(i, lengths[i]), arrivals, time_limit_s)
        if before is not None:
            time.sleep(0.5)   # the server refreshes its counters every 0.2 s
            breakdown = peer_servers.step_breakdown(before, server.engine_counters())
    out = summarise(system, records, lengths)
    if before is not None:
        out.update(breakdown)
    out["ready_s"] = round(server.ready_s or 0.0, 1)
    return out


# ---------------------------------------------------------------- main

def plot(result: dict, out_dir: str):
    fig, (a, b) = plots.figure(ncols=2, width=5.6, height=4.2)
    rows = result["offline"]["rows"]
    plots.grouped_bars(a, [r["system"] for r in rows],
                       {"output tokens/s": [r["output_tokens_per_s"] for r in rows]},
                       ylabel="output tokens / s")
    a.set_title(f"offline: {result['offline']['requests']} requests, all at once", fontsize=9)
    serving = [r for r in result.get("serving", {}).get("rows", []) if "error" not in r]
    if serving:
        plots.grouped_bars(b, [r["system"] for r in serving],
                           {k: [r[f"{k}_ms_p50"] or 0 for r in serving] for k in ("ttft", "tpot", "itl")},
                           ylabel="median (ms)")
        b.set_title(f"serving: {result['serving']['requests']} requests at "
                    f"{result['serving']['rate']:g} req/s (Poisson)", fontsize=9)
    else:
        b.axis("off")
    return plots.save(fig, out_dir, "peers", f"Ours vs CPU peers, {result['model_name']}, "
                      f"{result['threads']} threads ({result['cpu_model']})")


def parse_args(argv=None):
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny' or a folder")
    ap.add_argument("--requests", type=int, default=32, help="offline requests")
    ap.add_argument("--serve-requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0, help="serving arrival rate, requests/s")
    ap.add_argument("--serve-time-limit", type=float, default=300.0, help="seconds per server run")
    ap.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="batch cap for ours and vLLM")
    ap.add_argument("--llama-slots", type=int, default=32, help="llama-server -np")
    ap.add_argument("--no-compile", action="store_true", help="our engine without torch.compile")
    ap.add_argument("--quantized", default="",
                    help="also our engine with these quantization settings, comma-separated "
                         "(int8, int4, w8a8), offline and serving")
    ap.add_argument("--int8", action="store_true", help="the same as --quantized int8")
    ap.add_argument("--offline-only", action="store_true")
    ap.add_argument("--vllm-python", default=env("BENCH_VLLM_PYTHON"), help="Python of vLLM's venv")
    ap.add_argument("--vllm-env", default=env("BENCH_VLLM_ENV"),
                    help="shell file of exports for vLLM (caches, threads), sourced by bash")
    ap.add_argument("--llama-server", default=env("BENCH_LLAMA_SERVER"), help="llama-server binary")
    ap.add_argument("--gguf", default=env("BENCH_GGUF"), help="GGUF files of the same model, comma-separated")
    ap.add_argument("--peer-timeout", type=float, default=900.0, help="seconds for one peer's offline run")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="threads for every system")
    ap.add_argument("--quick", action="store_true", help="4 requests each, 16 tokens at most")
    args = ap.parse_args(argv)
    from pagedbackend.quant import QUANTIZATION_MODES
    modes = [m for m in args.quantized.split(",") if m] + (["int8"] if args.int8 else [])
    for mode in modes:
        if mode not in QUANTIZATION_MODES[1:]:
            ap.error(f"--quantized takes {', '.join(QUANTIZATION_MODES[1:])}; got {mode!r}")
    args.quantized = list(dict.fromkeys(modes))
    if args.quick:
        args.requests, args.serve_requests, args.max_output = 4, 4, args.max_output or 16
        args.rate = max(args.rate, 8.0)
    return args


def main(argv=None):
    args = parse_args(argv)
    set_threads(args.threads)
    started = time.perf_counter()
    from pagedbackend.models.default_model import resolve_model_path
    model = bench_model(args.model)
    model_dir = str(resolve_model_path(model))
    peers = find_peers(args)
    for message in peers["skipped"]:
        print(f"skipped: {message}", flush=True)

    trace = workloads.alpaca_like(args.requests, args.seed)
    lengths = [min(r.output_len, args.max_output or r.output_len) for r in trace]
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    prompts = workloads.make_prompt_token_ids(trace, vocab, args.seed)
    # Warm-up prompts of the same sizes from another seed: no prefix is shared
    # with the timed ones, so the prefix caches do not shorten the timed run.
    warm = workloads.make_prompt_token_ids(trace, vocab, args.seed + 1)
    rows = []
    ours = offline_ours(model, prompts, lengths, args.max_num_seqs, not args.no_compile,
                        warm_prompts=warm)
    rows.append(row("ours", ours["seconds"], ours["tokens"], lengths, init_s=ours["init_s"]))
    print(f"offline ours: {rows[-1]['output_tokens_per_s']:.1f} tokens/s", flush=True)
    for mode in args.quantized:
        res = offline_ours(model, prompts, lengths, args.max_num_seqs, not args.no_compile, mode,
                           warm_prompts=warm)
        rows.append(row(f"ours {mode}", res["seconds"], res["tokens"], lengths, ours["tokens"],
                        init_s=res["init_s"]))
        print(f"offline ours {mode}: {rows[-1]['output_tokens_per_s']:.1f} tokens/s", flush=True)
    if "vllm" in peers["found"]:
        try:
            res = offline_vllm(peers["found"]["vllm"], model_dir, prompts, lengths, args.threads,
                               args.max_num_seqs, args.vllm_env, args.peer_timeout, warm)
            rows.append(row("vLLM CPU", res["seconds"], res["tokens"], lengths, ours["tokens"],
                            init_s=res["init_s"]))
        except Exception as exc:
            rows.append({"system": "vLLM CPU", "error": peer_servers.error_text(exc),
                         "output_tokens_per_s": 0.0})
        print(offline_report("vLLM", rows[-1]), flush=True)
    if "llama" in peers["found"]:
        binary, ggufs = peers["found"]["llama"]
        from loadtest.harness.triton import free_port
        for gguf in ggufs:
            label = gguf_label(gguf)
            try:
                with peer_servers.llama(binary, gguf, free_port(), args.threads,
                                        max(args.llama_slots, 1)) as server:
                    res = offline_llama(server, prompts, lengths, args.peer_timeout)
                rows.append(row(label, res["seconds"], res["tokens"], lengths, ours["tokens"], gguf=gguf))
            except Exception as exc:
                rows.append({"system": label, "error": peer_servers.error_text(exc),
                             "output_tokens_per_s": 0.0})
            print(offline_report(label, rows[-1]), flush=True)
    base = rows[0]["output_tokens_per_s"]
    for r in rows:
        r["vs_ours"] = r["output_tokens_per_s"] / base if base else None

    result = {"model": args.model, "model_name": os.path.basename(model_dir.rstrip("/")),
              "dtype": "float32", "threads": args.threads, "cpu_model": cpu_model(),
              "peers_skipped": peers["skipped"],
              "offline": {"requests": args.requests, "prompt_tokens": sum(len(p) for p in prompts),
                          "output_tokens": sum(lengths), "rows": rows,
                          "workload": "alpaca_like token ids, greedy, ignore_eos, all at once",
                          "warm_up": (f"{len(warm)} prompts of the same sizes from seed {args.seed + 1}, "
                                      f"{WARM_TOKENS} tokens each, all at once (ours and vLLM)")}}
    if not args.offline_only:
        result["serving"] = serving(args, model, model_dir, peers)
    result["seconds"] = round(time.perf_counter() - started, 1)
    path = write_result(args.out, "peers", result)
    print(f"wrote {path} and {plot(result, args.out)}")
    return result


def serving(args, model: str, model_dir: str, peers: dict) -> dict:
    from transformers import AutoTokenizer
    from loadtest.harness.triton import free_port
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    trace = workloads.alpaca_like(args.serve_requests, args.seed)
    prompts = workloads.make_text_prompts(trace, tokenizer, args.seed)
    lengths = [min(r.output_len, args.max_output or r.output_len) for r in trace]
    arrivals = workloads.poisson_arrivals(args.rate, len(trace), args.seed)
    limit, rows = args.serve_time_limit, []
    timeout = limit + 60
    settings = {"max_num_seqs": args.max_num_seqs, "compile": not args.no_compile, "device": "cpu"}

    def attempt(system, make_server, stream):
        try:
            rows.append(serve_one(system, make_server(), stream, prompts, lengths, arrivals, limit))
        except Exception as exc:
            rows.append({"system": system, "error": peer_servers.error_text(exc)})
        r = rows[-1]
        print(f"serving {system}: " + (f"TTFT p50 {r['ttft_ms_p50']} ms, TPOT p50 {r['tpot_ms_p50']} ms, "
              f"ITL p50 {r['itl_ms_p50']} ms, {r['finished']}/{r['requests']} finished"
              + (f"; in the server a step took {r['server_step_ms_mean']} ms (forward "
                 f"{r['server_forward_ms_mean']} ms) for {r['server_tokens_per_step']} tokens"
                 if "server_step_ms_mean" in r else "")
              if "error" not in r else r["error"][:300]), flush=True)

    for system, extra in [("ours", {})] + [(f"ours {m}", {"quantization": m}) for m in args.quantized]:
        with tempfile.TemporaryDirectory(prefix="peers-repo-") as repo_dir:
            port = free_port()
            attempt(system, lambda: peer_servers.ours(model, port, args.threads, {**settings, **extra}, repo_dir),
                    lambda i, n: peer_servers.stream_ours(f"http://127.0.0.1:{port}", prompts[i], n, timeout))
    if "vllm" in peers["found"]:
        vport = free_port()
        attempt("vLLM CPU", lambda: peer_servers.vllm(peers["found"]["vllm"], model_dir, vport, args.threads,
                                                      args.max_num_seqs, args.vllm_env),
                lambda i, n: peer_servers.stream_vllm(f"http://127.0.0.1:{vport}", model_dir,
                                                      prompts[i], n, timeout))
    if "llama" in peers["found"]:
        binary, ggufs = peers["found"]["llama"]
        for gguf in ggufs:
            lport = free_port()
            attempt(gguf_label(gguf), lambda: peer_servers.llama(binary, gguf, lport, args.threads,
                                                                 args.llama_slots),
                    lambda i, n: peer_servers.stream_llama(f"http://127.0.0.1:{lport}", prompts[i], n, timeout))
    return {"requests": args.serve_requests, "rate": args.rate, "time_limit_s": limit,
            "prompts": "text, alpaca_like lengths", "rows": rows}


if __name__ == "__main__":
    main()
