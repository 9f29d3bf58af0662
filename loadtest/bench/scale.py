"""The models CPU users run: decode speed of a random Llama-shaped checkpoint
at Llama-3.2-1B's widths (hidden 2048, 16 layers, 32 heads, 8 KV heads of 64,
intermediate 8192; the vocabulary is the tiny GGUF tokenizer's) saved by
transformers in bfloat16, and of the same weights as GGUF Q8_0, Q4_0 and
Q4_K_M files (``loadtest.tiny_gguf``; or, with ``--llama-quantize``,
llama.cpp's ``llama-quantize`` run on an F16 file of them; with
``--llama-convert`` too, that F16 file is llama.cpp's ``convert_hf_to_gguf.py``
run on the bfloat16 folder, whose vocabulary is then the default model's
tokenizer, 49,152 tokens, with an LM head of its own). Built once into ``--workdir``;
``--hidden/--layers/--intermediate`` pick a smaller shape.

Settings (``--settings``): our engine with ``dtype=auto`` on the bfloat16
folder (bfloat16 where the CPU multiplies bfloat16, else float32),
``dtype=float32``, ``auto_torch`` (``dtype=auto`` with ``linear_backend=torch``:
torch's GEMM, oneDNN, instead of our kernels; run only when named),
``quantization=int8``, and on each GGUF file (``<file>_w8a8``: with int8
activations; run only when named). Each runs
``--streams`` sequences at once (``--prompt-tokens`` random token ids each,
greedy, EOS ignored, prefix caching off) through ``LLM.generate``; decode
tok/s is ``streams x (long - short) / (t(long) - t(short))``: a run of
``--long`` new tokens minus a run of ``--short``, so the prefill is left out.
Paired rounds: every round runs every stream count of every setting in turn,
all engines held at once, after a warm-up of each at every stream count
(8-token prompts, 4 new tokens); medians of the rounds are reported. Our
steps are the engine's default (compiled; a step package built on first use
and cached) unless ``--eager``.

Rooflines: the memory bandwidth is read in the same run (the best of a few
``torch.sum`` over a ``--bandwidth-gib`` float32 tensor, same threads, before
and after the rounds); a one-stream step reads every weight but the embedding
table once, so its roofline is the faster bandwidth reading over those bytes
(as the engine holds them: the bytes of its tensors but the embedding table,
which for ``dtype=float32`` on a bfloat16 checkpoint are bfloat16; for GGUF the
file's own blocks; for a peer by the format's arithmetic), and each
one-stream figure is shown as a fraction of it. Above one stream the GFLOP/s
achieved is ``2 x parameters (embedding table excluded) x tok/s``.

Start-up: each setting's engine built in a fresh process of its own, after
the rounds (the caches they filled are warm): seconds from starting the
process to the engine built, and the process's RSS then, its peak RSS and
its peak of anonymous memory (the peak RSS counts a checkpoint's mapped
file pages, which are clean and reclaimable).

Peers, run after our rounds on the same prompts and lengths: vLLM's CPU build
(``--vllm-python``, ``dtype=bfloat16`` on the bfloat16 folder, its rounds in
its own process, ``vllm_timing.py``) and llama.cpp's ``llama-server``
(``--llama-server``, on each GGUF file, every stream's request posted at once
to ``/completion``; the files of our settings, all three when none is on
one); each is skipped with a message when not given. With ``--interleave``,
each peer runs one round (vLLM in a fresh process, llama.cpp in a fresh
server) right after each of ours instead, so a slow spell of a shared host
falls on all, and each of our settings gets its ratio round by round
(medians reported) to vLLM (the bfloat16 folder's settings) or to llama.cpp
on the same file (the GGUF settings; ``<file>_w8a8`` is ours with int8
activations, as llama.cpp multiplies). Prefill: each round, one prompt of
``--prefill-tokens`` tokens and one new token, per setting and peer.
"""
import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from . import peer_servers
from .common import add_common_args, built_once, set_threads, write_result
from .moe import decode_rate, run_vllm
from .vision import cpu_model

