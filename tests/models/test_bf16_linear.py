"""bfloat16 linear layers (``models.bf16_linear``, ``kernels/csrc/bf16_gemm.c``):
each path of the kernel (AMX tiles, AVX512-BF16 dot products or widened FMAs,
whichever this machine has, and the dot products with the tiles switched
off) computes ``x W^T`` for every row count and width against a float64
reference; ``dtype="auto"`` runs a bfloat16 checkpoint in bfloat16 where the
CPU multiplies it natively, through these layers, and picks what Hugging Face
picks in bfloat16."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedbackend.config import EngineConfig
from pagedbackend.dtype_choice import cpu_multiplies_bf16, resolve_dtype
from pagedbackend.models import bf16_linear
from pagedbackend.models.default_model import resolve_model_path
from pagedbackend.worker.model_runner import ModelRunner, SeqEntry
from runner_reference import greedy_hf, greedy_paged, random_prompts, shuffled_block_tables
from tiny_model import build_tiny_llama

REASON = bf16_linear.unavailable(torch.device("cpu"), torch.bfloat16)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"bf16 kernel unavailable: {REASON}")


def check_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Every product of two bfloat16 values is exact in float32; the kernel
    sums K of them in float32 in its own order, so each output is within
    K * 2^-24 * sum_k |x_k w_k| of the exact sum (the bound of a float32 sum
    in any order), plus one bfloat16 rounding (2^-8 relative) for a
    bfloat16 output. A wrong product or a lost k breaks this by far more."""
    exact = x.double() @ w.double().t()
    bound = x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    excess = (y.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"largest excess over the bound {excess.max().item():.3g}"


PAIRED = bool(bf16_linear.load_library().bf16_gemm_paired_available())


@pytest.fixture(params=["default", "no_tiles", "paired"])
def path(request):
    """The kernel on the loaded layout as it serves here, with the AMX tiles
    switched off (the dot products; the same path where the CPU has no
    tiles), and on the paired layout (where the CPU has AVX512-BF16)."""
    if request.param == "paired" and not PAIRED:
        pytest.skip("the paired layout needs AVX512-BF16, which this CPU lacks")
    library = bf16_linear.load_library()
    before = library.bf16_gemm_set_amx_rows(-1)
    if request.param == "no_tiles":
        library.bf16_gemm_set_amx_rows(0)
    yield request.param
    library.bf16_gemm_set_amx_rows(before if before else bf16_linear.AMX_MIN_ROWS)


# (rows, K) past the paired kernel's slices of 256 k and passes of 64 rows, and N
# past its panels of 48 outputs, with last blocks of 5 and 16 outputs
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 16, 17, 32, 33, 64, 65, 130])
@pytest.mark.parametrize("out_features, in_features", [(64, 64), (96, 256), (37, 100), (80, 96), (112, 530)])
def test_kernel_computes_x_w_transposed_for_every_shape(rows, out_features, in_features, path):
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    library = bf16_linear.load_library()
    held = bf16_linear.pair(w) if path == "paired" else w
    gemm = library.bf16_gemm_paired if path == "paired" else library.bf16_gemm
    for out_dtype in (torch.float32, torch.bfloat16):
        y = torch.full((rows, out_features), float("nan"), dtype=out_dtype)
        assert gemm(x.data_ptr(), held.data_ptr(), y.data_ptr(), int(out_dtype == torch.bfloat16),
                    rows, in_features, out_features, torch.get_num_threads()) == 0
        check_product(y, x, w)


