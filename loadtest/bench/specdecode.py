"""Speculative decoding as a client sees it: TPOT and output tokens/s of our
server with each ``speculative_config`` method against none, beside vLLM's CPU
build and llama.cpp's server in their speculative modes where they are
installed (``peers``' flags; a missing one is named and skipped).

Two seeded, synthetic workloads (no data set can be downloaded here):
``copy``, prompts whose answers reuse their text (rename a function in a
generated module, repeat a paragraph with one word replaced, fix the typos
of a paragraph), and ``chat``, open questions. Each is sent greedy, stopping
at EOS, at every ``--concurrency`` (a closed loop: that many streams, each
sending its next request when the last one ends). Every system runs in a
server of its own, one after another; rounds repeat the whole sequence, in
turn order rotated, and the figures are medians over rounds. Acceptance per
draft position comes from the servers' ``spec_decode_*`` counters (ours
and vLLM's under ``vllm:``, llama.cpp's under ``llamacpp:``). Modes: ours
none / ngram / self_int4; vLLM none / ngram; llama.cpp none / ngram-mod /
its draft-simple with the default model's Q4_1 GGUF as draft (the
counterpart of self_int4).
"""
import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from typing import Callable, Dict, Iterator, List

from pagedbackend.serving.harness import free_port

from . import peer_servers
from .common import write_result
from .peers import _pct, cpu_model, find_peers

WORDS = ("river stone garden window lantern harbor meadow engine pocket ladder violin orchard canyon "
         "compass blanket thunder marble feather anchor candle").split()
VERBS = ("collects builds opens carries paints follows guards measures returns watches").split()
STEMS = ("collect build open carry paint follow guard measure return watch").split()
TOPICS = ("a lighthouse keeper", "the history of tea", "how bridges carry weight", "a trip to the mountains",
          "learning to play chess", "why the sky is blue", "a robot that learns to cook", "saving money",
          "the life of a honeybee", "a city under the sea", "how vaccines work", "a lost umbrella")
METHODS = {"none": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 4},
           "self_int4": {"method": "self_int4", "num_speculative_tokens": 3}}


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _module(rng: random.Random, functions: int) -> (str, List[str]):
    names, lines = [], []
    for _ in range(functions):
        a, b = rng.sample(WORDS, 2)
        name = f"{rng.choice(STEMS)}_{a}"
        names.append(name)
        lines += [f"def {name}({a}, {b}):", f'    """Return the {a} with the {b}."""',
                  f"    total = {a} + {b}", f"    return total * {rng.randint(2, 9)}", ""]
    return "\n".join(lines), names


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(f"The {rng.choice(WORDS)} {rng.choice(VERBS)} the {rng.choice(WORDS)} near the "
                    f"{rng.choice(WORDS)}." for _ in range(sentences))


def _typos(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) // 8)):
        w = words[i]
        if len(w) > 3:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def copy_prompts(n: int, seed: int) -> List[str]:
    """Prompts whose answers copy most of their text."""
    rng, out = random.Random(seed), []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            code, names = _module(rng, 3)
            out.append(chat(f"Rename the function {names[0]} to {names[0]}_v2 and return the whole code:\n\n{code}"))
        elif kind == 1:
            text = _paragraph(rng, 4)
            old, new = rng.choice(text.split(" ")[1:3]), rng.choice(WORDS)
            out.append(chat(f"Repeat this text exactly, but write '{new}' instead of '{old}':\n\n{text}"))
        else:
            out.append(chat(f"Fix the spelling mistakes in this text and write it out again:\n\n"
                            f"{_typos(rng, _paragraph(rng, 4))}"))
    return out


def chat_prompts(n: int, seed: int) -> List[str]:
    rng = random.Random(seed + 1)
    forms = ("Write a short story about {}.", "Explain {} to a child.", "Give me three tips about {}.")
    return [chat(rng.choice(forms).format(rng.choice(TOPICS))) for _ in range(n)]


# ---------------------------------------------------------------- streams (greedy, stopping at EOS)

def stream_ours(url: str, prompt: str, max_tokens: int, timeout: float) -> Iterator[int]:
    from client import http_stream
    for delta in http_stream(prompt, {"max_tokens": max_tokens, "temperature": 0.0}, url=url,
                             exclude_input=True, timeout=timeout):
        yield delta.num_tokens


