"""Packed linear layers (``linear_backend``): the C kernels compute ``x W^T``
(float32 W) and ``x (q s)^T`` (int8 q, a scale per output) for every row
count, output width and input width, compiled or not, whatever the thread
count, called through the Python operators or the C++ ones; an engine serving through them picks the same greedy tokens as one on
``F.linear`` (float32) or computes the model of its dequantised weights
(int8); a setting they cannot serve is refused by name."""
import os
import pathlib
import platform
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from greedy import default_model_greedy
from pagedbackend.config import EngineConfig
from pagedbackend.kernels import native, packed_linear
from pagedbackend.models import bf16_linear
from pagedbackend.quant.int8 import Int8Linear, PackedInt8Linear
from pagedbackend.worker.model_runner import ModelRunner, SeqEntry

REASON = native.unavailable(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"packed kernel unavailable: {REASON}")


NO_CXX = "the C++ operators need a C++ compiler, and none is on PATH"


def load_native_ops():
    """The C++ operators, loaded; a test that needs them is skipped only where no
    C++ compiler exists (a build that fails raises, failing the test)."""
    if native.cxx_compiler() is None:
        pytest.skip(NO_CXX)
    packed_linear.load_native_ops()


@pytest.fixture(params=["python", "native"])
def ops(request, monkeypatch):
    """Layers calling the operators with Python kernels, then those with C++ kernels."""
    if request.param == "native":
        load_native_ops()
    monkeypatch.setattr(packed_linear.native_ops(), "use_native_ops", request.param == "native")
    return request.param


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# Rows: none, one to four (blocks side by side), around the 6- and 12-row
# chunks, a decode batch, both sides of KERNEL_MAX_ROWS. Widths: whole blocks,
# a ragged last block, odd K, enough blocks for a thread to take a group of
# blocks and a smaller one.
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 17, 25, 64, packed_linear.KERNEL_MAX_ROWS,
                                  packed_linear.KERNEL_MAX_ROWS + 1])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 37), (7, 130), (300, 200)])
def test_packed_linear_computes_x_times_w_transposed(rows, out_features, in_features, ops):
    torch.manual_seed(rows)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    layer = packed_linear.PackedLinear(weight)
    assert torch.equal(layer.dequantized(), weight)
    got = layer(x)
    assert got.shape == (rows, out_features)
    if rows:
        assert relative_error(got, F.linear(x, weight)) < 1e-5


# Each output is one float sum over k in order whatever the row count, so a
# step of many rows (several chunks, walked panel by panel over K, partial
# sums kept in y between panels) gives each row exactly what that row alone
# gives (one row: blocks side by side, no panels). K: one panel and a ragged
# rest, several whole panels.
@pytest.mark.parametrize("rows", [13, 25, 32, 64])
@pytest.mark.parametrize("out_features,in_features", [(300, 200), (77, 1536)])
def test_packed_linear_rows_equal_each_row_alone(rows, out_features, in_features):
    torch.manual_seed(rows)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    layer = packed_linear.PackedLinear(weight)
    together = layer(x)
    assert torch.equal(together, torch.cat([layer(x[i:i + 1]) for i in range(rows)]))
    assert relative_error(together, F.linear(x, weight)) < 1e-5


# A weight whose values are all bfloat16 values (a checkpoint published in
# bfloat16) is held in bfloat16, half the bytes, and gives the sums of the
# same weight held in float32 bit for bit at every row count: rows side by
# side, one chunk, several chunks, and unpacked above KERNEL_MAX_ROWS.
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 13, 32, 64, packed_linear.KERNEL_MAX_ROWS + 1])
@pytest.mark.parametrize("out_features,in_features", [(300, 200), (77, 1536)])
def test_packed_linear_holds_bfloat16_weights_in_bfloat16(rows, out_features, in_features, ops):
    torch.manual_seed(rows)
    weight, x = torch.randn(out_features, in_features).bfloat16().float(), torch.randn(rows, in_features)
    held = packed_linear.PackedLinear(weight)
    assert held.packed.dtype == torch.bfloat16
    assert torch.equal(held.dequantized(), weight)
    in_float32 = packed_linear.PackedLinear(weight)
    in_float32.packed = packed_linear.pack(weight)
    assert in_float32.packed.dtype == torch.float32
    assert held.packed.nbytes * 2 == in_float32.packed.nbytes
    got = held(x)
    assert torch.equal(got, in_float32(x))
    assert relative_error(got, F.linear(x, weight)) < 1e-5


