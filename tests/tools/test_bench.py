"""Benchmarks (loadtest/bench): each one's core computation on a tiny input.
No benchmark runs at full size here."""
import argparse
import asyncio
import importlib
import json
import math
import pathlib
import shutil
import subprocess

import pytest
import torch

from loadtest import workloads
from loadtest.bench import capacity, hf, memory, plots, replay, server
from loadtest.bench.__main__ import BENCHMARKS
from pagedbackend.accounting import reserved_positions, scheme_report
from pagedbackend.config import EngineConfig

Request = workloads.Request

ROOT = pathlib.Path(__file__).resolve().parents[2]


def make_engine(model_dir, **kw):
    from pagedbackend import LLMEngine
    settings = dict(model=str(model_dir), block_size=16, num_kv_blocks=256, max_model_len=512,
                    enable_prefix_caching=False, compile=False)
    settings.update(kw)
    return LLMEngine(EngineConfig(**settings))


# ---------------------------------------------------------------- memory

def test_memory_utilisation_at_finish_equals_the_accounting_module():
    trace = workloads.sharegpt_like(50, seed=3)
    rows = memory.trace_accounting(trace, 2048, [16, 64])
    lengths, prompts = [r.total_len for r in trace], [r.prompt_len for r in trace]
    for row in rows:
        expected = scheme_report(row["scheme"], lengths, 2048, row["block_size"], prompts)
        assert row["utilisation_at_finish"] == expected.utilisation
        assert row["allocated"] == expected.allocated
    assert [r["label"] for r in rows] == ["Orca (Max)", "Orca (Pow2)", "Orca (Oracle)",
                                         "Paged (16)", "Paged (64)"]


def test_lifetime_utilisation_counts_every_step_a_request_lives():
    # prompt 3, output 2: two steps holding 3 and 4 positions (7 stored).
    trace = [Request(3, 2)]
    assert memory.lifetime_utilisation(trace, "oracle", 16) == {"stored": 7, "held": 10, "utilisation": 0.7}
    assert memory.lifetime_utilisation(trace, "max", 16)["held"] == 32
    assert memory.lifetime_utilisation(trace, "pow2", 16)["held"] == 2 * 8
    assert memory.lifetime_utilisation(trace, "paged", 16, block_size=4)["held"] == 4 + 4


@pytest.mark.parametrize("mode", ["max", "pow2", "oracle"])
def test_reservation_modes_reserve_what_the_accounting_module_says(tiny_model_dir, mode):
    trace = [Request(5, 7), Request(20, 40), Request(3, 90)]
    engine = make_engine(tiny_model_dir, block_size=1, num_kv_blocks=4096, kv_reservation=mode,
                         watermark=0.0)
    prompts = workloads.make_prompt_token_ids(trace, engine.vocab_size, seed=0)
    jobs = replay.jobs_from_trace(trace, prompts)
    for job in jobs:
        engine.add_request(job.request_id, job.prompt, _greedy(job.max_tokens))

    engine.step()

    stats = engine.get_stats()
    assert stats.allocated_slots == sum(reserved_positions(mode, r.total_len, 512) for r in trace)
    assert stats.stored_positions == sum(r.prompt_len for r in trace)


def test_live_ledger_agrees_with_the_accounting_over_lifetimes(tiny_model_dir):
    trace = [Request(5, 12), Request(30, 20), Request(9, 6)]
    rows = memory.live_ledger(str(tiny_model_dir), trace, 512, 16, seed=0, progress=False)
    assert [r["mode"] for r in rows] == ["max", "pow2", "oracle", "paged"]
    for row in rows:
        assert row["utilisation"] == pytest.approx(row["accounting_over_lifetime"], abs=0.03)
    by_mode = {r["mode"]: r["utilisation"] for r in rows}
    assert by_mode["paged"] > by_mode["oracle"] > by_mode["pow2"] > by_mode["max"]


# ---------------------------------------------------------------- replay / capacity

