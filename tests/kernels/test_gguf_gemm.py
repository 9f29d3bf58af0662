"""The GGUF product kernel (kernels/csrc/gguf_gemm.c) on both of its paths:
the AVX-512 one that decodes blocks straight into registers (where the CPU
has it) and the portable one. Every type multiplies by exactly the reference
dequantisation's values (a one-hot x reads them back bit for bit, as does
widening whole rows) and sums
within float32's rounding of a float64 product, for 1..17 rows of x over K
spanning several super-blocks, weight-row counts that are not a multiple of
the rows decoded together, and a row map."""
import os
import pathlib
import platform
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from loadtest.tiny_gguf import quantize
from pagedbackend.kernels import native
from pagedbackend.models.gguf_linear import GGUFLinear, load_library

KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
K = 768   # three super-blocks, 24 blocks of 32


@pytest.fixture(params=[1, 0], ids=["avx512", "portable"])
def path(request):
    lib = load_library()
    default = lib.gguf_gemm_avx512(-1)
    taken = lib.gguf_gemm_avx512(request.param)
    if taken != request.param:
        lib.gguf_gemm_avx512(default)
        pytest.skip("this CPU lacks AVX-512 (BW, VL) with F16C and FMA")
    yield taken
    lib.gguf_gemm_avx512(default)


def weights(kind, rows, seed):
    blocks = quantize(np.random.default_rng(seed).normal(size=(rows, K)).astype(np.float32), kind)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).copy())


@pytest.mark.parametrize("kind", KINDS)
def test_every_type_multiplies_by_the_reference_values_for_1_to_17_rows(path, kind):
    blocks, reference = weights(kind, 13, seed=KINDS.index(kind))
    layer = GGUFLinear([torch.from_numpy(blocks)], [kind], K)
    assert torch.equal(layer.dequantized(), reference)   # the rows widened whole (gguf_get_rows)
    g = torch.Generator().manual_seed(0)
    for rows in range(1, 18):
        cols = torch.randint(0, K, (rows,), generator=g)
        one_hot = torch.zeros(rows, K)
        one_hot[torch.arange(rows), cols] = 1.0
        assert torch.equal(layer(one_hot), reference[:, cols].T), f"{rows} rows: not the reference's weights"
        x = torch.randn(rows, K, generator=g)
        exact = x.double() @ reference.double().T
        bound = 2 * K * 2.0 ** -24 * (x.abs().double() @ reference.abs().double().T) + 1e-30
        error = (layer(x).double() - exact).abs()
        assert (error <= bound).all(), f"{rows} rows: error {error.max():.3g} past float32's rounding"


def test_merged_parts_of_two_types_read_through_a_row_map(path):
    qa, wa = weights("Q4_K", 10, seed=10)
    qb, wb = weights("Q6_K", 7, seed=11)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(1))
    layer = GGUFLinear([torch.from_numpy(qa), torch.from_numpy(qb)], ["Q4_K", "Q6_K"], K, [order, None])
    reference = torch.cat([wa[order], wb])
    eye = torch.eye(K)[:: K // 16]
    assert torch.equal(layer(eye), reference[:, :: K // 16].T)
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x).double(), x.double() @ reference.double().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_builds_held_to_avx2_or_the_baseline_compute_the_same(capability):
    """``ATEN_CPU_CAPABILITY`` builds the kernel for x86-64-v3 or -v2 alone (no
    AVX-512 path, no runtime dispatch): the portable path passes the tests above
    in a process held to it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the instruction-set builds are x86-64's")
    if capability == "avx2" and not {"avx2", "fma"} <= set(native._cpu_flags().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}   # a build of its own: the flags key it
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "-n", "0", __file__, "-k", "not held_to", "-rs"], env=env, capture_output=True, text=True,
                         timeout=600, cwd=pathlib.Path(__file__).parents[2])
    assert run.returncode == 0, run.stdout[-3000:]
    assert "7 passed" in run.stdout and "lacks AVX-512" in run.stdout, run.stdout[-3000:]