def test_packed_linear_keeps_other_weights_in_float32():
    weight = torch.randn(64, 32)
    weight[0, 0] = 1 + 2 ** -10   # not a bfloat16 value
    assert packed_linear.PackedLinear(weight.bfloat16().float()).packed.dtype == torch.bfloat16
    assert packed_linear.PackedLinear(weight).packed.dtype == torch.float32


# int8: one to four rows (blocks side by side), one chunk of rows (widened in
# registers), several chunks (each block widened once into a float copy),
# both sides of KERNEL_MAX_ROWS.
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 12, 13, 17, 64, packed_linear.KERNEL_MAX_ROWS,
                                  packed_linear.KERNEL_MAX_ROWS + 1])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 37), (7, 130), (300, 1536)])
def test_packed_int8_linear_computes_x_times_its_dequantised_weight(rows, out_features, in_features, ops):
    torch.manual_seed(rows + 1)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    layer = PackedInt8Linear(weight)
    dequantized = layer.dequantized()
    assert torch.equal(dequantized, Int8Linear(weight).dequantized())   # the same int8 values
    assert relative_error(dequantized, weight) < 0.01
    got = layer(x)
    assert got.shape == (rows, out_features)
    if rows:
        # Steps from INT8_BF16_MIN_ROWS rows multiply in bfloat16 where that is on.
        inputs = x.bfloat16().float() if packed_linear.int8_rounds_to_bf16(rows) else x
        assert relative_error(got, F.linear(inputs, dequantized)) < 1e-5


@pytest.mark.skipif(not packed_linear.int8_bf16_available(),
                    reason="this CPU (or ATEN_CPU_CAPABILITY) has no AVX512_BF16")
@pytest.mark.parametrize("in_features", [576, 77])
def test_int8_steps_from_a_row_count_multiply_in_bfloat16_and_can_be_switched_off(in_features, ops):
    """With AVX512_BF16 an int8 step of ``INT8_BF16_ROWS`` rows or more (when
    switched on; on by default on AMD CPUs) rounds its rows to bfloat16 (the
    int8 weights are exact in it) and sums in float32, at any row count it is
    set to; fewer rows, or the path switched off, keep float32 rows. A row's
    result does not depend on the other rows."""
    torch.manual_seed(in_features)
    layer = PackedInt8Linear(torch.randn(160, in_features))
    w = layer.dequantized()
    least = packed_linear.INT8_BF16_ROWS
    try:
        for setting, rows in ((least, least), (least, 30), (least, 64), (1, 1), (3, 3), (5, 7)):
            assert packed_linear.set_int8_bf16_rows(setting) == setting
            x = torch.randn(rows, in_features)
            assert packed_linear.int8_rounds_to_bf16(rows)
            on = layer(x)
            assert relative_error(on, F.linear(x.bfloat16().float(), w)) < 1e-5
            assert relative_error(on, F.linear(x, w)) > 1e-4   # the rounding shows
            assert torch.equal(layer(torch.cat([x, x]))[:rows], on)   # in a larger step, the same bits
            assert packed_linear.set_int8_bf16_rows(0) == 0
            assert not packed_linear.int8_rounds_to_bf16(rows)
            assert relative_error(layer(x), F.linear(x, w)) < 1e-5
        packed_linear.set_int8_bf16_rows(least)
        x = torch.randn(least - 1, in_features)
        assert not packed_linear.int8_rounds_to_bf16(least - 1)
        assert relative_error(layer(x), F.linear(x, w)) < 1e-5
    finally:
        packed_linear.set_int8_bf16_rows(packed_linear.native_ops().int8_bf16_min_rows)


def test_int8_bfloat16_path_is_on_by_default_on_amd_cpus_and_follows_the_config():
    """The bfloat16 path was measured faster on AMD Zen 4 and slower on Intel
    Emerald Rapids: ``EngineConfig.int8_bf16`` None follows the CPU's vendor,
    True and False override it either way."""
    vendor = packed_linear.cpu_vendor()
    if platform.machine() in ("x86_64", "AMD64"):
        assert vendor, "no vendor_id in /proc/cpuinfo on an x86 machine"
    expected = packed_linear.INT8_BF16_ROWS if vendor == "AuthenticAMD" else 0
    assert EngineConfig().int8_bf16 is None
    assert packed_linear.int8_bf16_rows(None) == expected
    assert packed_linear.NativeOps().int8_bf16_min_rows == expected   # before any engine sets it
    assert packed_linear.int8_bf16_rows(True) == packed_linear.INT8_BF16_ROWS
    assert packed_linear.int8_bf16_rows(False) == 0


