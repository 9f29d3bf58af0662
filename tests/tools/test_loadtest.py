"""A short locust run against a real tritonserver: every request succeeds and
every latency metric is reported."""
import json
import pathlib

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    from loadtest.harness.triton import TritonServer
    from pagedbackend.serving.repository import make_model_repository
    repo = make_model_repository(tmp_path_factory.mktemp("repo"),
                                 {"model": str(tiny_model_dir), "num_kv_blocks": 128, "max_num_seqs": 16,
                                  "compile": False})
    with TritonServer(repo) as srv:
        yield srv


@pytest.mark.parametrize("arrival", ["closed", "poisson"])
def test_short_locust_run_over_grpc_and_http_has_no_failures(server, tmp_path, tiny_model_dir, arrival):
    from loadtest.run_locust import run_locust
    summary = run_locust(server.http_url, server.grpc_url, tmp_path, users=4, run_time="240s",
                         max_requests=10, workload="alpaca", protocol="both", arrival=arrival, rate=4.0,
                         max_output_tokens=12, tokenizer=str(tiny_model_dir), timeout=300)
    log = (tmp_path / "locust.log").read_text()[-3000:]
    assert summary["failures"] == 0, log
    # Every request is counted, and the run ended when its last request did, not at its time limit.
    assert summary["requests"] == 10, log
    assert summary["seconds"] < 200, log
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = summary["metrics"][name]
        assert m["count"] > 0 and 0 <= m["p50_ms"] <= m["p90_ms"] <= m["p99_ms"] and m["mean_ms"] > 0, (name, m)
    # Locust keeps times under 100 ms in whole milliseconds, so tokens read from one network chunk (gaps
    # under 0.5 ms) give an inter-token p50 of 0; a first token or a whole request never takes that little.
    assert summary["metrics"]["ttft"]["p50_ms"] > 0 and summary["metrics"]["e2e"]["p50_ms"] > 0
    assert summary["metrics"]["e2e"]["p50_ms"] >= summary["metrics"]["ttft"]["p50_ms"]
    assert summary["output_tokens"] > 0 and summary["output_tokens_per_s"] > 0
    saved = json.loads((pathlib.Path(tmp_path) / "summary.json").read_text())
    assert saved["metrics"].keys() == summary["metrics"].keys()
    assert (pathlib.Path(tmp_path) / "summary.csv").read_text().startswith("metric,count,p50_ms")


def test_a_short_soak_with_cancellations_and_bad_requests_finds_nothing_wrong(server, tmp_path, tiny_model_dir):
    from loadtest.soak import soak
    limits = {"max_num_seqs": 16, "max_model_len": 512, "max_prompt_chars": 16 * 512}

    summary = soak(server, limits, tmp_path, minutes=0.4, users=4, max_output_tokens=12)

    assert summary["ok"], (summary, (tmp_path / "locust.log").read_text()[-3000:])
    assert summary["unexpected_failures"] == 0 and summary["leaked_blocks"] == 0
    assert summary["by_kind"].get("ok", 0) > 0 and summary["requests"] == sum(summary["by_kind"].values())
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    assert summary["stub_rss_mb"]["start"] > 0 and summary["stub_rss_mb"]["end"] > 0
