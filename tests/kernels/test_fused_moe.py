"""Expert kernels: the Triton-lang grouped GEMM equals its torch twin under the
interpreter, the twin's pipeline and the CPU C kernel equal the torch reference
loop, and a step reads only the experts its tokens use."""
import pytest
import torch

from pagedbackend.kernels import fused_moe as fm
from pagedbackend.kernels import moe_cpu, native


def expert_case(tokens, hidden, inter, experts, top_k, *, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    b13 = torch.randn(experts, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(experts, hidden, generator=g) if bias else None
    return x, ids, weights, w13, w2, b13, b2


def test_alignment_puts_each_pair_once_in_its_experts_padded_run():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [-1, 2]], dtype=torch.int32)   # 5 and -1: no such expert
    align = fm.align_by_expert(ids, num_experts=4, block_m=4)
    rows = align.pair_ids[: int(align.num_rows)].tolist()
    pairs = ids.numel()
    assert int(align.num_rows) == 4 + 4   # expert 0: 2 pairs, expert 2: 4 pairs, each padded to 4
    placed = [p for p in rows if p < pairs]
    assert sorted(placed) == [0, 1, 2, 4, 5, 7]   # every valid pair once, not 3 (expert 5) nor 6 (-1)
    for block, expert in enumerate(align.block_expert.tolist()[: int(align.num_rows) // 4]):
        members = [p for p in rows[block * 4:(block + 1) * 4] if p < pairs]
        assert members and all(ids.view(-1)[p] == expert for p in members)


@pytest.mark.parametrize("activation, bias", [("silu", False), ("swigluoai", True)])
def test_triton_grouped_gemm_equals_its_torch_twin(activation, bias):
    # Interpreted: 3 tokens x top-2 of 4 experts, 16-wide tiles (few programs).
    x, ids, weights, w13, w2, b13, b2 = expert_case(3, 32, 16, 4, 2, bias=bias)
    ids[1, 1] = -1   # another rank's expert: contributes nothing
    args = (x, ids, weights, w13, w2, b13, b2, activation)
    kernel = fm.fused_experts_grouped(*args, block_n=16, block_k=16)
    twin = fm.fused_experts_grouped(*args, gemm=fm.grouped_gemm_ref, block_n=16, block_k=16)
    torch.testing.assert_close(kernel, twin, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("activation, bias", [("silu", False), ("swigluoai", True)])
def test_grouped_pipeline_equals_the_reference_loop(activation, bias):
    x, ids, weights, w13, w2, b13, b2 = expert_case(9, 48, 24, 6, 3, bias=bias, seed=1)
    args = (x, ids, weights, w13, w2, b13, b2, activation)
    twin = fm.fused_experts_grouped(*args, gemm=fm.grouped_gemm_ref)
    torch.testing.assert_close(twin, fm.fused_experts_torch(*args), atol=1e-5, rtol=1e-5)


def test_swigluoai_clamps_gate_above_and_up_on_both_sides():
    h = torch.tensor([[10.0, -10.0, 10.0, -10.0]])   # gate [10, -10], up [10, -10]
    out = fm.activate(h, "swigluoai", alpha=1.0, limit=7.0)
    expected = torch.tensor([[7.0 * torch.sigmoid(torch.tensor(7.0)) * 8.0,
                              -10.0 * torch.sigmoid(torch.tensor(-10.0)) * -6.0]])
    torch.testing.assert_close(out, expected)


needs_c_kernel = pytest.mark.skipif(native.unavailable(torch.device("cpu"), torch.float32, "fused_moe") is not None,
                                    reason="the fused MoE C kernel cannot be built here (no C compiler)")


@needs_c_kernel
@pytest.mark.parametrize("tokens, experts, top_k, activation, bias", [
    (1, 8, 2, "silu", False),        # one decode token
    (5, 8, 3, "swigluoai", True),    # a small batch, gpt-oss's activation and biases
    (70, 4, 2, "silu", True),        # a prefill: many rows per expert, several register chunks
])
def test_cpu_kernel_equals_the_reference_loop(tokens, experts, top_k, activation, bias):
    x, ids, weights, w13, w2, b13, b2 = expert_case(tokens, 40, 24, experts, top_k, bias=bias, seed=tokens)
    ids[0, -1] = -1   # a skipped slot
    expected = fm.fused_experts_torch(x, ids, weights, w13, w2, b13, b2, activation)
    got = moe_cpu.fused_moe_cpu(x, ids, weights, moe_cpu.pack_gate_up(w13), moe_cpu.pack_down(w2),
                                b13, b2, 24, activation)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


@needs_c_kernel
def test_cpu_kernel_reads_each_active_expert_once_and_no_other():
    x, ids, weights, w13, w2, _, _ = expert_case(6, 64, 32, 16, 2, seed=3)
    ids[:, 0], ids[:, 1] = 3, torch.tensor([7, 7, 3 + 8, 7, 11, 7], dtype=torch.int32)   # experts 3, 7, 11
    w13p, w2p = moe_cpu.pack_gate_up(w13), moe_cpu.pack_down(w2)
    per_expert = (w13p[0].numel() + w2p[0].numel()) * 4
    moe_cpu.bytes_read.reset()
    moe_cpu.fused_moe_cpu(x, ids, weights, w13p, w2p, None, None, 32)
    assert moe_cpu.bytes_read.bytes == 3 * per_expert
    # Packing pads only to whole column blocks: here not at all.
    assert per_expert == (w13[0].numel() + w2[0].numel()) * 4


@needs_c_kernel
def test_cpu_kernel_with_no_routable_slot_gives_zeros():
    x, ids, weights, w13, w2, _, _ = expert_case(3, 32, 16, 4, 2)
    out = moe_cpu.fused_moe_cpu(x, torch.full_like(ids, -1), weights, moe_cpu.pack_gate_up(w13),
                                moe_cpu.pack_down(w2), None, None, 16)
    assert torch.equal(out, torch.zeros_like(x))


@needs_c_kernel
def test_packing_round_trips():
    w13, w2 = torch.randn(3, 2 * 37, 20), torch.randn(3, 20, 37)   # I = 37: a padded last block
    assert torch.equal(moe_cpu.unpack_gate_up(moe_cpu.pack_gate_up(w13), 37), w13)
    assert torch.equal(moe_cpu.unpack_down(moe_cpu.pack_down(w2), 20, 37), w2)


@needs_c_kernel
@pytest.mark.parametrize("tokens, activation, bias", [(1, "silu", False), (5, "swigluoai", True),
                                                      (70, "silu", True)])
def test_cpu_kernel_on_bfloat16_experts_sums_what_float32_sums_for_half_the_bytes(tokens, activation, bias):
    """Weights that are bfloat16 values (as a checkpoint published in bfloat16
    holds) give the same output, bit for bit, packed as bfloat16 or float32."""
    x, ids, weights, w13, w2, b13, b2 = expert_case(tokens, 72, 37, 8, 3, bias=bias, seed=tokens)
    w13, w2 = w13.bfloat16().float(), w2.bfloat16().float()
    assert moe_cpu.exact_in_bfloat16(w13, w2) and not moe_cpu.exact_in_bfloat16(w13 * (1 + 2 ** -12))
    packed = {dtype: (moe_cpu.pack_gate_up(w13.to(dtype)), moe_cpu.pack_down(w2.to(dtype)))
              for dtype in (torch.float32, torch.bfloat16)}
    out, read = {}, {}
    for dtype, (w13p, w2p) in packed.items():
        moe_cpu.bytes_read.reset()
        out[dtype] = moe_cpu.fused_moe_cpu(x, ids, weights, w13p, w2p, b13, b2, 37, activation)
        read[dtype] = moe_cpu.bytes_read.bytes
    assert torch.equal(out[torch.bfloat16], out[torch.float32])
    assert read[torch.bfloat16] * 2 == read[torch.float32] > 0
    torch.testing.assert_close(out[torch.float32], fm.fused_experts_torch(x, ids, weights, w13, w2, b13, b2,
                                                                        activation), atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="experts float32 or bfloat16"):
        moe_cpu.fused_moe_cpu(x, ids, weights, packed[torch.bfloat16][0], packed[torch.float32][1], b13, b2, 37)
