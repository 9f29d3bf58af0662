"""gpt-oss: attention with learned sinks, alternating sliding-window and full
layers, yarn RoPE, biases on q/k/v/o and on the experts, top-4 routing over
the chosen logits and a clamped SwiGLU.

- **Sinks**: one learned logit per head joins each query's softmax as an
  extra column with no value: it takes a share of the attention and gives
  nothing back (``PagedAttention(sinks=...)``; every attention path adds it).
- **Layers**: ``layer_types`` alternates ``sliding_attention`` (a window of
  ``sliding_window`` = 128 positions) and ``full_attention``.
- **Experts**: router logits with a bias, the top ``num_experts_per_tok``,
  softmax over those; ``gate_up_proj`` holds gate and up in alternating
  columns (``[E, H, 2I]``, transposed), biases on both projections; the
  activation clamps gate above and up on both sides at ``swiglu_limit``, then
  ``gate * sigmoid(swiglu_alpha * gate) * (up + 1)``.
- **MXFP4**: checkpoints as published carry the experts as ``_blocks`` and
  ``_scales``; they are dequantised at load to the model's dtype
  (``mxfp4.dequantize_checkpoint``; what that costs in memory: docs/moe.md).
- Its RMSNorm multiplies the weight in float32 before casting back.
"""
from typing import Optional

import torch
from torch import nn

from pagedbackend.models.decoder import Tensors
from pagedbackend.models.layers import Attention, DecoderLayer, RMSNorm
from pagedbackend.models.linear import Reduce
from pagedbackend.models.model_args import common_fields, layer_types_of, windows_of
from pagedbackend.models.moe import MoEConfig
from pagedbackend.models.moe_decoder import MoEArgs, MoECausalLM
from pagedbackend.models.mxfp4 import dequantize_checkpoint
from pagedbackend.models.rotary import rope_parameters


class GptOssRMSNorm(RMSNorm):
    """``(w * x / rms(x))`` in float32, then cast (gpt-oss keeps its norms in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class GptOssAttention(Attention):
    """Attention whose heads each hold a learned sink logit (this rank's heads)."""

    def __init__(self, args: MoEArgs, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                 dtype: torch.dtype):
        super().__init__(args, layer, tp_rank, tp_size, reduce, dtype)
        self.first_head = self.qkv_proj.rank_slices[0][0] // args.head_dim
        # float32 whatever the model's dtype: every attention path takes them so.
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.attn.sinks = self.sinks


class GptOssForCausalLM(MoECausalLM):

    @classmethod
    def parse_config(cls, cfg: dict) -> MoEArgs:
        fields = common_fields(cfg, tie_word_embeddings=False, rms_norm_eps=1e-5)
        layers = fields["num_layers"]
        types = layer_types_of(cfg, ["sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(layers)])
        moe = MoEConfig(cfg.get("num_local_experts", 128), cfg.get("num_experts_per_tok", 4), fields["hidden_size"],
                        fields["intermediate_size"], "topk_softmax", router_bias=True, expert_bias=True,
                        activation="swigluoai", swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
                        swiglu_limit=cfg.get("swiglu_limit", 7.0))
        bias = cfg.get("attention_bias", True)
        return MoEArgs(**fields, ropes=[rope_parameters(cfg, default_theta=150000.0)], layer_ropes=[0] * layers,
                       layer_windows=windows_of(types, cfg.get("sliding_window", 128)), attention_bias=bias,
                       output_bias=bias, moe=moe, sparse_layers=[True] * layers)

    def build_layer(self, layer: int, tp_rank: int, tp_size: int, reduce: Optional[Reduce],
                    dtype: torch.dtype) -> nn.Module:
        args = self.args
        return DecoderLayer(GptOssAttention(args, layer, tp_rank, tp_size, reduce, dtype),
                            self.build_mlp(layer, tp_rank, tp_size, reduce, dtype),
                            GptOssRMSNorm(args.hidden_size, args.rms_norm_eps, dtype),
                            GptOssRMSNorm(args.hidden_size, args.rms_norm_eps, dtype))

    def build_norm(self, size: int, dtype: torch.dtype) -> nn.Module:
        return GptOssRMSNorm(size, self.args.rms_norm_eps, dtype)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Tensors:
        name = name.removeprefix("model.")
        if name.endswith(".self_attn.sinks"):   # this rank's heads
            attention = self.layers[int(name.split(".")[1])].self_attn
            tensor = tensor.narrow(0, attention.first_head, attention.num_heads)
        yield name, tensor

    @torch.no_grad()
    def load_weights(self, tensors: Tensors) -> None:
        super().load_weights(dequantize_checkpoint(tensors, self.embed_tokens.weight.dtype))

    def load_expert_tensor(self, layer: int, name: str, tensor: torch.Tensor) -> bool:
        experts = self.experts(layer)
        if name in ("router.weight", "router.bias"):
            experts.load_router(name.split(".")[1], tensor)
        elif name == "experts.gate_up_proj":
            experts.load_stacked("gate_up", "weight", tensor.transpose(1, 2), interleaved=True)
        elif name == "experts.gate_up_proj_bias":
            experts.load_stacked("gate_up", "bias", tensor, interleaved=True)
        elif name == "experts.down_proj":
            experts.load_stacked("down", "weight", tensor.transpose(1, 2))
        elif name == "experts.down_proj_bias":
            experts.load_stacked("down", "bias", tensor)
        else:
            return False
        return True