def stream_vllm(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> Iterator[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    for event in peer_servers._events(url + "/v1/completions", body, timeout):
        for choice in event.get("choices", []):
            ids = choice.get("token_ids")
            yield len(ids) if ids is not None else int(bool(choice.get("text")))


def stream_llama(url: str, prompt: str, max_tokens: int, timeout: float) -> Iterator[int]:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
            "stream": True, "return_tokens": True}
    for event in peer_servers._events(url + "/completion", body, timeout):
        ids = event.get("tokens")
        yield len(ids) if ids is not None else int(bool(event.get("content")))


def closed_loop(stream: Callable[[str], Iterator[int]], prompts: List[str], concurrency: int) -> List[dict]:
    """``concurrency`` streams, each sending the next prompt when its last one ends."""
    records, lock, queue = [], threading.Lock(), list(enumerate(prompts))

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i, prompt = queue.pop(0)
            rec = {"i": i, "events": [], "error": None}
            sent = time.perf_counter()
            try:
                for n in stream(prompt):
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
    """name -> a function that returns (server, stream(prompt), metrics url or None)."""
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
            return (server, lambda p: stream_ours(server.url, p, args.max_tokens, args.timeout),
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
                return (server, lambda p: stream_vllm(server.url, model_dir, p, args.max_tokens, args.timeout),
                        server.url)
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
                return server, lambda p: stream_llama(server.url, p, args.max_tokens, args.timeout), server.url
            out[f"llama.cpp/{name}"] = make
    return out


def run_system(make, workloads: Dict[str, List[str]], concurrency: List[int]) -> dict:
    server, stream, metrics_url = make()
    rows = {}
    with server:
        for _ in stream(workloads["chat"][0]):   # warm-up, not timed
            pass
        for workload, prompts in workloads.items():
            for c in concurrency:
                # One stream: half the prompts in turn; c streams: at least two requests each.
                count = max(2, len(prompts) // 2) if c == 1 else max(len(prompts), 2 * c)
                before = peer_servers.spec_counters(metrics_url)
                row = summarise(closed_loop(stream, [prompts[i % len(prompts)] for i in range(count)], c))
                time.sleep(0.5)   # servers refresh their counters every 0.2 s
                row["acceptance"] = peer_servers.draft_acceptance(before, peer_servers.spec_counters(metrics_url))
                rows[f"{workload}@{c}"] = row
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench specdecode", description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--methods", default="none,ngram,self_int4", help=f"ours: any of {', '.join(METHODS)}")
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
    workloads = {"copy": copy_prompts(args.requests, args.seed), "chat": chat_prompts(args.requests, args.seed)}
    makers = systems(args)
    names = list(makers)
    per_round = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        results = {}
        for name in order:
            print(f"round {r}: {name}", flush=True)
            try:
                results[name] = run_system(makers[name], workloads, args.concurrency)
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
    """Medians over rounds per system and workload@concurrency, with the ratio to
    the same system family's 'none' run."""
    rows = []
    keys = sorted({k for results in per_round for res in results.values() if "error" not in res for k in res})
    for name in names:
        family = name.split("/")[0]
        for key in keys:
            runs = [res[name][key] for res in per_round if key in res.get(name, {})]
            base = [res[f"{family}/none"][key] for res in per_round if key in res.get(f"{family}/none", {})]
            if not runs:
                continue
            med = lambda rs, f: statistics.median([r[f] for r in rs if r.get(f) is not None]) if any(r.get(f) is not None for r in rs) else None  # noqa: E731
            tpot, tok_s = med(runs, "tpot_ms_p50"), med(runs, "tok_s")
            base_tpot, base_tok = (med(base, "tpot_ms_p50"), med(base, "tok_s")) if base else (None, None)
            rates = [r["acceptance"]["acceptance_rate"] for r in runs if r.get("acceptance")]
            rows.append({"system": name, "run": key, "tpot_ms_p50": tpot, "tok_s": tok_s,
                         "tpot_vs_none": round(tpot / base_tpot, 3) if tpot and base_tpot else None,
                         "tok_s_vs_none": round(tok_s / base_tok, 3) if tok_s and base_tok else None,
                         "acceptance_rate": statistics.median(rates) if rates else None,
                         "accepted_per_position": next((r["acceptance"]["accepted_per_position"] for r in runs
                                                        if r.get("acceptance")), None),
                         "errors": sorted({e for r in runs for e in r["errors"]})})
    return rows


def table_lines(rows: List[dict]) -> List[str]:
    lines = [f"{'system':<22}{'run':<10}{'TPOT p50 ms':>12}{'tok/s':>9}{'TPOT/none':>10}{'tok/s/none':>11}"
             f"{'accept':>8}  per position"]
    for r in rows:
        fmt = lambda v, f: (f.format(v) if v is not None else "-")  # noqa: E731
        lines.append(f"{r['system']:<22}{r['run']:<10}{fmt(r['tpot_ms_p50'], '{:.1f}'):>12}"
                     f"{fmt(r['tok_s'], '{:.1f}'):>9}{fmt(r['tpot_vs_none'], '{:.3f}'):>10}"
                     f"{fmt(r['tok_s_vs_none'], '{:.3f}'):>11}{fmt(r['acceptance_rate'], '{:.2f}'):>8}  "
                     f"{r['accepted_per_position'] or ''}{'  errors: ' + '; '.join(r['errors']) if r['errors'] else ''}")
    return lines


if __name__ == "__main__":
    main()