GGUF_SCHEMES = ("Q8_0", "Q4_0", "Q4_K_M")
# setting -> (the file it loads: "bf16" or a GGUF scheme, engine settings)
SETTINGS = {"auto": ("bf16", {"dtype": "auto"}), "float32": ("bf16", {"dtype": "float32"}),
            "auto_torch": ("bf16", {"dtype": "auto", "linear_backend": "torch"}),
            "int8": ("bf16", {"quantization": "int8"}),
            **{scheme: (scheme, {}) for scheme in GGUF_SCHEMES},
            # the file's blocks times activations rounded to int8, as llama.cpp multiplies them
            **{f"{scheme}_w8a8": (scheme, {"quantization": "w8a8"}) for scheme in GGUF_SCHEMES}}
HEAD_DIM = 64
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


# ---------------------------------------------------------------- the checkpoint

def build(folder: pathlib.Path, hidden: int, layers: int, intermediate: int, seed: int = 0,
          quantize_tool: Optional[str] = None, convert: Optional[Tuple[str, str]] = None) -> None:
    """A random Llama of this shape (heads of 64, a quarter as many KV heads)
    in ``folder/bf16`` (transformers' bfloat16 safetensors, the tokenizer),
    the same weights as ``folder/bench-<scheme>.gguf`` files, and
    ``folder/shape.json`` (the shape and parameter counts). With
    ``quantize_tool`` (llama.cpp's ``llama-quantize``) the files are its
    quantisations of an F16 file of the weights rather than gguf-py's and
    ``tiny_gguf``'s roundings. With ``convert`` as well (a Python and
    llama.cpp's ``convert_hf_to_gguf.py``), that F16 file is the script's own
    conversion of the bfloat16 folder, which then holds the default model's
    tokenizer (SmolLM2's, 49,152 tokens, a pre-tokenizer the script knows;
    the tiny GGUF tokenizer's it refuses) and an LM head of its own."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from loadtest.tiny_gguf import FAMILIES, write_gguf
    if hidden % 256 or intermediate % 256:
        raise SystemExit(f"--hidden and --intermediate must be multiples of 256 (K-quant blocks); "
                         f"got {hidden} and {intermediate}")
    _, arch, settings = FAMILIES["llama"]
    heads = hidden // HEAD_DIM
    settings = dict(settings, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=HEAD_DIM,
                    max_position_embeddings=2048)
    tokenizer_files = None
    if convert:
        from pagedbackend.models.default_model import prepare_default_model
        source = prepare_default_model()
        tokenizer_files = [source / f for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
                           if (source / f).exists()]
        vocab = AutoTokenizer.from_pretrained(source).vocab_size
        settings = dict(settings, vocab_size=vocab, tie_word_embeddings=False)
    config = AutoConfig.for_model("llama", **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    model.save_pretrained(folder / "bf16")
    cfg = {**config.to_dict(), "head_dim": HEAD_DIM, "rope_theta": 10000.0}
    if tokenizer_files:
        for f in tokenizer_files:
            shutil.copy(f, folder / "bf16" / f.name)
    if quantize_tool:
        f16 = folder / "bench-F16.gguf"
        if convert:
            print(f"convert_hf_to_gguf.py {folder.name}/bf16 -> bench-F16.gguf...", flush=True)
            llama_convert(convert, folder / "bf16", f16)
        else:
            write_gguf(f16, model.state_dict(), cfg, arch, "F16")
        for scheme in GGUF_SCHEMES:
            print(f"llama-quantize {folder.name}/bench-{scheme}.gguf...", flush=True)
            llama_quantize(quantize_tool, f16, folder / f"bench-{scheme}.gguf", scheme)
        f16.unlink()
    for scheme in GGUF_SCHEMES if not quantize_tool else ():
        print(f"writing {folder.name}/bench-{scheme}.gguf...", flush=True)
        write_gguf(folder / f"bench-{scheme}.gguf", model.state_dict(), cfg, arch, scheme)
    first = folder / f"bench-{GGUF_SCHEMES[0]}.gguf"
    if not tokenizer_files:
        AutoTokenizer.from_pretrained(folder, gguf_file=first.name).save_pretrained(folder / "bf16")
    state = model.state_dict()
    matrices = {n: t for n, t in state.items() if t.dim() == 2 and n != "model.embed_tokens.weight"}
    shape = {"hidden": hidden, "layers": layers, "intermediate": intermediate, "heads": heads,
             "kv_heads": settings["num_key_value_heads"], "head_dim": HEAD_DIM, "vocab": config.vocab_size,
             "parameters": sum(t.numel() for t in state.values()),
             "parameters_without_embedding": sum(t.numel() for n, t in state.items()
                                                 if n != "model.embed_tokens.weight"),
             "matrix_rows": sum(t.shape[0] for t in matrices.values())}
    (folder / "shape.json").write_text(json.dumps(shape, indent=1))


def llama_quantize(tool: str, source: pathlib.Path, out: pathlib.Path, scheme: str) -> None:
    """``tool source out scheme`` (llama.cpp's quantizer, its libraries beside it)."""
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, [str(pathlib.Path(tool).resolve().parent),
                                                                     os.environ.get("LD_LIBRARY_PATH")]))}
    done = subprocess.run([tool, str(source), str(out), scheme], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama-quantize to {scheme} failed ({done.returncode}): {done.stderr[-1500:]}")


def llama_convert(convert: Tuple[str, str], model: pathlib.Path, out: pathlib.Path) -> None:
    """``python convert_hf_to_gguf.py model --outtype f16 --outfile out`` with the
    script's own gguf-py first on the path."""
    python, script = convert
    gguf_py = pathlib.Path(script).resolve().parent / "gguf-py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(gguf_py), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([python, script, str(model), "--outtype", "f16", "--outfile", str(out)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed ({done.returncode}): {done.stderr[-1500:]}")


