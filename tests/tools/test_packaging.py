"""What a non-editable install gets: every C and C++ source the kernels
build from, and a server that runs its linear layers through the C++
operators built from them."""
import os
import pathlib
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
    # Every C and C++ file inside a packaged package's folder (the packages
    # the wheel holds a module of): what its modules compile at first use.
    packages = {name.rpartition("/")[0] for name in names if name.endswith(".py")}
    sources = sorted(str(path.relative_to(ROOT)) for package in packages
                     for path in (ROOT / package).rglob("*") if path.suffix in (".c", ".cpp"))
    assert {"pagedbackend/kernels/csrc/packed_ops.cpp", "loadtest/bench/csrc/fma_probe.c"} <= set(sources)
    missing = [name for name in sources if name not in names]
    assert missing == [], f"the wheel lacks {missing}"


@pytest.mark.timeout(600)
def test_a_non_editable_install_serves_with_the_native_operators(tmp_path, tiny_model_dir):
    # A fresh venv whose only pagedbackend is a regular install of a copy of
    # the tree; the other packages come from this venv's site-packages as a
    # plain path (its editable hook for pagedbackend is not read).
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "results", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (pathlib.Path(purelib) / "outer_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                                "--target", purelib, str(source)], capture_output=True, text=True, timeout=280)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    script = f"""
import pathlib, sys
import pagedbackend
assert pathlib.Path(pagedbackend.__file__).is_relative_to({purelib!r}), pagedbackend.__file__
from loadtest.harness.triton import TritonServer
from pagedbackend.serving.repository import make_model_repository
from client import generate
repo = make_model_repository({str(tmp_path / 'repo')!r}, {{"model": {str(tiny_model_dir)!r}, "num_kv_blocks": 64,
                                                      "compile": False, "linear_backend": "packed"}},
                             source={str(ROOT / 'model_repository')!r})
with TritonServer(repo, ready_timeout_s=300) as server:
    result = generate("Hello", {{"max_tokens": 4, "temperature": 0, "ignore_eos": True}}, url=server.grpc_url)
    print("TOKENS", result.num_output_tokens)
    print(server.log_path.read_text(errors="replace"))
"""
    ran = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=500,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "TOKENS [4]" in ran.stdout, ran.stdout[-2000:]
    served = [line for line in ran.stdout.splitlines() if "paged_llm: serving" in line]
    assert served and "linear_backend=packed" in served[0] and "native_ops=True" in served[0], ran.stdout[-3000:]