def test_packed_int8_results_do_not_depend_on_the_thread_count(ops):
    torch.manual_seed(6)
    layer = PackedInt8Linear(torch.randn(200, 64))
    threads = torch.get_num_threads()
    try:
        for rows in (1, 5, 20):
            x = torch.randn(rows, 64)
            outputs = []
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                outputs.append(layer(x))
            assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    finally:
        torch.set_num_threads(threads)


def test_packed_int8_refuses_inputs_it_was_not_built_for(ops):
    layer = PackedInt8Linear(torch.randn(40, 32))
    with pytest.raises(ValueError, match=r"packed_linear_int8 takes float32 \[rows, 32\] inputs"):
        layer(torch.randn(3, 33))
    with pytest.raises(ValueError, match="packed_linear_int8 takes float32"):
        layer(torch.randn(3, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="packed_linear_int8 takes float32"):   # the operator does not widen
        torch.ops.pagedbackend.packed_linear_int8(torch.randn(3, 32, dtype=torch.bfloat16), layer.qpacked,
                                                  layer.scales, layer.out_features)


# A bfloat16 (or float16) model's rows: widened to float32 for the kernel (exact),
# the float32 result rounded back; a decode step's row counts and a prefill's
# (a bfloat16 prefill, where the CPU has the paired bfloat16 kernel, multiplies
# in bfloat16 instead: tests/models/test_bf16_linear.py).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 8, 32, packed_linear.KERNEL_MAX_ROWS + 1])
def test_packed_int8_widens_half_precision_rows_and_rounds_the_result_back(rows, dtype, ops):
    torch.manual_seed(rows)
    layer = PackedInt8Linear(torch.randn(300, 200))
    x = torch.randn(1, rows, 200).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (1, rows, 300)
    if dtype == torch.bfloat16 and rows > packed_linear.KERNEL_MAX_ROWS and layer.bf16_prefill:
        assert torch.equal(got[0], torch.ops.pagedbackend.int8_rows_bf16(x[0], layer.qpacked, layer.scales,
                                                                         300).to(dtype))
    else:
        assert torch.equal(got, layer(x.float()).to(dtype))
    assert relative_error(got.float(), F.linear(x.float(), layer.dequantized())) < 1e-2


def test_packed_linear_keeps_leading_dimensions_and_reads_strided_input(ops):
    torch.manual_seed(3)
    weight = torch.randn(64, 48)
    wide = torch.randn(2, 5, 96)
    x = wide[..., ::2]   # not contiguous
    got = packed_linear.PackedLinear(weight)(x)
    assert got.shape == (2, 5, 64)
    assert relative_error(got, F.linear(x, weight)) < 1e-5


def test_results_do_not_depend_on_the_thread_count(ops):
    torch.manual_seed(4)
    weight, x = torch.randn(200, 64), torch.randn(13, 64)
    layer = packed_linear.PackedLinear(weight)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(layer(x))
    finally:
        torch.set_num_threads(threads)
    # each output is one sum over k in order, whichever thread computes its block
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_compiled_call_matches_the_eager_one(ops):
    torch.manual_seed(5)
    layer = packed_linear.PackedLinear(torch.randn(100, 40))
    compiled = torch.compile(lambda x: torch.relu(layer(x)) * 2, dynamic=True, fullgraph=True)
    for rows in (1, 3, 11, 200):
        x = torch.randn(rows, 40)
        assert torch.equal(compiled(x), torch.relu(layer(x)) * 2)


@pytest.mark.parametrize("build,name,message", [
    (native.build, "packed_gemm", "packed_gemm.c: cc: no such target"),
    (native.build_op_library, "packed_ops", "packed_ops.cpp: packed_ops.cpp:1: error: no such header"),
], ids=["c-kernel", "cxx-operators"])
def test_a_compiler_that_fails_is_reported_with_its_message(tmp_path, monkeypatch, build, name, message):
    monkeypatch.setenv("PAGEDBACKEND_CACHE", str(tmp_path))
    failing = tmp_path / "compiler"
    failing.write_text(f"#!/bin/sh\necho '{message.split(': ', 1)[1]}' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match=f"could not build {message}"):
        build(name, str(failing))


def runner(model_dir, **overrides) -> ModelRunner:
    settings = dict(model=str(model_dir), block_size=16, num_kv_blocks=64, device="cpu",
                    attention_backend="sdpa", compile=False)
    return ModelRunner(EngineConfig(**{**settings, **overrides}))


def test_runner_packs_every_projection_and_the_tied_lm_head(tiny_model_dir):
    packed, plain = runner(tiny_model_dir, linear_backend="packed"), runner(tiny_model_dir, linear_backend="torch")
    assert packed.linear_backend == "packed" and plain.linear_backend == "torch"
    layers = list(packed.model.projections())
    assert layers and all(isinstance(layer.matmul, packed_linear.PackedLinear) for layer in layers)
    assert isinstance(packed.model.lm_head_matmul, packed_linear.PackedLinear)
    prompt = list(range(300, 340))
    for entries in ([SeqEntry(prompt, 0, [1, 2, 3])], [SeqEntry([prompt[0]], 40, [1, 2, 3])]):
        assert relative_error(packed.execute_model(entries), plain.execute_model(entries)) < 1e-4


def test_packed_engine_picks_the_greedy_tokens_of_f_linear(default_model_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
               "A haiku about autumn:", "Once upon a time,"]
    outputs = {backend: default_model_greedy(prompts, 24, linear_backend=backend)
               for backend in ("torch", "packed")}
    assert outputs["packed"] == outputs["torch"]


@pytest.mark.parametrize("settings,named", [
    (dict(linear_backend="mkl"), "linear_backend must be one of auto, torch, packed"),
    (dict(linear_backend="packed", quantization="int4"),
     "linear_backend=packed serves float32 and int8 weights; it cannot be combined with quantization=int4"),
    (dict(linear_backend="packed", quantization="w8a8"),
     "linear_backend=packed serves float32 and int8 weights; it cannot be combined with quantization=w8a8"),
])
def test_unsupported_linear_backend_is_refused_by_name(settings, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(**settings)


def test_packed_backend_where_it_cannot_run_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="linear_backend=packed cannot run here: the C kernel "
                                         "packed_gemm.c is float32; the model's dtype is torch.float16"):
        runner(tiny_model_dir, linear_backend="packed", dtype="float16")
    auto = runner(tiny_model_dir, dtype="float16")   # auto falls back to F.linear
    assert auto.linear_backend == "torch"
    # bfloat16 goes through bf16_linear's kernel where this CPU multiplies bfloat16, else is refused by name
    reason = bf16_linear.unavailable(torch.device("cpu"), torch.bfloat16)
    if reason is None:
        assert runner(tiny_model_dir, linear_backend="packed", dtype="bfloat16").linear_backend == "bf16"
    else:
        with pytest.raises(ValueError, match="linear_backend=packed cannot run here: " + re.escape(reason)):
            runner(tiny_model_dir, linear_backend="packed", dtype="bfloat16")


@pytest.mark.parametrize("x", [torch.randn(2, 15), torch.randn(2, 16, dtype=torch.float64)], ids=["width", "dtype"])
@pytest.mark.parametrize("op", ["packed_linear", "packed_linear_native"])
def test_an_input_that_does_not_fit_the_weight_is_refused_by_name(x, op):
    load_native_ops()
    layer = packed_linear.PackedLinear(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"packed_linear takes float32 \[rows, 16\] inputs"):
        getattr(torch.ops.pagedbackend, op)(x, layer.packed, 8)


def python_kernel_calls(fn, *args) -> int:
    """How many times ``fn(*args)`` enters the Python kernel of ``packed_linear``."""
    calls = []
    code = packed_linear._packed_linear_cpu.__code__
    sys.setprofile(lambda frame, event, arg: calls.append(1) if event == "call" and frame.f_code is code else None)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return len(calls)


def test_layers_use_the_native_operators_and_a_compiled_call_stays_out_of_python(monkeypatch):
    """Where the C++ operators build, layers use them by default, and a compiled
    call runs their C++ kernel without entering Python."""
    load_native_ops()
    assert packed_linear.native_ops().decide() and packed_linear.native_ops().use_native_ops
    layer = packed_linear.PackedLinear(torch.randn(40, 24))
    x = torch.randn(3, 24)
    for native_ops, entered in ((False, True), (True, False)):
        monkeypatch.setattr(packed_linear.native_ops(), "use_native_ops", native_ops)
        compiled = torch.compile(lambda x: layer(x) + 1, dynamic=True, fullgraph=True)
        compiled(x)
        assert (python_kernel_calls(compiled, x) > 0) == entered
        assert relative_error(compiled(x), F.linear(x, layer.dequantized()) + 1) < 1e-5


def test_int8_runner_serves_every_layer_through_the_packed_kernel(tiny_untied_model_dir):
    quantised = runner(tiny_untied_model_dir, quantization="int8")   # linear_backend auto
    assert quantised.linear_backend == "packed"
    layers = list(quantised.model.projections())
    assert layers and all(isinstance(layer.matmul, PackedInt8Linear) for layer in layers)
    assert isinstance(quantised.model.lm_head_matmul, PackedInt8Linear)
    reference = runner(tiny_untied_model_dir, linear_backend="torch")
    with torch.no_grad():   # the fp32 model of exactly the weights the int8 one holds
        for name, module in quantised.model.named_modules():
            if getattr(module, "matmul", None) is not None:
                reference.model.get_submodule(name).weight.copy_(module.matmul.dequantized())
        reference.model.lm_head.weight.copy_(quantised.model.lm_head_matmul.dequantized())
    prompt = [int(t) for t in torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(2))]
    # The 40-row prefill with float32 rows throughout (the bfloat16 path of
    # several-chunk steps has a test of its own).
    packed_linear.set_int8_bf16_rows(0)
    try:
        for entries in ([SeqEntry(prompt, 0, [1, 2, 3])], [SeqEntry([prompt[0]], 40, [1, 2, 3])]):
            assert relative_error(quantised.execute_model(entries), reference.execute_model(entries)) < 1e-4
    finally:
        packed_linear.set_int8_bf16_rows(packed_linear.native_ops().int8_bf16_min_rows)
    torch_int8 = runner(tiny_untied_model_dir, quantization="int8", linear_backend="torch")
    assert torch_int8.linear_backend == "torch"
    assert isinstance(torch_int8.model.lm_head_matmul, Int8Linear)


def test_bfloat16_int8_runner_serves_through_the_packed_kernel(tiny_untied_model_dir):
    """A bfloat16 model's int8 layers widen its rows for the packed kernel;
    torch's int8 kernel (bfloat16 rows, bfloat16 results) holds the same int8 values."""
    packed = runner(tiny_untied_model_dir, quantization="int8", dtype="bfloat16")
    assert packed.linear_backend == "packed"
    assert all(isinstance(layer.matmul, PackedInt8Linear) for layer in packed.model.projections())
    assert isinstance(packed.model.lm_head_matmul, PackedInt8Linear)
    plain = runner(tiny_untied_model_dir, quantization="int8", dtype="bfloat16", linear_backend="torch")
    assert isinstance(plain.model.lm_head_matmul, Int8Linear)
    assert torch.equal(packed.model.lm_head_matmul.dequantized(), plain.model.lm_head_matmul.dequantized())
    prompt = [int(t) for t in torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(3))]
    for entries in ([SeqEntry(prompt, 0, [1, 2, 3])], [SeqEntry([prompt[0]], 40, [1, 2, 3])]):
        got, want = packed.execute_model(entries), plain.execute_model(entries)
        assert got.dtype == want.dtype
        assert relative_error(got.float(), want.float()) < 0.05   # bfloat16 roundings apart