def checkpoint(workdir: str, hidden: int, layers: int, intermediate: int,
               quantize_tool: Optional[str] = None, convert: Optional[Tuple[str, str]] = None) -> pathlib.Path:
    # refused before anything is built
    if quantize_tool and not os.access(quantize_tool, os.X_OK):
        raise SystemExit(f"--llama-quantize {quantize_tool}: not an executable file")
    if convert and not quantize_tool:
        raise SystemExit("--llama-convert needs --llama-quantize (the script writes the F16 file it quantises)")
    if convert and not pathlib.Path(convert[1]).is_file():
        raise SystemExit(f"--llama-convert {convert[1]}: no such file")
    name = f"llama-h{hidden}-l{layers}-i{intermediate}" + ("-llamacpp-hf" if convert else
                                                           "-llamacpp" if quantize_tool else "")
    path = pathlib.Path(workdir) / name
    if not (path / "shape.json").exists():
        print(f"building {path} (once)...", flush=True)
    return built_once(path, lambda scratch: build(scratch, hidden, layers, intermediate, quantize_tool=quantize_tool,
                                                  convert=convert), marker="shape.json")


def gguf_bytes_without_embedding(path: pathlib.Path) -> int:
    """Bytes of the file's tensors but the embedding table (a step reads one row of it)."""
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if t.name != "token_embd.weight")


def held_weights(llm):
    """Bytes of the weights an engine holds, as it holds them (a float32 run of a
    bfloat16 checkpoint keeps bfloat16 weights in the packed layers), but the
    embedding table (a step reads one row of it); and the dtype most of them are in."""
    model = llm.engine.runner.model
    skip = {id(t) for name, m in model.named_modules() if name.endswith("embed_tokens")
            for t in list(m.parameters()) + list(m.buffers())}
    seen, by_dtype = set(), {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("cos", "sin", "inv_freq")):   # rotary tables: a step reads its positions' rows
            continue
        if id(t) not in skip and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel() * t.element_size()
    return sum(by_dtype.values()), str(max(by_dtype, key=by_dtype.get)).replace("torch.", "")


def step_bytes(setting: str, dtype: str, shape: dict, folder: pathlib.Path) -> int:
    """Bytes of weights a one-stream decode step reads in ``setting`` (run in
    ``dtype``) by the format's arithmetic (peers; ours is ``held_bytes``)."""
    params = shape["parameters_without_embedding"]
    kind = SETTINGS[setting][0]
    if kind != "bf16":
        return gguf_bytes_without_embedding(folder / f"bench-{kind}.gguf")
    if SETTINGS[setting][1].get("quantization") == "int8":
        return params + 4 * shape["matrix_rows"]
    return params * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


# ---------------------------------------------------------------- measuring

