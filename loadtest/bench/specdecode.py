"""Speculative decoding as a client sees it: TPOT and output tokens/s of our
server with each ``speculative_config`` method against none, beside vLLM's CPU
build and llama.cpp's server in their speculative modes where they are
installed (``peers``' flags; a missing one is named and skipped).

Seeded, synthetic workloads (``spec_workloads.py``; no data set can be
downloaded here): ``copy`` (the tuning set), ``heldout`` (copy-heavy, written
apart and never tuned on), ``repeat`` (the same questions asked again by
other requests) and ``chat`` (open questions). Each is sent greedy, stopping
at EOS, at every ``--concurrency`` (a closed loop: that many streams, each
sending its next request when the last one ends); every run of ours carries
a ``cache_salt`` of its own, so no run finds another's answers or prefixes.
Every system runs in a server of its own, one after another; rounds repeat
the whole sequence, in turn order rotated, and the figures are medians over
rounds. Each row says how many outputs equal the same family's ``none``
output for the same prompt. Acceptance per draft position comes from the
servers' ``spec_decode_*`` counters (ours and vLLM's under ``vllm:``,
llama.cpp's under ``llamacpp:``). Modes: ours none / ngram / suffix /
self_int4; vLLM none / ngram; llama.cpp none / ngram-mod / its draft-simple
with the default model's Q4_1 GGUF as draft (the counterpart of self_int4).
"""
import argparse
import json
import statistics
import tempfile
import threading
import time
from typing import Callable, Dict, Iterator, List

from loadtest.harness.triton import free_port

from . import peer_servers
from .common import write_result
from .peers import _pct, cpu_model, find_peers
from .spec_workloads import WORKLOADS, chat_prompts, copy_prompts  # noqa: F401 (the workloads' names)

METHODS = {"none": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 4},
           "suffix": {"method": "suffix"},
           "self_int4": {"method": "self_int4", "num_speculative_tokens": 3}}


# ---------------------------------------------------------------- streams (greedy, stopping at EOS)

def stream_ours(url: str, prompt: str, max_tokens: int, timeout: float, salt: str = None) -> Iterator[tuple]:
    from client import http_stream
    params = {"max_tokens": max_tokens, "temperature": 0.0, **({"cache_salt": salt} if salt else {})}
    for delta in http_stream(prompt, params, url=url, exclude_input=True, timeout=timeout):
        yield delta.num_tokens, delta.text


def stream_vllm(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> Iterator[tuple]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    for event in peer_servers._events(url + "/v1/completions", body, timeout):
        for choice in event.get("choices", []):
            ids = choice.get("token_ids")
            yield (len(ids) if ids is not None else int(bool(choice.get("text")))), choice.get("text", "")


def stream_llama(url: str, prompt: str, max_tokens: int, timeout: float) -> Iterator[tuple]:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
            "stream": True, "return_tokens": True}
    for event in peer_servers._events(url + "/completion", body, timeout):
        ids = event.get("tokens")
        yield (len(ids) if ids is not None else int(bool(event.get("content")))), event.get("content", "")


def closed_loop(stream: Callable[[str], Iterator], prompts: List[str], concurrency: int) -> List[dict]:
    """``concurrency`` streams, each sending the next prompt when its last one
    ends. A stream yields new tokens per event: a count, or (count, text)."""
    records, lock, queue = [], threading.Lock(), list(enumerate(prompts))

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i, prompt = queue.pop(0)
            rec = {"i": i, "events": [], "error": None, "text": ""}
            sent = time.perf_counter()
            try:
                for n in stream(prompt):
                    n, text = n if isinstance(n, tuple) else (n, "")
                    rec["text"] += text
                    if n:
                        rec["events"].append((time.perf_counter() - sent, n))
            except Exception as exc:   # counted, named in the result
                rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["sent"], rec["done"] = sent, time.perf_counter()
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def summarise(records: List[dict]) -> dict:
    tpot = []
    for r in records:
        n = sum(k for _, k in r["events"])
        if n > 1 and not r["error"]:
            tpot.append((r["events"][-1][0] - r["events"][0][0]) / (n - 1))
    tokens = sum(k for r in records for _, k in r["events"])
    seconds = max(r["done"] for r in records) - min(r["sent"] for r in records)
    return {"requests": len(records), "errors": sorted({r["error"] for r in records if r["error"]})[:3],
            "output_tokens": tokens, "tok_s": round(tokens / seconds, 2) if seconds else 0.0,
            "tpot_ms_p50": round(1000 * _pct(tpot, 0.5), 2) if tpot else None,
            "tpot_ms_mean": round(1000 * statistics.fmean(tpot), 2) if tpot else None}


# ---------------------------------------------------------------- systems