@pytest.fixture
def fresh_native_ops(monkeypatch):
    """A process whose native operators no engine has set up yet; the C
    kernel's bfloat16 row count (a global of the library) is put back after."""
    before = packed_linear.native_ops()
    monkeypatch.setattr(packed_linear, "_state", packed_linear.NativeOps())
    yield packed_linear.native_ops()
    monkeypatch.setattr(packed_linear, "_state", before)
    packed_linear.set_int8_bf16_rows(before.int8_bf16_min_rows)


def test_native_ops_false_in_the_config_keeps_the_python_operators(tiny_model_dir, fresh_native_ops):
    load_native_ops()   # they build here: the config alone keeps them out
    served = runner(tiny_model_dir, linear_backend="packed", native_ops=False)
    assert fresh_native_ops.use_native_ops is False and fresh_native_ops.native_ops_failure is None
    layer = served.model.lm_head_matmul
    x = torch.randn(2, layer.in_features)
    assert python_kernel_calls(layer, x) == 1
    assert relative_error(layer(x), F.linear(x, layer.dequantized())) < 1e-5


def test_a_later_engine_asking_other_native_settings_is_warned_and_served_the_first(tiny_model_dir,
                                                                                      fresh_native_ops, caplog):
    """The settings are one per process (compiled steps call the operators by
    name; the bfloat16 row count is a global of the C kernel)."""
    runner(tiny_model_dir, linear_backend="packed", native_ops=False, int8_bf16=False)
    with caplog.at_level("WARNING", logger="pagedbackend"):
        later = runner(tiny_model_dir, linear_backend="packed", native_ops=True)
    assert "this engine's native_ops=True, int8_bf16=None are not applied" in caplog.text
    assert fresh_native_ops.use_native_ops is False and later.linear_backend == "packed"
    assert fresh_native_ops.int8_bf16_min_rows == 0