def bandwidth_gbs(gib: float, repeats: int = 5) -> float:
    """Read bandwidth (GB/s): the best of ``repeats`` sums over a float32 tensor of ``gib`` GiB."""
    x = torch.ones(int(gib * 2 ** 30) // 4, dtype=torch.float32)
    best = math.inf
    for _ in range(repeats + 1):   # the first touches the pages
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def engine_settings(setting: str, folder: pathlib.Path, args) -> Dict[str, object]:
    kind, extra = SETTINGS[setting]
    model = folder / ("bf16" if kind == "bf16" else f"bench-{kind}.gguf")
    # Every stream's prompt and output in blocks of 16, with room to spare: no preemption, no cut context.
    blocks = max(max(args.streams) * (math.ceil((args.prompt_tokens + args.long) / 16) + 2),
                 math.ceil((args.prefill_tokens + 1) / 16) + 2) + 4
    return {"model": str(model), "max_num_seqs": max(args.streams), "enable_prefix_caching": False,
            "num_kv_blocks": blocks, "compile": args.compile, **extra}


def timed(llm, prompts: List[List[int]], tokens: int) -> float:
    from pagedbackend import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != tokens for o in outs):
        raise RuntimeError(f"asked for {tokens} tokens a stream, got {[len(o.outputs[0].token_ids) for o in outs]}")
    return seconds


def rounds(engines: Dict[str, object], stream_prompts: Dict[int, List[List[int]]], args,
           numbers: Optional[range] = None, rates: Optional[dict] = None,
           seconds: Optional[dict] = None) -> Tuple[dict, dict]:
    """Paired rounds (``numbers``, default all): per round, every stream count
    of every setting: decode tok/s per run, and the seconds of its long and
    short runs, added to ``rates``/``seconds`` where given."""
    numbers = range(args.rounds) if numbers is None else numbers
    rates = rates or {name: {n: [] for n in stream_prompts} for name in engines}
    seconds = seconds or {name: {n: [] for n in stream_prompts} for name in engines}
    # Warm-up before the first round: first-time kernels and allocations, at
    # every stream count (short prompts: little prefill).
    for llm in engines.values() if numbers.start == 0 else ():
        for prompts in stream_prompts.values():
            timed(llm, [p[:8] for p in prompts], 4)
        if args.prefill_prompt:
            timed(llm, [args.prefill_prompt], 1)
    for r in numbers:
        for name, llm in engines.items() if args.prefill_prompt else ():
            rates[name].setdefault("prefill", []).append(len(args.prefill_prompt) / timed(llm, [args.prefill_prompt], 1))
            print(f"round {r + 1} {name}: prefill {rates[name]['prefill'][-1]:.1f} tok/s", flush=True)
        for streams, prompts in stream_prompts.items():
            for name, llm in engines.items():
                t_long, t_short = timed(llm, prompts, args.long), timed(llm, prompts, args.short)
                rate = decode_rate(streams, args.long, t_long, t_short, args.short)
                rates[name][streams].append(rate)
                seconds[name][streams].append((round(t_long, 2), round(t_short, 2)))
                print(f"round {r + 1} {name}: {streams} streams "
                      f"{'-' if rate is None else f'{rate:.1f}'} tok/s ({args.long} tokens in {t_long:.1f} s, "
                      f"{args.short} in {t_short:.1f} s)", flush=True)
    return rates, seconds


def startup(setting: str, folder: pathlib.Path, args) -> dict:
    """Our engine of ``setting`` built in a process of its own: seconds to ready and RSS then."""
    probe = json.dumps({"settings": engine_settings(setting, folder, args), "threads": args.threads})
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "loadtest.bench.scale", "--probe", probe], env=env,
                          capture_output=True, text=True, timeout=args.startup_timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"{peer_servers.exit_description(done.returncode)}: {done.stderr[-1500:]}"}
    report = json.loads(lines[-1])
    return {"ready_s": round(report["ready_at"] - started, 1), "build_s": round(report["build_s"], 1),
            "rss_mib": report["rss_mib"], "peak_rss_mib": report["peak_rss_mib"],
            "peak_anon_mib": report["peak_anon_mib"], "dtype": report["dtype"]}


