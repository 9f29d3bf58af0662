"""The GGUF product kernel (kernels/csrc/gguf_gemm.c) on both of its paths:
the AVX-512 one that decodes blocks straight into registers (where the CPU
has it) and the portable one. Every type multiplies by exactly the reference
dequantisation's values (a one-hot x reads them back bit for bit, as does
widening whole rows) and sums
within float32's rounding of a float64 product, for 1..17 rows of x over K
spanning several super-blocks, weight-row counts that are not a multiple of
the rows decoded together, and a row map. With int8 activations (where the
CPU has AVX-512 VNNI) the products are those of the rounded rows."""
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
from pagedbackend.models.gguf_linear import GGUFLinear, int8_activations_unavailable, load_library

KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
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


def rounded_to_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the int8-activation path rounds it: per ``group`` values, dx =
    max|x| / 127, v = rint(x * (1 / dx)); returned as v * dx in float64."""
    g = x.reshape(x.shape[0], -1, group)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inverse).double() * d.double()).reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_int8_activations_give_the_product_of_the_rounded_rows_for_1_to_17_rows(kind):
    """``quantization=w8a8`` on a GGUF file: x rounded per group of 32 (per
    super-block of 256 for the K-quants, whose integer sub-block scales then
    weigh int32 sums) times the reference's weights, within float32's rounding
    of the float64 product; the rounding itself stays within 2 % of the
    magnitudes; a group of zeros gives zeros."""
    if int8_activations_unavailable():
        pytest.skip(f"int8-activation GGUF products: {int8_activations_unavailable()}")
    blocks, reference = weights(kind, 13, seed=20 + KINDS.index(kind))
    layer = GGUFLinear([torch.from_numpy(blocks)], [kind], K)
    layer.int8_activations = True
    group = 256 if kind.endswith("_K") else 32
    g = torch.Generator().manual_seed(3)
    for rows in range(1, 18):
        x = torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 10
        x[0, :group] = 0.0
        magnitude = x.abs().double() @ reference.abs().double().T + 1e-30
        rounded = rounded_to_int8(x, group)
        expected = rounded @ reference.double().T
        bound = 2 * K * 2.0 ** -24 * (rounded.abs() @ reference.abs().double().T) + 1e-30
        error = (layer(x).double() - expected).abs()
        assert (error <= bound).all(), f"{rows} rows: error {error.max():.3g} past float32's rounding"
        assert ((expected - x.double() @ reference.double().T).abs() / magnitude).max() < 0.02
    zeros = torch.zeros(2, K)
    assert torch.equal(layer(zeros), torch.zeros(2, 13))


def test_int8_activations_mix_groups_of_32_and_256_in_one_call_through_a_row_map():
    """A merged layer of a K-quant (super-blocks of 256) and Q8_0 (groups of
    32) rows rounds x both ways in one call; rows read through a map."""
    if int8_activations_unavailable():
        pytest.skip(f"int8-activation GGUF products: {int8_activations_unavailable()}")
    qa, wa = weights("Q6_K", 9, seed=30)
    qb, wb = weights("Q8_0", 6, seed=31)
    order = torch.randperm(9, generator=torch.Generator().manual_seed(4))
    layer = GGUFLinear([torch.from_numpy(qa), torch.from_numpy(qb)], ["Q6_K", "Q8_0"], K, [order, None])
    layer.int8_activations = True
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(5))
    expected = torch.cat([rounded_to_int8(x, 256) @ wa[order].double().T, rounded_to_int8(x, 32) @ wb.double().T], 1)
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)


def test_int8_activations_on_panels_read_rows_through_a_map_past_one_panel():
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K parts are copied into
    panels of 16 rows (as many bytes as their blocks, Q4_K's 148 a super-block
    for 144 and Q5_K's 180 for 176, the last panel padded): parts of 37, 21,
    16, 20, 3, 5, 18 and 19 rows, two through a row map, give the product of the
    rounded rows for 1 to 40 rows of x."""
    if int8_activations_unavailable():
        pytest.skip(f"int8-activation GGUF products: {int8_activations_unavailable()}")
    qa, wa = weights("Q4_0", 37, seed=40)
    qb, wb = weights("Q4_1", 21, seed=41)
    qc, wc = weights("Q8_0", 16, seed=42)
    qd, wd = weights("Q4_K", 5, seed=43)
    qe, we = weights("Q6_K", 18, seed=44)
    qf, wf = weights("Q5_K", 19, seed=45)
    qg, wg = weights("Q5_0", 20, seed=46)
    qh, wh = weights("Q5_1", 3, seed=47)
    order = torch.randperm(37, generator=torch.Generator().manual_seed(6))
    order5 = torch.randperm(19, generator=torch.Generator().manual_seed(10))
    layer = GGUFLinear([torch.from_numpy(q) for q in (qa, qb, qc, qg, qh, qd, qe, qf)],
                       ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q6_K", "Q5_K"], K,
                       [order, None, None, None, None, None, None, order5])
    layer.int8_activations = True
    assert [p.numel() for p in layer.panels] == [48 * K // 32 * 18, 32 * K // 32 * 20, 16 * K // 32 * 34,
                                                 32 * K // 32 * 22, 16 * K // 32 * 24,   # Q5_0, Q5_1 as their blocks
                                                 K // 256 * 2368, 2 * K // 256 * 3360, 2 * K // 256 * 2880]
    g = torch.Generator().manual_seed(7)
    for rows in (1, 8, 9, 13, 40):   # tiles of 8 rows of x, the last one of 1 to 8
        x = torch.randn(rows, K, generator=g)
        expected = torch.cat([rounded_to_int8(x, 32) @ torch.cat([wa[order], wb, wc, wg, wh]).double().T,
                              rounded_to_int8(x, 256) @ torch.cat([wd, we, wf[order5]]).double().T], 1)
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)
    layer.int8_activations = False
    assert all(p.numel() == 0 for p in layer.panels)   # the copies go with the setting


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
    assert "11 passed" in run.stdout and "lacks AVX-512" in run.stdout, run.stdout[-3000:]