@pytest.mark.skipif(not packed_linear.int8_bf16_available(),
                    reason="this CPU (or ATEN_CPU_CAPABILITY) has no AVX512_BF16")
@pytest.mark.parametrize("int8_bf16", [True, False])
def test_int8_bf16_in_the_config_reaches_the_kernel(tiny_untied_model_dir, fresh_native_ops, int8_bf16):
    runner(tiny_untied_model_dir, quantization="int8", int8_bf16=int8_bf16)
    assert packed_linear.int8_rounds_to_bf16(packed_linear.INT8_BF16_ROWS) is int8_bf16


def test_layers_fall_back_to_the_python_operators_when_the_native_ones_cannot_build(monkeypatch):
    # A failed C++ build is simulated: this process has already loaded the real library.
    def cannot_build(name):
        raise RuntimeError("the CPU operators need a C++ compiler (g++ or c++) on PATH, and none is there")
    monkeypatch.setattr(native, "load_op_library", cannot_build)
    monkeypatch.setattr(packed_linear, "_state", packed_linear.NativeOps())   # nothing decided yet
    weight, x = torch.randn(30, 20), torch.randn(4, 20)
    layer = packed_linear.PackedLinear(weight)
    assert packed_linear.native_ops().use_native_ops is False
    assert "C++ compiler" in packed_linear.native_ops().native_ops_failure
    assert python_kernel_calls(layer, x) == 1
    assert relative_error(layer(x), F.linear(x, weight)) < 1e-5