@pytest.mark.skipif(not PAIRED, reason="the paired layout needs AVX512-BF16, which this CPU lacks")
@pytest.mark.parametrize("rows", [641, 900])
def test_int8_layers_of_a_bfloat16_model_multiply_long_steps_in_bfloat16(rows):
    # A prefill of a bfloat16 model's int8 layer: the weight's int8 values
    # paired as bfloat16 (exact) for the call, the paired kernel's float32
    # sums scaled per output, then rounded to bfloat16 once.
    from pagedbackend.kernels import packed_linear
    from pagedbackend.quant.int8 import PackedInt8Linear, quantize_int8
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 530, generator=g)   # a last block of 5 outputs, K past a slice of 256
    layer = PackedInt8Linear(weight)
    assert layer.bf16_prefill and rows > packed_linear.KERNEL_MAX_ROWS
    x = torch.randn(rows, 530, generator=g).to(torch.bfloat16)
    y = layer(x)
    q, scales = quantize_int8(weight)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 37)
    sums = torch.ops.pagedbackend.int8_rows_bf16(x, layer.qpacked, layer.scales, 37)
    assert sums.dtype == torch.float32 and torch.equal(y, sums.to(torch.bfloat16))   # the path it took
    check_product(sums / scales, x, q.to(torch.bfloat16))   # exact products, float32 sums
    with pytest.raises(ValueError, match="bfloat16"):
        torch.ops.pagedbackend.int8_rows_bf16(x.float(), layer.qpacked, layer.scales, 37)


def test_paired_layout_round_trips_and_refuses_an_odd_k():
    w = torch.randn(37, 100).bfloat16()
    paired = bf16_linear.pair(w)
    assert paired.shape == (3, 50, 16, 2) and paired[2, :, 5:].abs().sum() == 0   # rows 37..47 zero
    assert torch.equal(bf16_linear.unpair(paired, 37), w)
    if PAIRED:
        x = torch.randn(2, 99).bfloat16()
        y = torch.empty(2, 37, dtype=torch.bfloat16)
        assert bf16_linear.load_library().bf16_gemm_paired(x.data_ptr(), paired.data_ptr(), y.data_ptr(),
                                                           1, 2, 99, 37, 1) == -1


def test_layer_holds_one_copy_and_serves_every_step():
    """Paired where the CPU has AVX512-BF16 without tiles (the kernel at every
    row count), else the weight as loaded, not a copy (the kernel for small
    steps, torch's GEMM for long ones)."""
    w = torch.randn(48, 64).bfloat16()
    layer = bf16_linear.Bf16Linear(w)
    assert layer.paired == bf16_linear.pairs()
    if layer.paired:
        assert layer.weight.shape == (3, 32, 16, 2)
    else:
        assert layer.weight.data_ptr() == w.data_ptr()
    assert torch.equal(layer.dequantized(), w.float())
    for rows in (1, 5, layer.max_rows, layer.max_rows + 1, 300):
        x = torch.randn(2, rows, 64).bfloat16()
        y = layer(x)
        assert y.shape == (2, rows, 48) and y.dtype == torch.bfloat16
        check_product(y.reshape(-1, 48), x.reshape(-1, 64), w)
    with pytest.raises(ValueError, match="bfloat16"):
        layer(torch.randn(3, 64))
    with pytest.raises(ValueError, match="bfloat16 CPU weight"):
        bf16_linear.Bf16Linear(torch.randn(4, 4))


