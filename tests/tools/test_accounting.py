"""KV-cache accounting: scheme definitions, the DESIGN.md reference figures, CLI."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from pagedbackend.accounting import (
    PRESETS, KVModel, format_bytes, model_from_config, reserved_positions,
    scheme_report, utilisation_report)

ROOT = Path(__file__).resolve().parents[2]
WORKED = [37, 91, 128, 201, 511]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pagedbackend.accounting", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def by_label(reports):
    return {(r.scheme, r.block_size): r for r in reports}


# ---------------------------------------------------------------- schemes

@pytest.mark.parametrize("scheme, length, max_len, block_size, expected", [
    ("max", 1, 512, None, 512), ("max", 512, 512, None, 512),
    ("pow2", 1, 512, None, 1), ("pow2", 37, 512, None, 64), ("pow2", 64, 512, None, 64),
    ("pow2", 65, 512, None, 128), ("pow2", 300, 384, None, 384),  # capped at max_len
    ("oracle", 37, 512, None, 37), ("oracle", 384, 384, None, 384),
    ("paged", 1, 512, 16, 16), ("paged", 16, 512, 16, 16), ("paged", 17, 512, 16, 32),
    ("paged", 37, 512, 32, 64), ("paged", 300, 384, 256, 512),  # a last page may pass max_len
])
def test_reserved_positions_matches_hand_computed_cases(scheme, length, max_len, block_size, expected):
    assert reserved_positions(scheme, length, max_len, block_size) == expected


@given(length=st.integers(1, 4096), log_bs=st.integers(0, 8))
def test_paged_waste_is_less_than_one_block(length, log_bs):
    block_size = 1 << log_bs
    allocated = reserved_positions("paged", length, 4096, block_size)
    assert allocated % block_size == 0
    assert 0 <= allocated - length < block_size


@given(length=st.integers(1, 4096))
def test_schemes_are_ordered_oracle_pow2_max(length):
    oracle, pow2, fixed = (reserved_positions(s, length, 4096) for s in ("oracle", "pow2", "max"))
    assert length == oracle <= pow2 <= fixed == 4096
    assert pow2 < 2 * length


def test_paged_needs_a_block_size():
    with pytest.raises(ValueError, match="block_size"):
        reserved_positions("paged", 10, 512)


def test_unknown_scheme_is_rejected():
    with pytest.raises(ValueError, match="unknown scheme"):
        reserved_positions("buddy", 10, 512)


# ---------------------------------------------------------------- worked example

def test_worked_example_matches_design_figures():
    reports = by_label(utilisation_report(WORKED, 512, [16, 32]))

    assert all(r.effective == 968 for r in reports.values())
    assert reports["max", None].allocated == 2560
    assert f"{100 * reports['max', None].utilisation:.2f}" == "37.81"
    assert reports["paged", 16].allocated == 992
    assert f"{100 * reports['paged', 16].utilisation:.2f}" == "97.58"
    assert reports["paged", 32].allocated == 1024
    assert f"{100 * reports['paged', 32].utilisation:.2f}" == "94.53"
    assert reports["pow2", None].allocated == 64 + 128 + 128 + 256 + 512
    assert reports["oracle", None].allocated == 968


def test_report_splits_waste_into_fragmentation_and_reservation():
    # Prompts 20 and 40 of final lengths 37 and 91, 16-position pages.
    reports = by_label(utilisation_report([37, 91], 512, [16], prompt_lengths=[20, 40]))

    fixed, paged = reports["max", None], reports["paged", 16]
    assert fixed.internal_fragmentation == 2 * 512 - 128
    assert fixed.reserved_unused == (37 - 20) + (91 - 40)
    # Paged holds only the tail of the last prompt block: 32 - 20 and 48 - 40.
    assert paged.internal_fragmentation == (48 - 37) + (96 - 91)
    assert paged.reserved_unused == 12 + 8


def test_reserved_is_unknown_without_prompt_lengths():
    assert all(r.reserved_unused is None for r in utilisation_report(WORKED, 512, [16]))


# ---------------------------------------------------------------- bytes

def test_kv_bytes_per_token_reproduces_opt_13b_and_smollm2():
    opt = KVModel(**PRESETS["opt-13b"], dtype_bytes=2)
    smol = KVModel(**PRESETS["smollm2-135m"], dtype_bytes=2)

    assert opt.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 819_200
    assert format_bytes(opt.kv_bytes_per_token) == "819,200 B (800 KB)"
    assert smol.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert smol.kv_bytes_per_block(16) == 16 * 23_040


def test_paged_bytes_include_block_tables():
    smol = KVModel(**PRESETS["smollm2-135m"])

    paged = scheme_report("paged", WORKED, 512, 16, model=smol)
    fixed = scheme_report("max", WORKED, 512, model=smol)

    assert paged.num_blocks == 992 // 16
    assert paged.block_table_bytes == 4 * 62
    assert paged.allocated_bytes == 992 * 23_040 + 4 * 62
    assert fixed.allocated_bytes == 2560 * 23_040
    assert fixed.effective_bytes == paged.effective_bytes == 968 * 23_040


def test_model_config_defaults_kv_heads_and_head_dim(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 40, "num_attention_heads": 40, "hidden_size": 5120}))
    gqa = tmp_path / "gqa.json"
    gqa.write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                               "num_key_value_heads": 3, "hidden_size": 576}))

    assert model_from_config(str(tmp_path)) == KVModel(40, 40, 128, 2)
    assert model_from_config(str(gqa)).kv_bytes_per_token == 23_040


# ---------------------------------------------------------------- CLI

def test_cli_prints_worked_example_table():
    result = run_cli("--lengths", "37,91,128,201,511", "--max-len", "512", "--block-sizes", "16,32")

    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "effective: 968 positions" in out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()
            if line.startswith(("Orca", "Paged"))}
    assert rows["Orca (Max), fixed 512"][4:7] == ["2560", "37.81", "%"]
    assert rows["Paged, 16-position pages"][3:6] == ["992", "97.58", "%"]
    assert rows["Paged, 32-position pages"][3:6] == ["1024", "94.53", "%"]


def test_cli_prints_kv_bytes_for_preset_and_flags():
    preset = run_cli("--lengths", "37", "--max-len", "512", "--preset", "opt-13b")
    flags = run_cli("--lengths", "37", "--max-len", "512", "--layers", "30",
                    "--kv-heads", "3", "--head-dim", "64", "--dtype-bytes", "2")

    assert "= 819,200 B (800 KB)" in preset.stdout
    assert "= 23,040 B" in flags.stdout


def test_cli_json_output_has_the_same_figures():
    result = run_cli("--lengths", "37,91,128,201,511", "--max-len", "512",
                     "--block-sizes", "16,32", "--preset", "smollm2-135m", "--json")

    doc = json.loads(result.stdout)
    allocated = {(s["scheme"], s["block_size"]): s["allocated"] for s in doc["schemes"]}
    assert doc["effective"] == 968
    assert allocated == {("max", None): 2560, ("pow2", None): 1088, ("oracle", None): 968,
                         ("paged", 16): 992, ("paged", 32): 1024}
    assert doc["model"]["kv_bytes_per_token"] == 23_040
    assert doc["model"]["kv_bytes_per_block"]["16"] == 16 * 23_040


@pytest.mark.parametrize("args, message", [
    (["--lengths", ""], "empty"),
    (["--lengths", "37,abc"], "not an integer"),
    (["--lengths", "37,2.5"], "not an integer"),
    (["--lengths", "37,0"], "positive"),
    (["--lengths", "37,-5"], "positive"),
    (["--lengths", "37,513"], "exceeds max_len"),
    (["--lengths", "37", "--block-sizes", "24"], "power of two"),
    (["--lengths", "37", "--block-sizes", "0"], "positive"),
    (["--lengths", "37", "--layers", "30"], "incomplete model"),
])
def test_cli_rejects_bad_input_with_a_clear_error(args, message):
    result = run_cli("--max-len", "512", *args)

    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- sliding windows

def test_windowed_bytes_give_back_blocks_that_left_the_window():
    # Six layers, five with a 1,024-position window: at 8k context the paged
    # cache holds 1/6 of full allocation for the full layer plus each windowed
    # layer's last 1,024 positions (64 blocks of 16: the next query, at 8,192, sees 7,169 on).
    model = KVModel(layers=6, kv_heads=1, head_dim=16, dtype_bytes=4, layer_windows=(1024,) * 5 + (None,))
    report = scheme_report("paged", [8192], 8192, 16, model=model)
    per_layer_block = 2 * 1 * 16 * 4 * 16
    assert model.windowed_blocks(8192, 16) == 512 + 5 * 64
    assert report.windowed_bytes == (512 + 5 * 64) * per_layer_block + 6 * report.block_table_bytes
    assert report.allocated_bytes == 8192 * 6 * per_layer_block // 16 + report.block_table_bytes
    assert report.windowed_bytes / report.allocated_bytes < 0.28
    assert scheme_report("max", [8192], 8192, model=model).windowed_bytes is None


def test_cli_adds_windowed_bytes_for_a_sliding_window_model(tmp_path):
    result = run_cli("--lengths", "8192", "--max-len", "8192", "--preset", "gemma3-4b")
    assert result.returncode == 0, result.stderr
    assert "bytes, windows freed" in result.stdout
    assert "sliding windows: 29 of 34 layers (window 1024), 7 KV groups of 5 layers per block" in result.stdout
    flags = run_cli("--lengths", "100,3000", "--max-len", "4096", "--layers", "6", "--kv-heads", "1",
                    "--head-dim", "16", "--sliding-window", "512", "--sliding-pattern", "5:1", "--json")
    doc = json.loads(flags.stdout)
    assert doc["model"]["layer_windows"] == [512] * 5 + [None] and doc["model"]["kv_groups"] == 6
    paged = next(s for s in doc["schemes"] if s["scheme"] == "paged")
    assert paged["windowed_bytes"] < paged["allocated_bytes"]
    bad = run_cli("--lengths", "37", "--max-len", "512", "--preset", "opt-13b", "--sliding-pattern", "5:1")
    assert bad.returncode == 2 and "--sliding-pattern needs --sliding-window" in bad.stderr


def test_model_config_reads_each_layers_window(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64,
         "use_sliding_window": True, "sliding_window": 32,
         "layer_types": ["sliding_attention", "full_attention"] * 2}))
    assert model_from_config(str(tmp_path)).layer_windows == (32, None, 32, None)
