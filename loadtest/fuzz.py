"""Fuzzing of the serving front ends (``make fuzz``; docs/security.md).

    python -m loadtest.fuzz --cases 10000 --triton-cases 2000 --out results/fuzz

Starts a tritonserver on a tiny random model and the OpenAI server in front
of it (both with an API key), then runs two parts:

- ``schema``: schemathesis against the OpenAI app's ``/openapi.json`` with the
  ``not_a_server_error`` check, in rounds until ``--cases`` cases were sent
  or ``--max-time`` passed (``loadtest.fuzz_schema``);
- ``triton``: hypothesis-drawn JSON bodies against tritonserver's own
  ``generate``, ``generate_stream`` and ``infer`` routes, ``--triton-cases``
  of them within ``--triton-max-time`` (``loadtest.fuzz_triton``).

After each part what must hold is checked: no 5xx but the documented 503s,
both servers still up and ready, no KV block left in use
(``pagedbackend:kv_blocks_used`` back to 0) and a canary completion answered.
Prints one JSON summary line per part (cases, seconds, failures) and writes
the failures found under ``--out``; exits non-zero on any failure.
"""
import argparse
import json
import pathlib
import sys
import tempfile
import time
import urllib.request
from typing import List

from loadtest.fuzz_schema import run_rounds
from loadtest.fuzz_triton import run_bodies

KEY = "fuzz-key-0123456789"
# Small limits keep each generated request cheap: a 64-position context on
# a tiny model, so no case runs longer than 64 tokens.
SETTINGS = dict(block_size=16, num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=512,
                max_model_len=64, dtype="float32", device="cpu", compile=False)
PARTS = ("schema", "triton")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: schema, triton")
    parser.add_argument("--cases", type=int, default=10_000, help="schemathesis cases, in all rounds together")
    parser.add_argument("--max-time", type=float, default=1200.0, help="seconds for the schemathesis rounds, at most")
    parser.add_argument("--no-coverage", action="store_true",
                        help="skip schemathesis' coverage phase (its fixed set of edge values per operation)")
    parser.add_argument("--triton-cases", type=int, default=2000, help="JSON bodies sent to tritonserver's routes")
    parser.add_argument("--triton-max-time", type=float, default=300.0, help="seconds for the bodies, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4, help="requests in flight at once (schemathesis workers)")
    parser.add_argument("--out", default="results/fuzz")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return args


def metric(triton, name: str) -> float:
    prefix = f'pagedbackend:{name}{{model="paged_llm",version="1"}} '
    for line in triton.metrics().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise RuntimeError(f"pagedbackend:{name} is not on /metrics")


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status == 200
    except OSError:
        return False


def canary(api_url: str) -> str:
    body = {"model": "paged_llm", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(f"{api_url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["choices"][0]["text"]


def still_serving(triton, api) -> List[str]:
    """What no longer holds after a part: both servers up and ready, no KV
    block in use, a canary completion answered."""
    problems = []
    if api.process is None or api.process.poll() is not None:
        problems.append("the OpenAI server is down")
    if triton.process is None or triton.process.poll() is not None:
        problems.append("tritonserver is down")
    if problems:
        return problems
    if not answers(f"{triton.http_url}/v2/models/paged_llm/ready"):
        problems.append("the Triton model is not ready")
    if not answers(f"{api.url}/health"):
        problems.append("the OpenAI server's /health is not 200")
    if not wait_for(lambda: metric(triton, "kv_blocks_used") == 0, 60.0):
        problems.append(f"KV blocks still in use: {metric(triton, 'kv_blocks_used'):.0f}")
    try:
        canary(api.url)
    except OSError as exc:
        problems.append(f"the canary completion failed: {exc}")
    return problems


def run_part(part: str, args, triton, api, out: pathlib.Path) -> dict:
    if part == "schema":
        result = run_rounds(f"{api.url}/openapi.json", KEY, out / "schemathesis", args.cases, args.max_time,
                            not args.no_coverage, args.seed, args.workers)
        found = result.server_errors
    else:
        result = run_bodies(triton.http_url, KEY, args.triton_cases, args.triton_max_time, args.seed,
                            args.workers)
        found = result.failures
    problems = result.problems + still_serving(triton, api)
    summary = {**result.summary(), "failures": len(found) + len(problems), "problems": problems}
    if found or problems:
        (out / f"{part}-failures.txt").write_text("\n\n".join(found + problems) + "\n")
    return summary


def run(args: argparse.Namespace) -> List[dict]:
    """Start the servers, run each part, return one summary per part."""
    from loadtest.harness.openai import OpenAIServer
    from loadtest.harness.triton import TritonServer
    from loadtest.tiny_model import build_tiny_llama
    from pagedbackend.serving.repository import make_model_repository

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*-failures.txt"):
        old.unlink()
    summaries = []
    with tempfile.TemporaryDirectory(prefix="fuzz-") as work:
        model = build_tiny_llama(pathlib.Path(work) / "model")
        repo = make_model_repository(pathlib.Path(work) / "repo", {"model": str(model), **SETTINGS})
        with TritonServer(repo, ready_timeout_s=300, api_key=KEY, log_path=out / "tritonserver.log") as triton, \
                OpenAIServer(triton.grpc_url, tokenizer=model, env={"PAGEDBACKEND_API_KEY": KEY}) as api:
            for part in args.parts:
                summary = run_part(part, args, triton, api, out)
                print(json.dumps(summary), flush=True)
                summaries.append(summary)
        (out / "openai_server.log").write_text(api.output)
    return summaries


def main(argv=None) -> int:
    summaries = run(parse_args(argv))
    return 1 if any(s["failures"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