def systems(args) -> Dict[str, Callable[[], tuple]]:
    """name -> a function that returns (server, stream(prompt, salt), metrics url or None)."""
    out = {}
    model_dir = args.model_dir
    for method in args.methods.split(","):
        def make(method=method):
            settings = {"max_num_seqs": max(64, max(args.concurrency)), "num_kv_blocks": 2048}
            if METHODS[method] is not None:
                settings["speculative_config"] = json.dumps(METHODS[method])
            repo = tempfile.mkdtemp(prefix="specdecode-repo-")
            server = peer_servers.ours(args.model, free_port(), args.threads, settings, repo)
            metrics_port = server.command[server.command.index("--metrics-port") + 1]
            return (server, lambda p, salt=None: stream_ours(server.url, p, args.max_tokens, args.timeout, salt),
                    f"http://{peer_servers.HOST}:{metrics_port}")
        out[f"ours/{method}"] = make
    peers = find_peers(args)
    for message in peers["skipped"]:
        print(f"skipped: {message}", flush=True)
    if "vllm" in peers["found"]:
        for name, spec in (("none", None), ("ngram", METHODS["ngram"])):
            def make(spec=spec):
                server = peer_servers.vllm(peers["found"]["vllm"], model_dir, free_port(), args.threads,
                                           max(64, max(args.concurrency)), env_file=args.vllm_env,
                                           speculative_config=spec)
                return (server, lambda p, salt=None: stream_vllm(server.url, model_dir, p, args.max_tokens,
                                                                 args.timeout), server.url)
            out[f"vllm/{name}"] = make
    if "llama" in peers["found"]:
        binary, ggufs = peers["found"]["llama"]
        # none; the Q4_1 GGUF of the same model as draft (our self_int4); draftless n-grams.
        modes = {"none": {}, "ngram": {"spec_type": "ngram-mod", "draft_max": 4}}
        if args.llama_draft:
            modes["draft_q4_1"] = {"draft_gguf": args.llama_draft, "draft_max": 3}
        for name, mode in modes.items():
            def make(mode=mode):
                server = peer_servers.llama(binary, ggufs[0], free_port(), args.threads, max(args.concurrency),
                                            **mode)
                return (server, lambda p, salt=None: stream_llama(server.url, p, args.max_tokens, args.timeout),
                        server.url)
            out[f"llama.cpp/{name}"] = make
    return out


def run_system(make, workloads: Dict[str, List[str]], concurrency: List[int], tag: str = "") -> dict:
    server, stream, metrics_url = make()
    rows = {}
    with server:
        for _ in stream(workloads["chat"][0] if "chat" in workloads else "Hello."):   # warm-up, not timed
            pass
        for workload, prompts in workloads.items():
            for c in concurrency:
                # One stream: half the prompts in turn (repeat: all of them, its repeats
                # are its point); c streams: at least two requests each.
                count = (len(prompts) if workload == "repeat" else max(2, len(prompts) // 2)) if c == 1 \
                    else max(len(prompts), 2 * c)
                salt = f"{workload}@{c}{tag}"   # no run finds another's answers or prefixes
                before = peer_servers.spec_counters(metrics_url)
                records = closed_loop(lambda p: stream(p, salt), [prompts[i % len(prompts)] for i in range(count)], c)
                row = summarise(records)
                row["texts"] = {str(r["i"] % len(prompts)): r["text"] for r in records if not r["error"]}
                time.sleep(0.5)   # servers refresh their counters every 0.2 s
                row["acceptance"] = peer_servers.draft_acceptance(before, peer_servers.spec_counters(metrics_url))
                rows[f"{workload}@{c}"] = row
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench specdecode", description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--methods", default="none,ngram,suffix,self_int4", help=f"ours: any of {', '.join(METHODS)}")
    ap.add_argument("--workloads", default="copy,heldout,repeat,chat", help=f"any of {', '.join(WORKLOADS)}")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=12, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-env", default=None, help="shell file of exports for vLLM (e.g. LD_PRELOAD of Intel "
                                                   "OpenMP, which its CPU speculative decoding asks for)")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--gguf", default=None, help="llama.cpp's target GGUF (f32 for a like-for-like run)")
    ap.add_argument("--llama-draft", default=None, help="llama.cpp's draft GGUF (the default model's Q4_1)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 48 tokens, concurrency 1 and 4, one round")
    args = ap.parse_args(argv)
    import os
    args.vllm_python = None if args.no_peers else (args.vllm_python or os.environ.get("BENCH_VLLM_PYTHON"))
    args.llama_server = None if args.no_peers else (args.llama_server or os.environ.get("BENCH_LLAMA_SERVER"))
    args.gguf = args.gguf or os.environ.get("BENCH_GGUF")
    args.vllm_env = args.vllm_env or os.environ.get("BENCH_VLLM_ENV")
    args.llama_draft = args.llama_draft or os.environ.get("BENCH_LLAMA_DRAFT")
    if args.quick:
        args.requests, args.max_tokens, args.rounds, args.concurrency = 4, 48, 1, "1,4"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def main(argv=None):
    args = parse_args(argv)
    from pagedbackend.models.default_model import resolve_model_path
    args.model_dir = str(resolve_model_path(args.model))
    workloads = {name: WORKLOADS[name](args.requests, args.seed) for name in args.workloads.split(",")}
    makers = systems(args)
    names = list(makers)
    per_round = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        results = {}
        for name in order:
            print(f"round {r}: {name}", flush=True)
            try:
                results[name] = run_system(makers[name], workloads, args.concurrency, tag=f"/{r}")
            except Exception as exc:   # a system that fails is reported, the rest still run
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"  failed: {results[name]['error'][:300]}", flush=True)
        per_round.append(results)
    table = summary_table(per_round, names)
    for line in table_lines(table):
        print(line)
    result = {"cpu": cpu_model(), "threads": args.threads, "concurrency": args.concurrency,
              "requests_per_workload": args.requests, "max_tokens": args.max_tokens, "rounds": per_round,
              "summary": table}
    print(f"wrote {write_result(args.out, 'specdecode', result)}")
    return result