def _status_mib() -> Dict[str, int]:
    """This process's /proc status sizes (VmRSS, VmHWM, RssAnon, RssFile) in MiB."""
    lines = pathlib.Path("/proc/self/status").read_text().splitlines()
    return {key: round(int(value.split()[0]) / 1024) for key, value in (line.split(":", 1) for line in lines)
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def probe(spec: str) -> None:
    """In a fresh process: build the engine, print when it was ready, the RSS
    then and at its peak, and the peak of anonymous memory alone (sampled every
    20 ms): the peak RSS counts the pages of a checkpoint's mapped files too,
    which are clean and reclaimable."""
    import threading
    spec = json.loads(spec)
    set_threads(spec["threads"])
    from pagedbackend import LLM
    peak_anon, building = [0], threading.Event()

    def sample():
        while not building.wait(0.02):
            peak_anon[0] = max(peak_anon[0], _status_mib()["RssAnon"])
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    llm = LLM(**spec["settings"])
    build_s = time.perf_counter() - start
    building.set()
    sampler.join()
    status = _status_mib()
    print(json.dumps({"ready_at": time.time(), "build_s": build_s, "rss_mib": status["VmRSS"],
                      "peak_rss_mib": status["VmHWM"], "peak_anon_mib": max(peak_anon[0], status["RssAnon"]),
                      "dtype": llm.engine.config.dtype}), flush=True)


# ---------------------------------------------------------------- peers

def run_llama(binary: str, gguf: pathlib.Path, stream_prompts, args, count: int) -> Dict[object, List[Optional[float]]]:
    """``count`` rounds of llama-server on one GGUF: per round and stream count,
    every stream posted at once; and the prefill of ``args.prefill_prompt``."""
    from loadtest.harness.triton import free_port
    rates = {n: [] for n in stream_prompts}
    slots = max(stream_prompts)
    context = ["-c", str(slots * max(512, 2 ** math.ceil(math.log2(len(args.prefill_prompt) + 2))))]
    with peer_servers.llama(binary, str(gguf), free_port(), args.threads, slots, extra_args=context) as server:
        def run(prompts, tokens):
            start = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                list(pool.map(lambda p: peer_servers.complete_llama(server.url, p, tokens, args.peer_timeout),
                              prompts))
            return time.perf_counter() - start
        run(stream_prompts[max(stream_prompts)], 4)   # warm-up
        for _ in range(count):
            if args.prefill_prompt:
                rates.setdefault("prefill", []).append(len(args.prefill_prompt) / run([args.prefill_prompt], 1))
            for streams, prompts in stream_prompts.items():
                t_long, t_short = run(prompts, args.long), run(prompts, args.short)
                rates[streams].append(decode_rate(streams, args.long, t_long, t_short, args.short))
    return rates


def llama_schemes(args) -> List[str]:
    """The GGUF files llama.cpp runs: those of our settings (all when none of ours is on one)."""
    ours = [SETTINGS[s][0] for s in args.settings if SETTINGS[s][0] in GGUF_SCHEMES]
    return [scheme for scheme in GGUF_SCHEMES if scheme in ours or not ours]


VLLM = "vLLM CPU (bfloat16)"


def vllm_rounds(folder: pathlib.Path, stream_prompts, args, count: int) -> Dict[int, List[Optional[float]]]:
    """``count`` rounds of vLLM's CPU build (bfloat16, on the folder) in a process of its own."""
    return run_vllm(args.vllm_python, args.vllm_env, folder / "bf16", stream_prompts, None, args.long,
                    count, args.threads, args.peer_timeout, short=args.short, dtype="bfloat16")["decode"]


def interleaved(engines, folder: pathlib.Path, stream_prompts, args) -> Tuple[dict, dict, dict, List[str]]:
    """Our rounds with one round of each peer after each: vLLM (a fresh
    process each time, its compile cache warm after the first) and llama.cpp
    on each GGUF file (a server each time), so that a slow spell of a shared
    host falls on all."""
    rates = seconds = None
    peers_now = ([(VLLM, lambda: vllm_rounds(folder, stream_prompts, args, 1))] if args.vllm_python else []) + [
        (f"llama.cpp {scheme}", lambda scheme=scheme: run_llama(args.llama_server, folder / f"bench-{scheme}.gguf",
                                                                 stream_prompts, args, 1))
        for scheme in (llama_schemes(args) if args.llama_server else [])]
    theirs = {name: {} for name, _ in peers_now}
    skipped = []
    for r in range(args.rounds):
        rates, seconds = rounds(engines, stream_prompts, args, range(r, r + 1), rates, seconds)
        for name, run in peers_now:
            if name not in theirs:   # failed in an earlier round
                continue
            try:
                for n, values in run().items():
                    theirs[name].setdefault(n, []).extend(values)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                skipped.append(f"{name}: {peer_servers.error_text(exc, 600)}")
                del theirs[name]
                continue
            print(f"round {r + 1} {name}: " + ", ".join(f"{n} streams {theirs[name][n][-1] or 0:.1f} tok/s"
                                                         for n in stream_prompts), flush=True)
    return rates, seconds, theirs, skipped


def peers(folder: pathlib.Path, stream_prompts, args, found: Dict[str, dict]) -> Tuple[Dict[str, dict], List[str]]:
    """The peers after our rounds, beside ``found`` (vLLM's interleaved rounds,
    which are not run again here, nor retried where they failed)."""
    found, skipped = dict(found), []
    if not args.vllm_python:
        skipped.append("vLLM: no --vllm-python / BENCH_VLLM_PYTHON")
    elif not args.interleave:
        try:
            found[VLLM] = vllm_rounds(folder, stream_prompts, args, args.rounds)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            skipped.append(f"vLLM: {peer_servers.error_text(exc, 600)}")
    if args.llama_server and not args.interleave:
        for scheme in llama_schemes(args):
            try:
                found[f"llama.cpp {scheme}"] = run_llama(args.llama_server, folder / f"bench-{scheme}.gguf",
                                                         stream_prompts, args, args.rounds)
            except (RuntimeError, OSError) as exc:
                skipped.append(f"llama.cpp {scheme}: {peer_servers.error_text(exc, 600)}")
    elif not args.llama_server:
        skipped.append("llama.cpp: no --llama-server / BENCH_LLAMA_SERVER")
    return found, skipped


# ---------------------------------------------------------------- the table

def median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def cpu_flags() -> List[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [f for f in CPU_FLAGS if f in present]
    except OSError:
        pass
    return []


def table(rows: List[dict], streams: List[int]) -> str:
    head = ["setting", "weights", "MB read / step"]
    for n in streams:
        head += [f"{n} stream{'s' * (n > 1)} tok/s", "of memory roofline" if n == 1 else "GFLOP/s"]
    head += ["prefill tok/s", "ready s", "RSS MiB", "peak anonymous MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)   # noqa: E731
    for r in rows:
        cells = [r["setting"], r["weights"], fmt(r.get("step_bytes") and r["step_bytes"] / 1e6, ".0f")]
        for n in streams:
            cells += [fmt(r[f"tok_s_{n}"], ".1f"),
                      fmt(r.get("roofline_fraction"), ".2f") if n == 1 else fmt(r.get(f"gflops_{n}"), ".0f")]
        cells += [fmt(r.get("prefill_tok_s"), ".1f"), fmt(r.get("ready_s"), ".1f"), fmt(r.get("rss_mib"), ".0f"),
                  fmt(r.get("peak_anon_mib"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="where the checkpoints are built and kept "
                    "(default: bench-scale under the cache)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--settings", default=",".join(s for s in SETTINGS if s != "auto_torch" and "_w8a8" not in s),
                    help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--startup-settings", default=None,
                    help="settings whose start-up is measured in a fresh process (default: --settings; "
                         "'none': no start-up measured)")
    ap.add_argument("--streams", default="1,32", help="sequences at once, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--short", type=int, default=17, help="new tokens of the shorter run")
    ap.add_argument("--long", type=int, default=81, help="new tokens of the longer run")
    ap.add_argument("--prefill-tokens", type=int, default=512,
                    help="prefill tok/s: one prompt of this many tokens, one new token (0: not measured)")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (medians are reported)")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="size of the tensor summed for bandwidth")
    ap.add_argument("--eager", dest="compile", action="store_false",
                    help="our steps eager (compile=False); default: the engine's compiled step")
    ap.add_argument("--vllm-python", default=env("BENCH_VLLM_PYTHON"), help="Python of vLLM's venv")
    ap.add_argument("--vllm-env", default=env("BENCH_VLLM_ENV"), help="shell file of exports for vLLM")
    ap.add_argument("--interleave", action="store_true",
                    help="one round of vLLM after each of ours (a process each), not all of its rounds after")
    ap.add_argument("--llama-server", default=env("BENCH_LLAMA_SERVER"), help="llama-server binary")
    ap.add_argument("--llama-quantize", default=None,
                    help="llama.cpp's llama-quantize: the GGUF files are its quantisations of an F16 file "
                         "(a checkpoint folder of its own, '-llamacpp')")
    ap.add_argument("--llama-convert", default=None,
                    help="llama.cpp's convert_hf_to_gguf.py (with --llama-quantize): the F16 file is its conversion "
                         "of the bfloat16 folder, which gets the default model's tokenizer (a folder of its own, "
                         "'-llamacpp-hf')")
    ap.add_argument("--llama-convert-python", default=sys.executable,
                    help="the Python that runs --llama-convert (llama.cpp's conversion requirements; "
                         "default: this one)")
    ap.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds for one peer's whole run")
    ap.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds for one start-up")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    add_common_args(ap, threads=2)
    args = ap.parse_args(argv)
    if args.probe:
        return args
    args.settings = [s for s in args.settings.split(",") if s]
    startup_settings = args.settings if args.startup_settings is None else \
        [s for s in args.startup_settings.split(",") if s and s != "none"]
    for s in args.settings + startup_settings:
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r}: the settings are {', '.join(SETTINGS)}")
    args.startup_settings = startup_settings
    args.streams = [int(n) for n in args.streams.split(",")]
    if not 0 < args.short < args.long:
        ap.error(f"--short must be above 0 and below --long; got {args.short} and {args.long}")
    if args.quick:
        args.hidden, args.layers, args.intermediate, args.streams = 256, 2, 512, [1, 4]
        args.rounds, args.bandwidth_gib, args.prompt_tokens, args.short, args.long = 1, 0.25, 16, 2, 10
        args.prefill_tokens = min(args.prefill_tokens, 32)
    if args.workdir is None:
        from pagedbackend.config import cache_root
        args.workdir = str(cache_root() / "bench-scale")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.probe:
        return probe(args.probe)
    set_threads(args.threads)
    started = time.perf_counter()
    convert = (args.llama_convert_python, args.llama_convert) if args.llama_convert else None
    folder = checkpoint(args.workdir, args.hidden, args.layers, args.intermediate, args.llama_quantize, convert)
    shape = json.loads((folder / "shape.json").read_text())
    g = torch.Generator().manual_seed(args.seed)
    stream_prompts = {n: torch.randint(3, shape["vocab"], (n, args.prompt_tokens), generator=g).tolist()
                      for n in args.streams}
    args.prefill_prompt = torch.randint(3, shape["vocab"], (args.prefill_tokens,), generator=g).tolist()
    bandwidth = [bandwidth_gbs(args.bandwidth_gib)]
    print(f"bandwidth before: {bandwidth[0]:.1f} GB/s", flush=True)

    from pagedbackend import LLM
    engines, dtypes, first_build = {}, {}, {}
    for name in args.settings:
        start = time.perf_counter()
        engines[name] = LLM(**engine_settings(name, folder, args))
        first_build[name] = round(time.perf_counter() - start, 1)
        dtypes[name] = engines[name].engine.config.dtype
        print(f"{name}: engine built in {first_build[name]} s, dtype {dtypes[name]}", flush=True)
    held = {name: held_weights(llm) for name, llm in engines.items() if SETTINGS[name][0] == "bf16"}
    found, skipped = {}, []
    if args.interleave and (args.vllm_python or args.llama_server):
        rates, run_seconds, found, skipped = interleaved(engines, folder, stream_prompts, args)
    else:
        rates, run_seconds = rounds(engines, stream_prompts, args)
    for llm in engines.values():
        llm.shutdown()
    engines = None
    bandwidth.append(bandwidth_gbs(args.bandwidth_gib))
    print(f"bandwidth after: {bandwidth[1]:.1f} GB/s", flush=True)
    starts = {name: startup(name, folder, args) for name in args.startup_settings}
    found, more = peers(folder, stream_prompts, args, found)
    skipped += more
    for line in skipped:
        print(f"skipped {line}", flush=True)

    peak_bw = max(bandwidth) * 1e9
    rows = []
    for name, per_streams in list(rates.items()) + list(found.items()):
        ours = name in SETTINGS
        if ours:
            kind, extra = SETTINGS[name]
            held_bytes, held_dtype = held.get(name, (None, kind))
            weights = kind if kind != "bf16" else f"{held_dtype} ({dtypes[name]} activations)"
            row = {"setting": f"ours {name}", "weights": weights,
                   "step_bytes": held_bytes or step_bytes(name, dtypes[name], shape, folder)}
        else:   # vLLM in bfloat16 on the folder, llama.cpp on the GGUF named last
            kind = name.split()[-1] if name.startswith("llama.cpp") else "auto"
            row = {"setting": name, "weights": kind if kind != "auto" else "bfloat16",
                   "step_bytes": step_bytes(kind, "bfloat16", shape, folder)}
        for n in args.streams:
            row[f"tok_s_{n}"] = median(per_streams[n])
            row[f"tok_s_{n}_rounds"] = per_streams[n]
            if ours:
                row[f"seconds_long_short_{n}"] = run_seconds[name][n]
            if n > 1 and row[f"tok_s_{n}"]:
                row[f"gflops_{n}"] = 2 * shape["parameters_without_embedding"] * row[f"tok_s_{n}"] / 1e9
        row["prefill_tok_s"] = median(per_streams.get("prefill", []))
        row["prefill_tok_s_rounds"] = per_streams.get("prefill", [])
        if 1 in args.streams and row["tok_s_1"]:
            row["roofline_tok_s"] = peak_bw / row["step_bytes"]
            row["roofline_fraction"] = row["tok_s_1"] / row["roofline_tok_s"]
        # paired: each round's ours / the peer's (vLLM on the folder, llama.cpp on the same file), then the median
        peer, tag = (VLLM, "vllm") if kind == "bf16" else (f"llama.cpp {kind}", "llama")
        if ours and args.interleave and peer in found:
            for n in args.streams + ["prefill"]:
                pairs = [a / b for a, b in zip(per_streams.get(n, []), found[peer].get(n, [])) if a and b]
                row[f"vs_{tag}_{n}_rounds"] = [round(x, 3) for x in pairs]
                row[f"vs_{tag}_{n}"] = median(pairs)
        if ours:
            row["first_build_s"] = first_build[name]
            row.update(starts.get(name, {}))
        rows.append(row)
    machine = {"cpu_model": cpu_model(), "flags": cpu_flags(), "threads": args.threads}
    result = {"machine_named": machine, "shape": shape, "checkpoint": str(folder),
              "bandwidth_gbs": [round(b, 1) for b in bandwidth], "streams": args.streams,
              "prompt_tokens": args.prompt_tokens, "short": args.short, "long": args.long, "rounds": args.rounds,
              "compile": args.compile, "rows": rows, "skipped": skipped,
              "seconds": round(time.perf_counter() - started, 1)}
    text = table(rows, args.streams)
    print(f"\n{machine['cpu_model']}; flags: {', '.join(machine['flags']) or 'none of ' + ', '.join(CPU_FLAGS)}; "
          f"{args.threads} threads; Llama {shape['hidden']} x {shape['layers']} layers "
          f"(MLP {shape['intermediate']}, heads {shape['heads']}/{shape['kv_heads']}), "
          f"{shape['parameters_without_embedding'] / 1e9:.3f} B parameters without the embedding table; "
          f"bandwidth {bandwidth[0]:.1f} GB/s before, {bandwidth[1]:.1f} after (roofline from the faster); "
          f"decode tok/s = {args.long} - {args.short} new tokens, {args.prompt_tokens}-token prompts, "
          f"medians of {args.rounds} rounds\n")
    for tag, peer in (("vllm", "vLLM's"), ("llama", "llama.cpp's on the same file")):
        paired = [f"ours {r['setting'][5:]}: " + ", ".join(
            f"{n if n == 'prefill' else f'{n} stream' + 's' * (n > 1)} {r[f'vs_{tag}_{n}']:.2f}x"
            for n in args.streams + ["prefill"] if r.get(f"vs_{tag}_{n}"))
            for r in rows if r.get(f"vs_{tag}_{args.streams[-1]}")]
        if paired:
            text += f"\n\nOurs over {peer}, round by round (its round right after ours), medians: " + "; ".join(paired)
    print(text, flush=True)
    result["table"] = text
    path = write_result(args.out, "scale", result)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