def _greedy(n):
    from pagedbackend import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_replay_measures_latency_from_the_trace_arrival_time(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    jobs = [replay.Job("a", [100, 101, 102], 3, 0.0), replay.Job("b", [200, 201], 2, 0.3)]

    result = replay.replay(engine, jobs, realtime=True)

    assert result.seconds >= 0.3
    recs = {r.request_id: r for r in result.requests}
    assert recs["b"].arrival == pytest.approx(0.3, abs=0.05)
    assert [recs["a"].output_tokens, recs["b"].output_tokens] == [3, 2]
    assert all(r.finished and 0 < r.ttft <= r.latency for r in recs.values())
    assert len(result.stored) == len(result.allocated) == result.steps


def test_replay_time_limit_cuts_off_and_counts_unfinished_requests(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    jobs = [replay.Job("slow", [100] * 8, 400, 0.0)]

    result = replay.replay(engine, jobs, realtime=False, time_limit=0.2)

    assert result.timed_out
    (rec,) = result.requests
    assert not rec.finished and rec.normalised_latency == pytest.approx(rec.latency / 400)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0


def test_capacity_point_finishes_a_handful_of_requests_with_well_formed_rows(tiny_model_dir):
    args = argparse.Namespace(block_size=16, num_kv_blocks=32, max_model_len=256, max_num_seqs=64,
                              max_num_batched_tokens=512, seed=0, modes=["paged", "oracle"],
                              point_time_limit=60.0)
    trace = workloads.alpaca_like(5, seed=0, max_model_len=256)
    trace = [Request(r.prompt_len, min(r.output_len, 8)) for r in trace]

    points, saturation = capacity.sweep(str(tiny_model_dir), args, trace, [20.0, 40.0],
                                        bound=math.inf, fixed_rate=20.0, progress=False)

    assert list(points) == list(saturation) == ["paged", "oracle"]
    assert all(s["finished"] == 5 and s["capacity_req_s"] > 0 for s in saturation.values())
    summary = capacity.summarise(points, saturation, bound=math.inf, fixed_rate=20.0)
    assert summary["modes"]["paged"]["at_least"] and summary["modes"]["oracle"]["running_at_fixed_rate"] > 0
    assert set(summary["ratios"]["paged/oracle"]) >= {"saturated_throughput", "sustainable_rate"}
    for pts in points.values():
        assert [p["rate"] for p in pts] == [20.0, 40.0]
        for p in pts:
            assert p["finished"] == 5 and not p["timed_out"]
            assert p["output_tokens"] == sum(r.output_len for r in trace)
            assert p["normalised_latency_s"] > 0 and p["mean_running"] > 0


def test_sustainable_rate_interpolates_the_bound_crossing():
    pts = [{"rate": r, "normalised_latency_s": y, "timed_out": False}
           for r, y in [(1, 0.1), (2, 0.2), (3, 0.6)]]
    best, crossing = capacity.sustainable_rate(pts, bound=0.4)
    assert best == 2 and crossing == pytest.approx(2.5)
    assert capacity.sustainable_rate(pts, bound=1.0) == (3, 3)        # never crossed: a lower bound
    assert capacity.sustainable_rate(pts, bound=0.05) == (None, None)


# ---------------------------------------------------------------- hf

def test_left_padding_puts_every_prompt_at_the_right_edge():
    ids, mask = hf.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_static_batches_run_to_their_longest_output():
    batches = list(hf.hf_batches([[1], [2], [3]], [4, 9, 2], batch_size=2))
    assert [(len(p), new) for p, _, new in batches] == [(2, 9), (1, 2)]


def test_hf_static_batching_generates_the_engines_greedy_tokens(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts, lengths = [[100, 200, 300, 400], [500, 600], [700, 800, 900]], [5, 3, 4]

    ours = hf.run_engine(str(tiny_model_dir), prompts, lengths, max_num_seqs=8)
    theirs = hf.run_hf(model, 2, prompts, lengths, batch_size=2)

    assert theirs["tokens"] == ours["tokens"]
    assert theirs["generated_tokens"] == 2 * 5 + 4


# ---------------------------------------------------------------- blocksize

def test_swap_micro_benchmark_and_kv_block_size(tiny_model_dir):
    blocksize = importlib.import_module("loadtest.bench.blocksize")
    engine = make_engine(tiny_model_dir, block_size=8)
    assert blocksize.kv_bytes_per_block(str(tiny_model_dir), 8) == engine.runner.kv_bytes_per_block

    rows = blocksize.micro(str(tiny_model_dir), [8, 32], tokens=64, repeats=1)

    assert [(r["block_size"], r["blocks"]) for r in rows] == [(8, 8), (32, 2)]
    assert all(r["swap_out_in_ms"] > 0 and r["recompute_ms"] > 0 for r in rows)


def test_swap_preemption_is_timed_when_the_pool_is_short(tiny_model_dir):
    blocksize = importlib.import_module("loadtest.bench.blocksize")
    # Two admitted sequences of 20 prompt tokens need a third block each past
    # position 32: 6 blocks, one more than the pool.
    engine = blocksize.make_engine(str(tiny_model_dir), 16, 512, 0, "swap", swap_blocks=64,
                                   num_kv_blocks=5)
    trace = [Request(20, 16), Request(20, 16)]

    row = blocksize.offline_run(engine, trace, seed=0)

    assert row["finished"] == 2 and row["preemptions"] > 0
    assert row["swapped_blocks"] > 0 and row["swap_seconds"] > 0


# ---------------------------------------------------------------- server driver, plots, registry

def test_server_driver_records_first_token_and_tokens_per_request():
    async def send(i):
        await asyncio.sleep(0.01)
        yield 0, ""            # a response without tokens does not count as the first token
        await asyncio.sleep(0.02)
        yield 2, "ab"
        yield 1, "c"

    records, seconds = asyncio.run(server.drive(send, ["p", "q"], [3, 3], [0.0, 0.05], "test"))

    assert [r["tokens"] for r in records] == [3, 3] and [r["text"] for r in records] == ["abc", "abc"]
    assert all(0.02 < r["ttft"] <= r["latency"] for r in records)
    assert seconds >= 0.05
    summary = server.summarise(records, seconds)
    assert summary["output_tokens"] == 6 and summary["median_ttft_s"] > 0.02


def test_openai_api_benchmark_pairs_each_api_request_with_the_grpc_one_of_its_round():
    from loadtest.bench import openai_api
    grpc = [(0.010, 0.1, "a"), (0.050, 0.2, "b"), (0.020, 0.1, "c")]
    api = [(0.012, 0.1, "a"), (0.053, 0.2, "b"), (0.024, 0.1, "x")]   # +2, +3, +4 ms; one text differs
    records = {path: list(grpc) for path in openai_api.PATHS}
    records["completions"] = api

    summary = openai_api.summarise(records)

    added = summary["added"]["completions"]
    assert added["against"] == "grpc" and abs(added["added_ttft"]["median_ms"] - 3.0) < 1e-9
    assert added["same_text"] == 2 / 3
    assert summary["paths"]["grpc"]["ttft"]["median_ms"] == 20.0
    assert summary["added"]["chat"]["added_ttft"]["median_ms"] == 0.0



# ---------------------------------------------------------------- peers

def test_peers_quantized_settings_are_named_and_checked(capsys):
    from loadtest.bench import peers
    assert peers.parse_args(["--quantized", "w8a8,int8", "--int8"]).quantized == ["w8a8", "int8"]
    assert peers.parse_args([]).quantized == []
    with pytest.raises(SystemExit):
        peers.parse_args(["--quantized", "int3"])
    assert "--quantized takes int8, int4, w8a8; got 'int3'" in capsys.readouterr().err


def test_peers_summary_splits_ttft_tpot_and_inter_token_gaps():
    from loadtest.bench import peers
    # One request: tokens at 0.1 s (2 of them), 0.3 s and 0.6 s after sending.
    done = {"sent": 10.0, "events": [(0.1, 2), (0.3, 1), (0.6, 1)], "error": None, "done": True}
    cut = {"sent": 10.5, "events": [(0.2, 1)], "error": "TimeoutError: late", "done": False}

    summary = peers.summarise("x", [done, cut], [4, 4])

    assert summary["finished"] == 1 and summary["output_tokens"] == 5 and summary["requested_tokens"] == 8
    assert summary["ttft_ms_p50"] in (100.0, 200.0) and summary["ttft_ms_p90"] == 200.0
    assert summary["tpot_ms_p50"] == pytest.approx(1000 * 0.5 / 3, abs=0.05)
    assert summary["itl_ms_p50"] in (200.0, 300.0) and summary["itl_ms_p90"] == 300.0
    assert summary["seconds"] == pytest.approx(0.7) and summary["errors"] == ["TimeoutError: late"]


@pytest.mark.parametrize("capability,held", [("avx2", True), ("avx512", False), (None, False)])
def test_vllm_is_held_to_avx2_by_onednn_not_by_torch(monkeypatch, capability, held):
    from loadtest.bench import peer_servers
    if capability is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    env = peer_servers.vllm_env(2)
    assert "ATEN_CPU_CAPABILITY" not in env
    assert (env.get("ONEDNN_MAX_CPU_ISA"), env.get("MKL_ENABLE_INSTRUCTIONS")) == (("AVX2", "AVX2") if held
                                                                                else (None, None))
    assert env["OMP_NUM_THREADS"] == "2"


def test_peer_commands_carry_their_speculative_flags():
    """vLLM's ``--speculative-config`` JSON and llama-server's draft model or
    n-gram type (this llama.cpp build removed ``--draft-max`` and needs
    ``--spec-type`` to use a draft at all); without them the commands are as
    before, and no peer needs to be installed to build them."""
    from loadtest.bench import peer_servers
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain = peer_servers.vllm("/v/python", "/m", 8001, 2, 16)
    command = peer_servers.vllm("/v/python", "/m", 8001, 2, 16, speculative_config=spec).command
    assert "--speculative-config" not in plain.command
    assert command[:len(plain.command)] == plain.command
    assert json.loads(command[command.index("--speculative-config") + 1]) == spec

    base = peer_servers.llama("/b/llama-server", "t.gguf", 8002, 2, 4).command
    assert "--metrics" in base and not any(arg.startswith("--spec") or arg == "-md" for arg in base)
    draft = peer_servers.llama("/b/llama-server", "t.gguf", 8002, 2, 4, draft_gguf="d.gguf", draft_max=5).command
    assert draft[:len(base)] == base
    assert draft[len(base):] == ["--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-n-max", "5"]
    assert "--draft-max" not in draft and "--draft" not in draft
    ngram = peer_servers.llama("/b/llama-server", "t.gguf", 8002, 2, 4, spec_type="ngram-simple",
                               draft_max=4, ngram_size=3).command
    assert ngram[len(base):] == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                 "--spec-ngram-simple-size-m", "4"]


def test_peer_acceptance_is_read_from_vllm_and_llama_cpp_counters():
    """Both peers' ``spec_decode`` counters (vLLM's labelled, with creation
    timestamps beside them; llama.cpp's bare) give the same acceptance."""
    from loadtest.bench import peer_servers
    vllm_page = "\n".join([
        "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 22.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.79e+09',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 99.0'])
    llama_page = "\n".join([
        "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter",
        "llamacpp:spec_decode_num_draft_tokens_total 40",
        "llamacpp:spec_decode_num_accepted_tokens_total 22",
        "llamacpp:spec_decode_num_drafts_total 10",
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8',
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 6',
        "llamacpp:tokens_predicted_total 99"])
    expected = {"draft_tokens": 40, "accepted_tokens": 22, "acceptance_rate": 0.55, "verifications": 10,
                "accepted_per_verification": 2.2, "accepted_per_position": [0.8, 0.6]}
    for page in (vllm_page, llama_page):
        after = peer_servers.parse_spec_counters(page)
        assert after == {"num_drafts": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 22.0,
                         "num_accepted_tokens_per_pos[0]": 8.0, "num_accepted_tokens_per_pos[1]": 6.0}
        assert peer_servers.draft_acceptance({}, after) == expected
        assert peer_servers.draft_acceptance(after, after) is None
    assert peer_servers.parse_spec_counters("llamacpp:tokens_predicted_total 5") == {}
    assert peer_servers.spec_counters("http://127.0.0.1:9") == {}   # nothing listens: no counters


@pytest.mark.parametrize("ending, expected", [
    ("os.kill(os.getpid(), signal.SIGILL)", "was killed by SIGILL (an instruction this CPU will not run"),
    ("sys.exit(3)", "exited with status 3; its log ends"),
])
def test_a_peer_server_that_dies_at_start_is_reported_with_its_signal_and_last_log_lines(ending, expected):
    """A peer binary built for another CPU dies of SIGILL while loading (as a
    llama-server whose AMX kernel the machine refused did): the error names
    the signal and keeps the end of its log, also when cut to length."""
    import sys
    from loadtest.bench import peer_servers
    from loadtest.harness.triton import free_port
    code = ("import os, resource, signal, sys\n"
            "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"   # no core file
            "print('\\n'.join(f'line {i}' for i in range(400)), flush=True)\n"
            "print('loading model, last words', flush=True)\n" + ending)
    server = peer_servers.Server("fake-peer", [sys.executable, "-c", code], free_port(), "/health",
                                 ready_timeout_s=60)
    with pytest.raises(RuntimeError) as raised:
        server.start()
    message = str(raised.value)
    assert message.startswith("fake-peer ") and expected in message
    assert message.rstrip().endswith("loading model, last words")
    text = peer_servers.error_text(raised.value, limit=200)
    assert len(text) < 220 and text.startswith("RuntimeError: fake-peer ")
    assert text.endswith("loading model, last words") and "[...]" in text
    assert peer_servers.error_text(ValueError("short")) == "ValueError: short"
    from loadtest.bench import peers
    line = peers.offline_report("fake", {"error": text, "output_tokens_per_s": 0.0})
    assert line.startswith("offline fake: failed: RuntimeError: fake-peer ") and "\n" not in line
    assert expected[:20] in line
    assert peers.offline_report("ours", {"output_tokens_per_s": 12.34}) == "offline ours: 12.3 tokens/s"


def test_peers_bench_runs_our_system_alone_when_no_peer_is_installed(tiny_model_dir, tmp_path,
                                                                     monkeypatch, capsys):
    from loadtest.bench import peers
    for var in ("BENCH_VLLM_PYTHON", "BENCH_VLLM_ENV", "BENCH_LLAMA_SERVER", "BENCH_GGUF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("sys.argv", ["python -m loadtest.bench", "peers", "--quick"])

    result = peers.main(["--model", str(tiny_model_dir), "--quick", "--no-compile", "--threads", "1",
                         "--max-output", "6", "--vllm-python", str(tmp_path / "absent-python"),
                         "--int8", "--out", str(tmp_path)])

    printed = capsys.readouterr().out
    assert "skipped: vLLM" in printed and "skipped: llama.cpp" in printed
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["offline"] == result["offline"] and len(saved["peers_skipped"]) == 2
    assert saved["offline"]["warm_up"].startswith(f"{saved['offline']['requests']} prompts")
    offline, offline_int8 = saved["offline"]["rows"]
    assert offline["system"] == "ours" and offline["output_tokens"] == saved["offline"]["output_tokens"]
    assert offline["output_tokens_per_s"] > 0 and offline["vs_ours"] == 1.0
    assert offline_int8["system"] == "ours int8" and offline_int8["output_tokens"] == offline["output_tokens"]
    assert 0 <= offline_int8["same_first_8_tokens_as_ours"] <= 1
    assert [r["system"] for r in saved["serving"]["rows"]] == ["ours", "ours int8"]
    for serving in saved["serving"]["rows"]:
        assert serving["finished"] == serving["requests"] == 4
        assert serving["output_tokens"] == serving["requested_tokens"]
        assert 0 < serving["ttft_ms_p50"] and serving["tpot_ms_p50"] is not None
        # the server's own step counters, scraped from /metrics around the run
        assert serving["server_steps"] > 0
        assert serving["server_step_ms_mean"] >= serving["server_forward_ms_mean"] > 0
        assert serving["server_tokens_per_step"] > 0
    assert (tmp_path / "peers.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_bench_exits_with_a_message_without_cuda(tmp_path):
    from loadtest.bench import gpu
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--out", str(tmp_path)])
    assert "no CUDA device" in str(exit_info.value.code) and "nothing was measured" in str(exit_info.value.code)
    assert not (tmp_path / "gpu.json").exists()

def test_results_record_the_command_that_made_them(tmp_path, monkeypatch):
    from loadtest.bench.common import write_result
    monkeypatch.setattr("sys.argv", ["python -m loadtest.bench", "memory", "--quick"])

    path = write_result(str(tmp_path), "memory", {"x": 1})

    doc = json.loads(path.read_text())
    assert doc["command"] == "python -m loadtest.bench memory --quick" and doc["x"] == 1
    assert "synthetic" in doc["workloads"]


def test_plots_write_a_png(tmp_path):
    fig, (ax,) = plots.figure()
    plots.grouped_bars(ax, ["a", "b"], {"x": [0.5, 0.25]}, percent=True)
    path = plots.save(fig, str(tmp_path), "check", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_registered_benchmark_has_a_main():
    for name in BENCHMARKS:
        assert callable(importlib.import_module(f"loadtest.bench.{name}").main), name


def test_bf16_gemm_bench_times_every_path_this_cpu_has(tmp_path):
    from pagedbackend.models import bf16_linear
    if bf16_linear.unavailable(torch.device("cpu"), torch.bfloat16):
        pytest.skip(f"no bfloat16 kernel here: {bf16_linear.unavailable(torch.device('cpu'), torch.bfloat16)}")
    from loadtest.bench import bf16_gemm
    result = bf16_gemm.main(["--quick", "--shapes", "o", "--threads", "1", "--out", str(tmp_path)])
    assert [(r["shape"], r["m"]) for r in result["rows"]] == [("o", 1), ("o", 32)]
    paths = {"torch", "kernel"} | ({"paired"} if bf16_linear.load_library().bf16_gemm_paired_available() else set())
    for row in result["rows"]:   # the bench checked each path's product against torch's before timing it
        assert {key for key in row if isinstance(row[key], dict)} == paths
        assert row["torch"]["x_torch"] == 1 and all(row[p]["gflops"] > 0 for p in paths)


def test_gguf_gemm_bench_times_every_product_of_a_type_after_checking_it(tmp_path):
    from loadtest.bench import gguf_gemm
    from pagedbackend.models.gguf_linear import int8_activations_unavailable
    result = gguf_gemm.main(["--quick", "--types", "Q4_0,Q5_K", "--shapes", "o", "--threads", "1",
                             "--out", str(tmp_path)])
    assert [(r["type"], r["m"]) for r in result["rows"]] == [("Q4_0", 1), ("Q4_0", 32), ("Q5_K", 1), ("Q5_K", 32)]
    int8 = int8_activations_unavailable() is None
    for row in result["rows"]:   # every type has panels: int8 products from its blocks and from them
        products = {key for key in row if isinstance(row[key], dict)}
        assert products == {"default"} | ({"int8 blocks", "int8 panels"} if int8 else set())
        assert all(row[p]["gflops"] > 0 for p in products)
        assert ("panels_x_blocks" in row) == ("int8 panels" in products)
    with pytest.raises(SystemExit, match="unknown type 'Q3_K'"):
        gguf_gemm.main(["--quick", "--types", "Q3_K", "--out", str(tmp_path)])
    if int8:   # the kernel as of a revision, on the same panels, checked equal before it is timed
        # ... and over copies of the layer called in turn (20 MB: 8 copies of 2.4 MB), each call's products checked
        result = gguf_gemm.main(["--quick", "--types", "Q4_0", "--shapes", "o", "--threads", "1", "--cpu-time",
                                 "--against", "HEAD", "--from-memory", "20", "--out", str(tmp_path)])
        assert result["cpu_time"] and all(row["x_rev"] > 0 and "panels @HEAD" in row for row in result["rows"])
        assert result["from_memory_mb"] == 20
    calls = []
    in_turn = gguf_gemm.in_turn([lambda x, i=i: calls.append(i) for i in range(3)])
    for _ in range(7):
        in_turn(None)
    assert all(sorted(calls[i:i + 3]) == [0, 1, 2] for i in range(5))   # each in turn, none skipped


def test_cpu_kernels_bench_times_each_kernel_beside_what_it_replaces(tmp_path):
    from pagedbackend.kernels import sdpa_attention as sa
    from pagedbackend.kernels import native
    if native.unavailable(torch.device("cpu"), torch.float32) or sa.native_decode() is None:
        pytest.skip("no C compiler here for the CPU kernels")
    from loadtest.bench import cpu_kernels
    result = cpu_kernels.main(["--quick", "--int8", "--threads", "1", "--out", str(tmp_path)])
    peak = result["peak"]
    assert peak["lanes"] in (8, 16) and peak["measured_fma_gflops"] > 0
    assert peak["stated_peak_gflops"] == pytest.approx(1 * peak["nominal_ghz"] * 2 * peak["lanes"] * 2)
    assert [(r["m"], r["shape"]) for r in result["shapes"]] == \
        [(m, s) for m in (8, 32) for s in ("qkv", "o", "gate_up", "down", "lm_head")]
    assert all(r["streamed_gflops"] > 0 and r["resident_gflops"] > 0 for r in result["shapes"])
    assert [r["m"] for r in result["matmuls"]] == [1, 8]
    for r in result["matmuls"]:
        assert r["packed_ms"] > 0 and r["F.linear_ms"] > 0
        assert r["max_rel_error_lm_head"] < 1e-5   # the same product, rounded differently
        assert r["packed int8_ms"] > 0 and r["torch int8_ms"] > 0 and r["packed int8_speedup"] > 0
    assert [(r["seqs"], r["mean_len"]) for r in result["attention"]] == [(1, 64), (4, 64)]
    assert all(r["max_abs_error"] < 1e-4 and r["kernel_us"] > 0 for r in result["attention"])
    assert sa.USE_NATIVE_DECODE   # the comparison leaves the kernel on
    assert (tmp_path / "cpu_kernels.json").exists()


def test_cpu_kernels_bench_sets_the_kernel_beside_its_version_at_a_git_revision(tmp_path):
    from pagedbackend.kernels import native
    if native.unavailable(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler here for the CPU kernels")
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: there is no revision to build the kernel of")
    from loadtest.bench import cpu_kernels
    result = cpu_kernels.main(["--parts", "matmuls,attention", "--ms", "3,13", "--rounds", "1", "--int8",
                               "--against", "HEAD", "--head-rows", "2", "--unpacked", "--threads", "1",
                               "--seqs", "3", "--mean-lens", "40", "--out", str(tmp_path)])
    assert result["against"] == "HEAD" and result["head_rows"] == 2
    for r in result["matmuls"]:
        assert r["kernel_ms"] > 0 and r["kernel@HEAD_ms"] > 0 and r["against_ratio"] > 0
        assert r["max_rel_error_lm_head"] < 1e-5
        assert r["unpacked_ms"] > 0 and r["kernel_vs_unpacked"] > 0
        assert r["kernel int8@HEAD_ms"] > 0 and r["against_ratio_int8"] > 0
    (attention,) = result["attention"]   # the decode kernel at HEAD, the same product
    assert attention["before_us"] > 0 and attention["against_ratio"] > 0
    assert attention["before_max_abs_error"] < 1e-5 and attention["max_abs_error"] < 1e-4
    with pytest.raises(SystemExit, match="no-such-revision"):
        cpu_kernels.main(["--parts", "matmuls", "--ms", "1", "--rounds", "1",
                          "--against", "no-such-revision", "--out", str(tmp_path)])


def test_quant_quality_bench_compares_settings_and_kernels_with_fp32(default_model_dir, tmp_path):
    from loadtest.bench import quant_quality
    from pagedbackend.kernels import native
    if native.unavailable(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler here for the packed kernels")
    result = quant_quality.main(["--quick", "--order", "none,int8,int8/torch,int4:float", "--threads", "1",
                                 "--out", str(tmp_path)])
    rows = {r["quantization"]: r for r in result["rows"]}
    assert list(rows) == ["none", "int8", "int8/torch", "int4:float"]
    assert [rows[m]["linear_backend"] for m in rows] == ["packed", "packed", "torch", "torch"]
    # int4:ACTIVATIONS sets int4_activations: float rows, so no panel copy beside the 4-bit blocks
    assert rows["int4:float"]["weight_bytes"] < rows["int8"]["weight_bytes"]
    assert rows["int4:float"]["perplexity"] == pytest.approx(rows["none"]["perplexity"], rel=0.05)
    assert rows["none"]["identical_outputs"] == result["prompts"] and rows["none"]["position_match"] == 1.0
    for mode in ("int8", "int8/torch"):
        assert 0 <= rows[mode]["position_match"] <= 1 and rows[mode]["offline_tokens_per_s"] > 0
        assert rows[mode]["weight_bytes"] < rows["none"]["weight_bytes"] / 2
        # the same int8 weights: perplexity within a rounding of the activations
        assert rows[mode]["perplexity"] == pytest.approx(rows["none"]["perplexity"], rel=0.05)
    assert (tmp_path / "quant_quality.json").exists()


# ---------------------------------------------------------------- specdecode and structured

def test_specdecode_workloads_are_seeded_and_copy_prompts_hold_what_the_answer_copies():
    from loadtest.bench import specdecode
    first, again = specdecode.copy_prompts(6, seed=3), specdecode.copy_prompts(6, seed=3)
    assert first == again and first != specdecode.copy_prompts(6, seed=4)
    assert "Rename the function" in first[0] and "def " in first[0]
    assert len(set(specdecode.chat_prompts(12, seed=3))) > 1


def test_specdecode_heldout_is_written_apart_and_repeat_asks_each_question_again_later():
    from loadtest.bench.spec_workloads import REPEATS, WORKLOADS
    heldout, copy = WORKLOADS["heldout"](8, seed=0), WORKLOADS["copy"](8, seed=0)
    assert heldout == WORKLOADS["heldout"](8, seed=0) and len(set(heldout)) == 8
    first_lines = lambda prompts: {p.split("\n")[1].split(" ")[0] for p in prompts}  # noqa: E731
    assert not first_lines(heldout) & first_lines(copy)   # other templates from the first word on
    repeat = WORKLOADS["repeat"](12, seed=0)
    assert len(set(repeat)) == 12 // REPEATS and all(repeat.count(p) == REPEATS for p in set(repeat))
    firsts = [repeat.index(p) for p in set(repeat)]
    assert sorted(firsts) == list(range(len(firsts)))   # every question's first ask comes before any repeat


def test_closed_loop_keeps_the_streams_busy_and_times_each_token():
    import time as clock
    from loadtest.bench import specdecode

    def stream(prompt):
        for _ in range(int(prompt)):
            clock.sleep(0.01)
            yield 1
    records = specdecode.closed_loop(stream, ["3", "5", "4", "2"], concurrency=2)
    assert sorted(r["i"] for r in records) == [0, 1, 2, 3]
    row = specdecode.summarise(records)
    assert row["output_tokens"] == 14 and not row["errors"]
    assert 5 <= row["tpot_ms_p50"] < 100 and row["tok_s"] > 0


def test_structured_bench_compares_constrained_and_free_decoding(tiny_model_dir, tmp_path):
    from loadtest.bench import structured
    result = structured.main(["--model", str(tiny_model_dir), "--quick", "--compile", "false",
                              "--concurrency", "4", "--max-tokens", "8", "--out", str(tmp_path)])
    [pair] = result["rounds"]
    assert pair["free"]["generated_tokens"] > 0 and pair["json_schema"]["generated_tokens"] > 0
    assert pair["json_schema"]["mask_ms_per_step"] >= 0 and result["compile_s_small"][0] > 0
    assert (tmp_path / "structured.json").exists()


def test_lora_bench_compares_adapter_mixes_with_the_base_model(tiny_model_dir, tmp_path, monkeypatch):
    from loadtest.bench import lora
    monkeypatch.delenv("BENCH_VLLM_PYTHON", raising=False)
    result = lora.main(["--model", str(tiny_model_dir), "--quick", "--no-compile", "--threads", "1",
                        "--adapters", str(tmp_path / "adapters"), "--out", str(tmp_path)])
    rows = {row["configuration"]: row for row in result["table"]}
    assert set(rows) == {"base, LoRA off", "base, LoRA on", "1 x rank 8", "2 x rank 8", "half base + 2 x rank 8"}
    assert rows["base, LoRA off"]["tok_s_vs_base"] == 1.0 and all(r["tok_s"] > 0 for r in rows.values())
    assert rows["half base + 2 x rank 8"]["base_requests_tpot_vs_base_alone"] > 0
    assert result["pool"]["rank_page_bytes"] > 0 and result["pool"]["page_in_ms_rank8"] >= 0
    assert "skipped" in result["vllm"] and (tmp_path / "lora.json").exists()


def test_lora_peer_servers_name_the_adapters_for_vllm_and_in_our_multi_lora_json(tiny_model_dir):
    """vLLM gets --enable-lora with --max-loras set to the adapter count and each
    adapter as a model; ours gets enable_lora and the adapters in multi_lora.json
    (no peer needs to be installed to build them)."""
    from argparse import Namespace
    from loadtest.bench import lora_peers
    from pagedbackend import LoRARequest
    args = Namespace(streams=32, threads=2, max_tokens=8)
    loras = [LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")]
    server, _ = lora_peers.vllm(args, "/v/python", str(tiny_model_dir), loras, 8)
    command = server.command
    assert command[command.index("--max-loras") + 1] == "2" and "--enable-lora" in command
    assert command[command.index("--max-lora-rank") + 1] == "8"
    assert command[command.index("--lora-modules") + 1:][:2] == ["a=/adapters/a", "b=/adapters/b"]
    ours, _ = lora_peers.ours(args, str(tiny_model_dir), loras, 8)
    repo = ours.command[ours.command.index("--model-repository") + 1]
    folder = pathlib.Path(repo) / "paged_llm" / "1"
    assert json.loads((folder / "multi_lora.json").read_text()) == {"a": "/adapters/a", "b": "/adapters/b"}
    from pagedbackend.serving.repository import read_parameters
    parameters = read_parameters((folder.parent / "config.pbtxt").read_text())
    assert parameters["enable_lora"] == "true" and parameters["max_loras"] == "2"
    shutil.rmtree(repo)


def test_models_bench_times_our_decode_step_beside_transformers_forward(tiny_family):
    from loadtest.bench import models
    row = models.measure("gemma3", tiny_family("gemma3"), batch=2, context=8, steps=2, rounds=1)
    assert row["ours_ms"] > 0 and row["hf_ms"] > 0 and row["params_m"] > 0


def test_moe_bench_reads_the_active_experts_once_per_step_and_generates_hugging_faces_tokens(tmp_path):
    from loadtest.bench import moe
    from pagedbackend.kernels import native
    if native.unavailable(torch.device("cpu"), torch.float32, "fused_moe"):
        pytest.skip("no C compiler here for the fused MoE kernel")
    result = moe.main(["--small", "--enforce-eager", "--streams", "1,2", "--decode-tokens", "4",
                       "--prompt-tokens", "8", "--prefill-tokens", "16", "--rounds", "1",
                       "--hf-experts", "default", "--threads", "1", "--out", str(tmp_path)])
    assert result["expert_kernel"] == "packed" and result["streams"] == [1, 2]
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows)[:2] == ["ours (MoE)", "ours (dense, same active size)"]
    assert any(name.startswith("Hugging Face (MoE") for name in rows)
    for row in rows.values():   # every rate measured: none left empty by noise
        assert all(row[f"decode_tok_s_{n}"] > 0 for n in (1, 2)) and row["prefill_tok_s"] > 0
    # one stream's decode step reads its top-k experts of every layer, no more and no less
    cfg = moe.QUICK_MOE
    # gate, up and down, held in bfloat16: the benchmark's checkpoint is written in bfloat16
    assert result["expert_dtype"] == "bfloat16"
    expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2
    floor = cfg["num_hidden_layers"] * cfg["num_experts_per_tok"] * expert
    assert result["active_expert_floor_bytes_one_stream"] == floor
    assert rows["ours (MoE)"]["expert_bytes_per_step_1"] == floor and result["read_over_floor_one_stream"] == 1
    # two streams read each expert once however many of their tokens it serves
    assert floor <= rows["ours (MoE)"]["expert_bytes_per_step_2"] <= 2 * floor
    assert result["every_expert_bytes"] == cfg["num_hidden_layers"] * cfg["num_experts"] * expert
    assert "expert_bytes_per_step_1" not in rows["ours (dense, same active size)"]
    assert result["same_tokens_as_hf"] is True
    assert json.loads((tmp_path / "moe.json").read_text())["rows"] == result["rows"]



def test_aiperf_bench_reads_the_servers_own_time_to_first_token_and_its_parts():
    """Prometheus text served over loopback, read before and after a run:
    means per request of the run's histograms, summed over labels."""
    import http.server
    import threading
    from loadtest.bench import aiperf

    pages = []

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages[-1].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def text(ttft_sum, count, queue_sum, triton_us, success):
        return (f"# TYPE vllm:time_to_first_token_seconds histogram\n"
                f'vllm:time_to_first_token_seconds_sum{{model_name="a"}} {ttft_sum}\n'
                f'vllm:time_to_first_token_seconds_count{{model_name="a"}} {count}\n'
                f'vllm:request_queue_time_seconds_sum{{model_name="a"}} {queue_sum / 2}\n'
                f'vllm:request_queue_time_seconds_sum{{model_name="b"}} {queue_sum / 2}\n'
                f'vllm:request_queue_time_seconds_count{{model_name="a"}} {count}\n'
                f'nv_inference_queue_duration_us{{model="paged_llm",version="1"}} {triton_us}\n'
                f'nv_inference_request_success{{model="paged_llm",version="1"}} {success}\n')

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        pages.append(text(1.0, 2, 0.5, 1000, 2))
        before = aiperf.scrape(url)
        pages.append(text(5.0, 6, 2.5, 401000, 6))
        times = aiperf.server_times(before, aiperf.scrape(url))
    finally:
        server.shutdown()
    assert times["engine_ttft_s"] == 1.0 and times["engine_queue_s"] == 0.5
    assert times["engine_prefill_s"] is None and times["triton_queue_s"] == 0.1
    assert aiperf.scrape("http://127.0.0.1:1/metrics") == {}


def test_embed_bench_pairs_our_embeddings_with_sentence_transformers(tmp_path, monkeypatch, capsys):
    from loadtest.bench import embed
    monkeypatch.delenv("BENCH_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("sys.argv", ["python -m loadtest.bench", "embed", "--quick"])
    assert embed.main(["--quick", "--threads", "1", "--inputs", "12", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "embed.json").read_text())
    assert saved["inputs"] == 12 and saved["rounds"] == 1 and saved["command"].endswith("embed --quick")
    systems = saved["systems"]
    ours, bf16 = systems["ours (LLM.embed)"], systems["ours (LLM.embed, dtype=bfloat16)"]
    st = systems["sentence-transformers (encode, batches of 32)"]
    for row in (ours, bf16, st):
        assert row["sentences_per_s"] > 0 and row["single_p50_ms"] > 0 and len(row["sentences_per_s_rounds"]) == 1
    assert saved["ratios"]["ours (LLM.embed)"]["sentences_per_s"] == pytest.approx(
        ours["sentences_per_s"] / st["sentences_per_s"])
    # float32 gives sentence-transformers' embeddings, or the figures compare nothing; bfloat16 says how far it is
    assert ours["max_cosine_distance_to_st"] < 1e-4 and 0 < bf16["max_cosine_distance_to_st"] < 0.05
    assert "not run" in systems["vLLM CPU build (LLM.embed)"]["error"]
    assert "| ours (LLM.embed) |" in printed and "x sentence-transformers" in printed