def test_kernel_paths_follow_the_cpu():
    """The tiles where the CPU has AMX-BF16, dot products where it has
    AVX512-BF16, widened FMAs elsewhere (ATEN_CPU_CAPABILITY=avx2 builds the
    last, as on AVX2-only CPUs)."""
    flags = open("/proc/cpuinfo").read()
    expected = "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "fma"
    assert bf16_linear.isa() == expected
    narrowed = subprocess.run(
        [sys.executable, "-c", "from pagedbackend.models import bf16_linear; print(bf16_linear.isa())"],
        env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": "avx2"}, capture_output=True, text=True)
    assert narrowed.stdout.strip() == "fma", narrowed.stderr[-2000:]


def bf16_checkpoint(tmp_path):
    folder = build_tiny_llama(tmp_path / "bf16")
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_auto_dtype_follows_the_checkpoint_and_the_cpu(tmp_path, monkeypatch):
    folder = bf16_checkpoint(tmp_path)
    native = "bfloat16" if cpu_multiplies_bf16() else "float32"
    assert resolve_dtype("auto", folder, "cpu") == native
    assert resolve_dtype("auto", folder, "cuda") == "bfloat16"
    assert resolve_dtype("float32", folder, "cpu") == "float32"
    assert resolve_dtype("auto", resolve_model_path("default"), "cpu") == "float32"   # an fp32 checkpoint
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")   # no bfloat16 products: float32
    assert resolve_dtype("auto", folder, "cpu") == "float32"


@pytest.mark.skipif(not cpu_multiplies_bf16(), reason="this CPU has no bfloat16 products: auto runs float32")
def test_a_bfloat16_checkpoint_runs_in_bfloat16_and_picks_what_hf_picks_in_bfloat16(tmp_path):
    """The prefill logits are as far from float32's as HF's own bfloat16
    logits are (a wrong product would be far off); greedy tokens equal HF's
    in bfloat16 up to the first step where HF's own top logits lie within a
    few bfloat16 steps of each other, where either order of float32 sums may
    round them apart (a random tiny model has such near-ties often: the
    point of divergence differs between AMX and AVX512-BF16 machines)."""
    from transformers import AutoModelForCausalLM
    folder = bf16_checkpoint(tmp_path)
    runner = ModelRunner(EngineConfig(model=str(folder), block_size=16, num_kv_blocks=48, device="cpu",
                                      attention_backend="torch", compile=False))
    assert runner.dtype == runner.kv_cache.dtype == torch.bfloat16 and runner.linear_backend == "bf16"
    assert sum(isinstance(m, bf16_linear.Bf16Linear) for m in runner.model.modules()) == 4 * 4 + 1
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = random_prompts([1, 7, 17, 33, 50], 49152, seed=1)

    tables = shuffled_block_tables(runner, [len(p) for p in prompts])
    ours = runner.execute_model([SeqEntry(list(p), 0, t, True) for p, t in zip(prompts, tables)])
    for prompt, row in zip(prompts, ours):
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0, -1].float()
            exact = hf32(torch.tensor([prompt])).logits[0, -1]
        assert (row - exact).abs().max() <= 1.5 * (theirs - exact).abs().max() + 1e-3

    expected, got = greedy_hf(hf, prompts), greedy_paged(runner, prompts)
    for prompt, want, have in zip(prompts, expected, got):
        first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if first is None:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + want[:first]])).logits[0, -1].float()
        step = 2.0 ** (torch.floor(torch.log2(logits.max())).item() - 7)   # one bfloat16 step there
        assert logits[want[first]] - logits[have[first]] <= 3 * step, (first, want, have)


@pytest.mark.skipif(not PAIRED, reason="the paired layout needs AVX512-BF16, which this CPU lacks")
def test_int8_prefills_of_a_bfloat16_model_match_the_widened_path(tmp_path):
    # A prefill past the int8 kernel's 640 rows takes the paired bfloat16
    # kernel (its own compiled graph, warmed up at start); its logits agree with
    # those of the float32 products on the widened weight within bfloat16 noise.
    from pagedbackend.kernels import packed_linear
    from pagedbackend.quant.int8 import PackedInt8Linear
    folder = bf16_checkpoint(tmp_path)
    runner = ModelRunner(EngineConfig(model=str(folder), block_size=16, num_kv_blocks=64, device="cpu",
                                      quantization="int8", compile=False))
    assert runner.dtype == torch.bfloat16
    assert runner.linear_plan.warm_up_rows == (packed_linear.KERNEL_MAX_ROWS + 1,)
    layers = [m for m in runner.model.modules() if isinstance(m, PackedInt8Linear)]
    assert layers and all(m.bf16_prefill for m in layers)
    prompts = random_prompts([400, 300], 49152, seed=3)   # one step of 700 rows
    logits = {}
    for paired in (True, False):
        for m in layers:
            m.bf16_prefill = paired
        tables = shuffled_block_tables(runner, [len(p) for p in prompts])
        logits[paired] = runner.execute_model(
            [SeqEntry(list(p), 0, t, True) for p, t in zip(prompts, tables)]).float()
    spread = logits[False].abs().max()
    assert (logits[True] - logits[False]).abs().max() <= 0.05 * spread
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))
