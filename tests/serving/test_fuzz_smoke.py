"""A short ``make fuzz`` (``loadtest.fuzz``) on real servers: about 100
schemathesis cases against the OpenAI app's schema and 100 hypothesis-drawn
JSON bodies against tritonserver's generate, generate_stream and infer
routes. The pass rule: no 5xx but the documented ones, both servers up and
ready, no KV block left in use, a canary completion answered."""
import json

import pytest

from loadtest import fuzz

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_short_fuzz_of_both_front_ends_finds_no_server_error_and_leaves_them_serving(tmp_path, capsys):
    argv = ["--cases", "100", "--no-coverage", "--max-time", "90", "--triton-cases", "100",
            "--triton-max-time", "60", "--seed", "1", "--out", str(tmp_path)]

    status = fuzz.main(argv)

    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    parts = {line["part"]: line for line in lines}
    found = "\n".join(path.read_text() for path in tmp_path.glob("*-failures.txt"))
    assert status == 0 and set(parts) == {"schema", "triton"}, found or lines
    assert parts["schema"]["failures"] == 0 and parts["schema"]["cases"] >= 100, parts["schema"]
    triton = parts["triton"]
    assert triton["failures"] == 0 and triton["cases"] == 100, triton
    # The bodies reached the model: some were served, some refused by it.
    assert triton["statuses"].get("200", 0) > 0 and triton["statuses"].get("400", 0) > 0, triton
    assert not (tmp_path / ".schemathesis").exists()   # kept in the run's schemathesis folder
