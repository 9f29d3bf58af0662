"""The GPU report compiles the Triton-lang kernels for NVIDIA targets on this
CPU machine (no GPU needed) and fails when a kernel does not compile, spills or
overflows shared memory: one configuration per kernel for sm_90 here, the whole
matrix in ``make gpu-check``."""
import json
import os
import subprocess
import sys

import pytest
import triton
import triton.language as tl

from pagedbackend.kernels import gpu_launches, gpu_report
from pagedbackend.kernels.gpu_launches import Launch

THIS_MODULE = os.path.splitext(os.path.basename(__file__))[0]


@triton.jit
def _dot_too_small(x_ptr, BLOCK: tl.constexpr):
    # The interpreter multiplies 8 x 8 tiles; a GPU's fp16 tl.dot needs K >= 16.
    r = tl.arange(0, BLOCK)
    a = tl.load(x_ptr + r[:, None] * BLOCK + r[None, :])
    tl.store(x_ptr + r[:, None] * BLOCK + r[None, :], tl.dot(a, a))


@triton.jit
def _too_many_live_values(x_ptr, BLOCK: tl.constexpr):
    # One warp holding a 128 x 128 fp32 tile: 512 values per thread, over the 255 registers.
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r[:, None] * BLOCK + r[None, :])
    y = x * tl.sum(x, 0)[None, :] + tl.exp(x) * tl.sum(x, 1)[:, None]
    tl.store(x_ptr + r[:, None] * BLOCK + r[None, :], y + tl.sum(y, 0)[None, :])


def _test_launch(name: str, block: int, dtype: str) -> Launch:
    # Compiled in a fresh process, which imports this file by its name (its folder is on sys.path).
    return Launch(THIS_MODULE, name, {"x_ptr": f"*{dtype}", "BLOCK": block}, dtype, options={"num_warps": 1})


def test_quick_set_compiles_each_kernel_for_sm90_within_limits():
    run = subprocess.run([sys.executable, "-m", "pagedbackend.kernels.gpu_report", "--arch", "90",
                          "--set", "quick", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [row["kernel"] for row in rows] == [launch.label for launch in gpu_launches.quick_launches()]
    for row in rows:
        assert set(row) == set(gpu_report.FIELDS)
        assert row["arch"] == 90 and row["ok"] and row["error"] is None, row
        assert 0 < row["registers"] <= 255 and row["spills"] == 0
        assert 0 <= row["shared_bytes"] <= gpu_report.ARCHS[90].shared_per_program
        assert row["cubin_bytes"] > 1000
        assert 0 < row["occupancy"] <= 1 and row["programs_per_sm"] >= 1
        assert row["config"]["num_warps"] == 4 and isinstance(row["config"]["num_stages"], int)
    attention = rows[0]["config"]
    assert (attention["DIM"], attention["GROUP_PAD"], attention["BLOCK_N"]) == (128, 4, 32)
    assert attention["LOWP_DOT"] is True and attention["HAS_SINKS"] is False


def test_every_kernel_of_the_package_has_launches_described():
    assert gpu_report.undescribed_kernels(gpu_launches.all_launches()) == []
    labels = {launch.label for launch in gpu_launches.all_launches()}
    assert {launch.label for launch in gpu_launches.quick_launches()} == labels


def test_broken_kernels_fail_in_their_rows_and_the_rest_still_report():
    good = next(gpu_launches.quick_launches())
    rows = gpu_report.report([_test_launch("_dot_too_small", 8, "fp16"), good,
                              _test_launch("_too_many_live_values", 128, "fp32")], [90], jobs=1)
    broken, fine, spilling = rows
    assert not broken["ok"] and broken["registers"] is None
    assert "CompilationError" in broken["error"] and "K >= 16" in broken["error"]
    assert fine["ok"] and fine["kernel"] == good.label
    assert not spilling["ok"] and spilling["spills"] > 0 and spilling["registers"] > 0
    assert spilling["error"].startswith(f"spills {spilling['spills']} bytes stored")


def test_a_failed_launch_makes_the_command_fail(monkeypatch, capsys):
    monkeypatch.setitem(gpu_launches.SETS, "quick", lambda: [_test_launch("_dot_too_small", 8, "fp16")])
    assert gpu_report.main(["--arch", "90", "--set", "quick", "--json"]) == 1
    out, err = capsys.readouterr()
    row = json.loads(out)
    assert row["ok"] is False and "K >= 16" in row["error"]
    assert "1 FAILED" in err


def test_occupancy_from_registers_shared_memory_and_warps():
    h100 = gpu_report.ARCHS[90]
    # 255 registers: 8,192 per warp (units of 256), 8 warps per SM, two 4-warp programs.
    assert gpu_report.occupancy(h100, 255, 0, 4) == {"programs_per_sm": 2, "occupancy": 0.125,
                                                     "limited_by": "registers"}
    assert gpu_report.occupancy(h100, 32, 120_000, 4)["programs_per_sm"] == 1
    assert gpu_report.occupancy(h100, 32, 0, 4) == {"programs_per_sm": 16, "occupancy": 1.0,
                                                    "limited_by": "warps"}
    a100 = gpu_report.ARCHS[80]
    assert gpu_report.occupancy(a100, 32, 80_000, 4)["programs_per_sm"] == 2


@pytest.mark.parametrize("arch", ["75", "nine"])
def test_an_unknown_arch_is_refused_by_name(arch, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_report.main(["--arch", arch])
    assert exit_.value.code == 2 and arch in capsys.readouterr().err
