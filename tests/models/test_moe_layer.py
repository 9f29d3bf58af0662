"""The FusedMoE layer against Hugging Face's own expert blocks (Qwen3-MoE,
Mixtral, gpt-oss), loaded from the same tensors in their checkpoint layouts;
tensor-parallel shares that sum to the whole; MXFP4 experts dequantised as
Hugging Face dequantises them."""
import pytest
import torch
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagedbackend.kernels import native
from pagedbackend.models import moe, mxfp4

HIDDEN, INTER, EXPERTS = 32, 24, 8
KERNELS = ["torch"] + ([] if native.unavailable(torch.device("cpu"), torch.float32, "fused_moe") else ["packed"])


def randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return module.eval()


def hf_block(family: str, norm_topk_prob: bool = False) -> torch.nn.Module:
    """The family's HF expert block with random weights, and its per-family MoEConfig."""
    common = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=3,
                             norm_topk_prob=norm_topk_prob, **common)
        return randomised(Qwen3MoeSparseMoeBlock(cfg), 1), moe.MoEConfig(
            EXPERTS, 3, HIDDEN, INTER, "softmax", renormalize=norm_topk_prob)
    if family == "mixtral":
        cfg = MixtralConfig(intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=2, **common)
        return randomised(MixtralSparseMoeBlock(cfg), 2), moe.MoEConfig(
            EXPERTS, 2, HIDDEN, INTER, "softmax", renormalize=True)
    cfg = GptOssConfig(intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=4, **common)
    block = randomised(GptOssMLP(cfg), 3)
    with torch.no_grad():   # a gate_up that reaches the clamp at 7 for some rows
        block.experts.gate_up_proj.mul_(6.0)
    return block, moe.MoEConfig(EXPERTS, 4, HIDDEN, INTER, "topk_softmax", router_bias=True, expert_bias=True,
                                activation="swigluoai", swiglu_alpha=cfg.swiglu_alpha,
                                swiglu_limit=cfg.swiglu_limit)


def load_from_hf(layer: moe.FusedMoE, family: str, block: torch.nn.Module) -> moe.FusedMoE:
    """Our layer filled as a checkpoint fills it: Qwen3-MoE and Mixtral per expert
    (as transformers saves them), gpt-oss as fused, transposed, interleaved tensors."""
    state = block.state_dict()
    if family == "gpt_oss":
        layer.load_router("weight", state["router.weight"])
        layer.load_router("bias", state["router.bias"])
        layer.load_stacked("gate_up", "weight", state["experts.gate_up_proj"].transpose(1, 2), interleaved=True)
        layer.load_stacked("gate_up", "bias", state["experts.gate_up_proj_bias"], interleaved=True)
        layer.load_stacked("down", "weight", state["experts.down_proj"].transpose(1, 2))
        layer.load_stacked("down", "bias", state["experts.down_proj_bias"])
        return layer
    layer.load_router("weight", state["gate.weight"])
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    for e in range(EXPERTS):
        gate, up = gate_up[e].chunk(2)
        layer.load_expert(e, "gate", "weight", gate)
        layer.load_expert(e, "up", "weight", up)
        layer.load_expert(e, "down", "weight", down[e])
    return layer


def hf_forward(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family, norm", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True),
                                          ("gpt_oss", False)])
def test_layer_equals_hugging_faces_block(family, norm, kernel):
    block, config = hf_block(family, norm)
    layer = load_from_hf(moe.FusedMoE(config, dtype=torch.float32), family, block)
    assert layer.missing() == []
    layer.use_kernel(kernel)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), hf_forward(block, x), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_routing_picks_hugging_faces_experts_and_weights(family):
    block, config = hf_block(family, norm_topk_prob=True)
    router = block.router if family == "gpt_oss" else block.gate
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, hf_weights, hf_ids = router(x)
        logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
    weights, ids = moe.route(logits, config)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=0, rtol=0)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_shares_sum_to_the_single_rank_output(expert_parallel):
    block, config = hf_block("gpt_oss")   # biases too: the down bias must be counted once
    whole = load_from_hf(moe.FusedMoE(config, dtype=torch.float32), "gpt_oss", block)
    ranks = [load_from_hf(moe.FusedMoE(config, tp_rank=r, tp_size=2, reduce=lambda y: y,
                                       dtype=torch.float32, expert_parallel=expert_parallel), "gpt_oss", block)
             for r in range(2)]
    if expert_parallel:
        assert [r.local_experts for r in ranks] == [EXPERTS // 2] * 2 and ranks[1].first_expert == EXPERTS // 2
    else:
        assert [r.local_inter for r in ranks] == [INTER // 2] * 2 and ranks[1].b2 is None
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole(x), atol=2e-6, rtol=2e-5)


def test_expert_parallel_needs_experts_divisible_by_ranks():
    with pytest.raises(ValueError, match="num_experts"):
        moe.FusedMoE(moe.MoEConfig(6, 2, HIDDEN, INTER), tp_rank=0, tp_size=4, expert_parallel=True)


def test_a_checkpoint_without_some_expert_is_reported():
    block, config = hf_block("mixtral")
    layer = moe.FusedMoE(config, dtype=torch.float32)
    layer.load_router("weight", block.state_dict()["gate.weight"])
    layer.load_expert(0, "gate", "weight", torch.zeros(INTER, HIDDEN))
    assert "gate.weight[1]" in layer.missing() and "gate.weight[0]" not in layer.missing()
    with pytest.raises(ValueError, match="expert 9"):
        layer.load_expert(9, "gate", "weight", torch.zeros(INTER, HIDDEN))
    with pytest.raises(ValueError, match="shape"):
        layer.load_expert(1, "down", "weight", torch.zeros(HIDDEN, INTER + 1))


def test_mxfp4_experts_dequantise_as_hugging_face_does():
    w = torch.randn(4, 2 * INTER, 64, generator=torch.Generator().manual_seed(4)) * 0.05
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (4, 2 * INTER, 2, 16) and scales.shape == (4, 2 * INTER, 2)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dict(mxfp4.dequantize_checkpoint([("e.gate_up_proj_blocks", blocks), ("other", w),
                                                 ("e.gate_up_proj_scales", scales)], dtype))
        assert torch.equal(ours["e.gate_up_proj"], convert_moe_packed_tensors(blocks, scales, dtype=dtype))
        assert torch.equal(ours["other"], w)


def test_mxfp4_rounds_each_value_to_the_nearest_e2m1_step_of_its_block():
    w = torch.tensor([[6.0, -3.0, 0.74, 0.76, -0.2] + [0.0] * 27])   # block max 6: exponent 0
    blocks, scales = mxfp4.quantize(w)
    assert scales.tolist() == [[127]]
    assert mxfp4.dequantize(blocks, scales)[0, :5].tolist() == [6.0, -3.0, 0.5, 1.0, -0.0]


def test_mxfp4_pair_without_its_scales_is_refused():
    with pytest.raises(ValueError, match="lacks the blocks or scales"):
        list(mxfp4.dequantize_checkpoint([("x_blocks", torch.zeros(1, 1, 16, dtype=torch.uint8))], torch.float32))