def test_int4_layers_are_q4_1_blocks_the_reference_dequantises_to_their_weights():
    """``quantization=int4``'s layer packs (q, d, m) as GGUF Q4_1 blocks: gguf-py
    reads them back as exactly ``dequantize_int4``'s weights, they unpack to the
    same (q, d, m), and the kernel multiplies by those weights."""
    from pagedbackend.models.gguf_q4 import unpack_q4_1
    from pagedbackend.quant.int4 import Int4Linear, dequantize_int4, pack_q4_1, quantize_int4
    weight = torch.randn(24, K, generator=torch.Generator().manual_seed(5))
    q, d, m = quantize_int4(weight)
    blocks = pack_q4_1(q, d, m)
    reference = dequantize_int4(q, d, m)
    by_gguf = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(torch.from_numpy(by_gguf.copy()), reference)
    assert all(torch.equal(a.to(b.dtype), b) for a, b in zip(unpack_q4_1(blocks.numpy(), K), (q, d, m)))
    layer = Int4Linear(q, d, m)
    assert torch.equal(layer.dequantized(), reference)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(layer(x).double(), x.double() @ reference.double().T, rtol=1e-5, atol=1e-4)


def test_the_cpp_operators_give_the_python_operators_bits_and_messages():
    """``gguf_linear_native`` and ``gguf_linear_q8_native`` (csrc/packed_ops.cpp,
    what layers call where it builds) give the same bits as the Python
    operators for every part kind, a row map, bfloat16 rows, a call past
    WIDEN_ROWS, and refuse bad arguments with the same messages."""
    from pagedbackend.models import gguf_linear
    if not gguf_linear.native_ops_usable():
        pytest.skip("the C++ operators did not build here (no C++ compiler or torch headers)")
    qa, _ = weights("Q4_K", 9, seed=50)
    qb, _ = weights("Q8_0", 6, seed=51)
    qc, _ = weights("Q6_K", 17, seed=52)
    order = torch.randperm(9, generator=torch.Generator().manual_seed(8))
    layer = GGUFLinear([torch.from_numpy(q) for q in (qa, qb, qc)], ["Q4_K", "Q8_0", "Q6_K"], K, [order, None, None])
    ops = torch.ops.pagedbackend
    g = torch.Generator().manual_seed(9)
    int8 = int8_activations_unavailable() is None
    for rows, dtype in ((1, torch.float32), (5, torch.bfloat16), (gguf_linear.WIDEN_ROWS, torch.float32)):
        x = torch.randn(rows, K, generator=g).to(dtype)
        args = (layer.weights, layer.row_maps, layer.types, layer.out_features)
        assert torch.equal(ops.gguf_linear_native(x, *args), ops.gguf_linear(x, *args))
        if int8:
            layer.int8_activations = True
            args = (layer.weights, layer.row_maps, layer.panels, layer.types, layer.out_features)
            native_y = ops.gguf_linear_q8_native(x, *args)
            assert native_y.dtype == dtype and torch.equal(native_y, ops.gguf_linear_q8(x, *args))
            layer.int8_activations = False
    x = torch.randn(2, K)
    bad = [(dict(types=[99, 8, 14]), "ggml type 99 is not one the GGUF kernels take"),
           (dict(out=33), "gguf_linear weights have 32 rows, not 33"),
           (dict(x=torch.randn(2, K // 2)), r"a Q4_K weight of 384 columns is uint8 \[rows, 144\] contiguous"),
           (dict(weights=[layer.weights[0].to(torch.float16), *layer.weights[1:]]),
            r"a Q4_K weight of 768 columns is uint8 \[rows, 432\] contiguous; got torch.float16 \(9, 432\)"),
           (dict(maps=[order[:4], layer.row_maps[1], layer.row_maps[2]]), "a row map has one int64 index per weight row")]
    for change, message in bad:
        call = (change.get("x", x), change.get("weights", layer.weights), change.get("maps", layer.row_maps),
                change.get("types", layer.types),
                change.get("out", layer.out_features))
        for op in (ops.gguf_linear, ops.gguf_linear_native):
            with pytest.raises(ValueError, match=message):
                op(*call)
