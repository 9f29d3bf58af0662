"""schemathesis against the OpenAI app's ``/openapi.json`` until a case count
is reached (``loadtest.fuzz``, docs/security.md).

Given ``--max-time``, schemathesis' fuzzing phase repeats until that time is
spent, and the cheapest operation (a 404 for an unknown model id) then takes
most of the cases; given ``--max-examples`` alone it stops after that many
cases per operation. So the run goes in rounds of ``--max-examples`` with a
fresh seed each, the cases of every round summed from its ndjson report, until
the target count is reached; the overall time bound stops a round where it
is (its finished operations still count). The coverage phase (a fixed set of
schema-derived edge values per operation) runs in the first round only.
schemathesis writes ``.schemathesis/`` and ``.hypothesis/`` into its working
directory, which is the run's output folder here.
"""
import json
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List

# Cases a round sends per --max-examples before one has been measured (seven
# operations have parameters; /health and /v1/models give one case a round;
# a small round's operations give fewer than asked).
FIRST_YIELD = 4.0
MAX_EXAMPLES = 150      # per operation and round: rounds of a few minutes, each with its own seed
MIN_ROUND_S = 5.0       # schemathesis' start (reading the schema) costs about a second


@dataclass
class SchemaFuzz:
    """What the rounds sent and found."""
    cases: int = 0
    seconds: float = 0.0
    rounds: int = 0
    server_errors: List[str] = field(default_factory=list)   # schemathesis' failure reports
    problems: List[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"part": "schema", "cases": self.cases, "seconds": round(self.seconds, 1), "rounds": self.rounds,
                "failures": len(self.server_errors) + len(self.problems)}


def cases_in_report(path: pathlib.Path) -> int:
    """Test cases in an ndjson report: every ``ScenarioFinished`` event records
    the cases its scenario sent."""
    total = 0
    for line in path.read_text().splitlines():
        try:
            finished = json.loads(line).get("ScenarioFinished")
        except json.JSONDecodeError:   # the last line of a round stopped by the time bound
            continue
        if finished:
            total += len((finished.get("recorder") or {}).get("cases") or {})
    return total


def round_command(schema_url: str, api_key: str, examples: int, seed: int, coverage: bool, workers: int,
                  report: pathlib.Path) -> List[str]:
    phases = "examples,coverage,fuzzing" if coverage else "examples,fuzzing"
    return [sys.executable, "-m", "schemathesis.cli", "run", schema_url,
            "--checks", "not_a_server_error", "--phases", phases, "--max-examples", str(examples),
            "--seed", str(seed), "--workers", str(workers),
            "--request-timeout", "120", "--header", f"Authorization: Bearer {api_key}",
            "--continue-on-failure", "--suppress-health-check", "all", "--generation-database", "none",
            "--report", "ndjson", "--report-ndjson-path", str(report), "--no-color"]


def failure_lines(output: str) -> List[str]:
    """The failure sections of schemathesis' output (each names the operation,
    the status and a curl line reproducing it)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if "FAILURES" in line), None)
    if start is None:
        return []
    end = next((i for i, line in enumerate(lines[start:], start) if "SUMMARY" in line), len(lines))
    return [line for line in lines[start:end] if line.strip()]


def run_rounds(schema_url: str, api_key: str, out: pathlib.Path, cases: int, max_time: float,
               coverage: bool = True, seed: int = 0, workers: int = 2) -> SchemaFuzz:
    """``st run`` rounds until ``cases`` cases were sent or ``max_time`` seconds passed."""
    out = out.resolve()   # schemathesis runs in it
    out.mkdir(parents=True, exist_ok=True)
    result = SchemaFuzz()
    started = time.monotonic()
    asked = 0   # --max-examples of the rounds so far, together
    while result.cases < cases:
        left_s = max_time - (time.monotonic() - started)
        if left_s < MIN_ROUND_S:
            break
        per_example = result.cases / asked if result.cases else FIRST_YIELD
        examples = max(5, min(MAX_EXAMPLES, int((cases - result.cases) / per_example) + 1))
        asked += examples
        name = f"round-{result.rounds:03d}"
        report = out / f"{name}.ndjson"
        report.unlink(missing_ok=True)
        command = round_command(schema_url, api_key, examples, seed + result.rounds,
                                coverage and result.rounds == 0, workers, report)
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=out, timeout=left_s)
            status, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as stopped:
            status, output = None, _text(stopped.stdout) + _text(stopped.stderr)
        (out / f"{name}.txt").write_text(output)
        result.rounds += 1
        if not report.exists():
            result.problems.append(f"schemathesis round {result.rounds} wrote no report:\n{output[-2000:]}")
            break
        result.cases += cases_in_report(report)
        failures = failure_lines(output)
        if failures:
            result.server_errors.append("\n".join(failures))
        elif status not in (0, None):
            tail = "\n".join(output.splitlines()[-30:])
            result.problems.append(f"schemathesis round {result.rounds} exited {status}:\n{tail}")
            break
    result.seconds = time.monotonic() - started
    if result.cases < cases and not result.problems:
        result.problems.append(f"only {result.cases} of {cases} cases within {max_time:.0f} s")
    return result


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""
