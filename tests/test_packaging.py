"""What a non-editable install gets: every C and C++ source the kernels build from."""
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_the_wheel_carries_every_kernel_source(tmp_path):
    # A copy of the sources: a build/ folder left in the checkout would hide what the package data lacks.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "results", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=280)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheel = next(tmp_path.glob("pagedbackend-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in (".c", ".cpp"))
    assert "packed_ops.cpp" in sources
    missing = [name for name in sources if f"pagedbackend/kernels/csrc/{name}" not in names]
    assert missing == [], f"the wheel lacks {missing}"