def summary_table(per_round: List[dict], names: List[str]) -> List[dict]:
    """Medians over rounds per system and workload@concurrency; the ratios to
    the same system family's 'none' run are paired (one per round, their
    median); ``same_as_none``: outputs equal to none's for the same prompt."""
    rows = []
    keys = sorted({k for results in per_round for res in results.values() if "error" not in res for k in res})
    for name in names:
        family = name.split("/")[0]
        for key in keys:
            pairs = [(res[name][key], res.get(f"{family}/none", {}).get(key)) for res in per_round
                     if key in res.get(name, {})]
            runs = [run for run, _ in pairs]
            if not runs:
                continue
            med = lambda rs, f: statistics.median([r[f] for r in rs if r.get(f) is not None]) if any(r.get(f) is not None for r in rs) else None  # noqa: E731
            ratio = lambda f: statistics.median([r[f] / b[f] for r, b in pairs if b and r.get(f) and b.get(f)]) \
                if any(b and r.get(f) and b.get(f) for r, b in pairs) else None  # noqa: E731
            tpot, tok_s, tpot_ratio, tok_ratio = med(runs, "tpot_ms_p50"), med(runs, "tok_s"), \
                ratio("tpot_ms_p50"), ratio("tok_s")
            same = [r["texts"][i] == b["texts"][i] for r, b in pairs if b for i in r.get("texts", {})
                    if i in b.get("texts", {})]
            rates = [r["acceptance"]["acceptance_rate"] for r in runs if r.get("acceptance")]
            rows.append({"system": name, "run": key, "tpot_ms_p50": tpot, "tok_s": tok_s,
                         "tpot_vs_none": round(tpot_ratio, 3) if tpot_ratio else None,
                         "tok_s_vs_none": round(tok_ratio, 3) if tok_ratio else None,
                         "same_as_none": f"{sum(same)}/{len(same)}" if same else None,
                         "acceptance_rate": statistics.median(rates) if rates else None,
                         "accepted_per_position": next((r["acceptance"]["accepted_per_position"] for r in runs
                                                        if r.get("acceptance")), None),
                         "errors": sorted({e for r in runs for e in r["errors"]})})
    return rows


def table_lines(rows: List[dict]) -> List[str]:
    lines = [f"{'system':<22}{'run':<12}{'TPOT p50 ms':>12}{'tok/s':>9}{'TPOT/none':>10}{'tok/s/none':>11}"
             f"{'same':>7}{'accept':>8}  per position"]
    for r in rows:
        fmt = lambda v, f: (f.format(v) if v is not None else "-")  # noqa: E731
        lines.append(f"{r['system']:<22}{r['run']:<12}{fmt(r['tpot_ms_p50'], '{:.1f}'):>12}"
                     f"{fmt(r['tok_s'], '{:.1f}'):>9}{fmt(r['tpot_vs_none'], '{:.3f}'):>10}"
                     f"{fmt(r['tok_s_vs_none'], '{:.3f}'):>11}{r.get('same_as_none') or '-':>7}"
                     f"{fmt(r['acceptance_rate'], '{:.2f}'):>8}  "
                     f"{r['accepted_per_position'] or ''}{'  errors: ' + '; '.join(r['errors']) if r['errors'] else ''}")
    return lines


if __name__ == "__main__":
    main()
