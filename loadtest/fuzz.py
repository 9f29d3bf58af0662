"""Schema fuzzing of the OpenAI-compatible API (``make fuzz``; docs/security.md).

    python -m loadtest.fuzz --max-examples 1300 --out results/fuzz

Starts a tritonserver on a tiny random model and the OpenAI server in front
of it (with an API key), runs schemathesis (``st run``) against the app's
``/openapi.json`` with the ``not_a_server_error`` check, then checks what
must hold afterwards: both servers still up and healthy, no KV block left in
use (``pagedbackend:kv_blocks_used`` back to 0) and a canary completion
answered. Prints one JSON summary line (cases, seconds, failures); exits
non-zero on any failure. ``--max-examples`` is per API operation and phase;
the summary counts every case schemathesis sent.
"""
import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

KEY = "fuzz-key-0123456789"
# Small limits keep each generated request cheap: a 128-position context on
# a tiny model, so no case runs longer than 128 tokens.
SETTINGS = dict(block_size=16, num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=512,
                max_model_len=128, dtype="float32", device="cpu", compile=False)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=1300, help="per API operation and phase")
    parser.add_argument("--max-time", type=float, default=1800.0, help="seconds for schemathesis, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="results/fuzz")
    return parser.parse_args(argv)


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


def canary(api_url: str) -> str:
    body = {"model": "paged_llm", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(f"{api_url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["choices"][0]["text"]


def cases_sent(report_dir: pathlib.Path) -> int:
    """Test cases in schemathesis' ndjson report (one ``ScenarioFinished``
    event per scenario, each recording the cases it ran)."""
    total = 0
    for path in report_dir.glob("*.ndjson"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            finished = event.get("ScenarioFinished")
            if finished:
                total += len((finished.get("recorder") or {}).get("cases") or {})
    return total


def run(args: argparse.Namespace) -> dict:
    from loadtest.tiny_model import build_tiny_llama
    from loadtest.harness.triton import TritonServer
    from loadtest.harness.openai import OpenAIServer
    from pagedbackend.serving.repository import make_model_repository

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_dir = out / "schemathesis"
    for old in report_dir.glob("*.ndjson"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="fuzz-") as work:
        model = build_tiny_llama(pathlib.Path(work) / "model")
        repo = make_model_repository(pathlib.Path(work) / "repo", {"model": str(model), **SETTINGS})
        with TritonServer(repo, ready_timeout_s=300, api_key=KEY,
                          log_path=out / "tritonserver.log") as triton, \
                OpenAIServer(triton.grpc_url, tokenizer=model, env={"PAGEDBACKEND_API_KEY": KEY}) as api:
            command = [str(pathlib.Path(sys.executable).parent / "st"), "run", f"{api.url}/openapi.json",
                       "--checks", "not_a_server_error", "--max-examples", str(args.max_examples),
                       "--max-time", str(int(args.max_time)), "--seed", str(args.seed),
                       "--workers", str(args.workers), "--request-timeout", "120",
                       "--header", f"Authorization: Bearer {KEY}", "--continue-on-failure",
                       "--suppress-health-check", "all", "--report", "ndjson", "--report-dir", str(report_dir),
                       "--no-color"]
            started = time.monotonic()
            result = subprocess.run(command, capture_output=True, text=True)
            seconds = time.monotonic() - started
            (out / "schemathesis.txt").write_text(result.stdout + result.stderr)
            problems = []
            if result.returncode != 0:
                tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
                problems.append(f"schemathesis exited {result.returncode}:\n{tail}")
            if api.process is None or api.process.poll() is not None:
                problems.append("the OpenAI server is down")
            if triton.process is None or triton.process.poll() is not None:
                problems.append("tritonserver is down")
            if not problems:
                if not wait_for(lambda: metric(triton, "kv_blocks_used") == 0, 60.0):
                    problems.append(f"KV blocks still in use: {metric(triton, 'kv_blocks_used'):.0f}")
                try:
                    canary(api.url)
                except OSError as exc:
                    problems.append(f"the canary completion failed: {exc}")
    summary = re.findall(r"^.*(?:passed|failed|errors?).*$", result.stdout, re.M)
    return {"cases": cases_sent(report_dir), "seconds": round(seconds, 1), "problems": problems,
            "schemathesis_summary": summary[-3:], "max_examples": args.max_examples}


def main(argv=None) -> int:
    outcome = run(parse_args(argv))
    print(json.dumps(outcome), flush=True)
    return 1 if outcome["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