AVX2_TESTS = ["computes", "each_row_alone", "holds_bfloat16", "thread_count", "strided", "compiled_call",
              "decode_kernel", "other_head_sizes", "subnormal", "c_kv_write", "cpu_kernel"]


@pytest.mark.skipif(not {"avx2", "fma"} <= set(native._cpu_flags().split()),
                    reason="this CPU cannot run an AVX2 build")
def test_kernels_built_for_avx2_only_compute_the_same():
    """``ATEN_CPU_CAPABILITY=avx2`` (torch's knob) builds the C kernels for
    x86-64-v3, the code a CPU without AVX-512 runs (16-column blocks, 6-row
    chunks): the layer, decode-kernel and expert-kernel tests pass again in a process held to it."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}   # a build of its own: the flags key it
    probe = subprocess.run([sys.executable, "-c", "from pagedbackend.kernels import packed_linear as p; "
                            "from pagedbackend.kernels import native as n; print(p.block_cols(), *n.isa_flags())"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["16", "-march=x86-64-v3", "-mtune=native"]
    tests = pathlib.Path(__file__).parents[1]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tests / "kernels" / "test_packed_linear.py"), str(tests / "kernels" / "test_kernels.py"),
                          str(tests / "kernels" / "test_fused_moe.py"),
                          "-k", f"({' or '.join(AVX2_TESTS)}) and not avx2_only"], env=env, capture_output=True, text=True,
                         timeout=1200, cwd=tests.parent)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
