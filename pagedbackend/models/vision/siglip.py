"""The SigLIP vision transformer (the tower of Gemma 3 and Idefics3/SmolVLM).

pixels -> patch convolution (stride = patch size) + learned position
embeddings -> N x [LayerNorm -> multi-head self-attention (q/k/v/out with
biases, bidirectional) -> residual, LayerNorm -> MLP (fc1, GELU-tanh, fc2) ->
residual] -> post LayerNorm. Parameter names follow Hugging Face's
``SiglipVisionTransformer`` (``embeddings.patch_embedding``,
``encoder.layers.N.self_attn.q_proj``, ``post_layernorm``), so a checkpoint's
tensors load by name once the family strips its prefix. SigLIP's attention
pooling head is not used by these families and is not built.
"""
from dataclasses import dataclass
from typing import Iterable, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.models.model_args import refuse

# HF's names for the activations SigLIP checkpoints use.
_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
                "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


@dataclass(frozen=True)
class SiglipArgs:
    """A SigLIP vision config's fields (HF's ``SiglipVisionConfig`` defaults)."""
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_config(cls, cfg: dict, **defaults) -> "SiglipArgs":
        """The fields of a vision config; ``defaults`` (HF config names) for
        those it leaves out where a family's config class has its own."""
        cfg = {**defaults, **cfg}
        act = cfg.get("hidden_act", cls.hidden_act)
        if act not in _ACTIVATIONS:
            raise refuse("vision_config.hidden_act", act, f"served: {', '.join(_ACTIVATIONS)}")
        args = cls(hidden_size=cfg.get("hidden_size", cls.hidden_size),
                   intermediate_size=cfg.get("intermediate_size", cls.intermediate_size),
                   num_layers=cfg.get("num_hidden_layers", cls.num_layers),
                   num_heads=cfg.get("num_attention_heads", cls.num_heads),
                   num_channels=cfg.get("num_channels", cls.num_channels),
                   image_size=cfg.get("image_size", cls.image_size),
                   patch_size=cfg.get("patch_size", cls.patch_size),
                   layer_norm_eps=cfg.get("layer_norm_eps", cls.layer_norm_eps), hidden_act=act)
        if args.hidden_size % args.num_heads:
            raise refuse("vision_config.num_attention_heads", args.num_heads,
                         f"hidden_size {args.hidden_size} is not a whole number of heads")
        return args

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention; ``key_mask`` ([batch, keys] bool)
    hides padding patches from every query."""

    def __init__(self, args: SiglipArgs, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.hidden_size // args.num_heads
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, nn.Linear(args.hidden_size, args.hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        batch, length, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))


class SiglipMLP(nn.Module):
    def __init__(self, args: SiglipArgs, dtype: torch.dtype):
        super().__init__()
        self.act = _ACTIVATIONS[args.hidden_act]
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """``h + attn(ln(h))``, then ``h + mlp(ln(h))``."""

    def __init__(self, args: SiglipArgs, dtype: torch.dtype):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)
        self.self_attn = SiglipAttention(args, dtype)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)
        self.mlp = SiglipMLP(args, dtype)

    def forward(self, h: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h), key_mask)
        return h + self.mlp(self.layer_norm2(h))


class SiglipEmbeddings(nn.Module):
    def __init__(self, args: SiglipArgs, dtype: torch.dtype):
        super().__init__()
        self.patch_size = args.patch_size
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, args.patch_size,
                                         stride=args.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(args.patches_per_side ** 2, args.hidden_size, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """``[batch, channels, H, W]`` -> ``[batch, patches, hidden]``; a
        patch's position embedding is row ``position_ids[b, i]`` (None: ``i``)."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        if position_ids is None:
            return patches + self.position_embedding.weight[:patches.shape[1]]
        return patches + self.position_embedding(position_ids)


class SiglipEncoder(nn.Module):
    def __init__(self, args: SiglipArgs, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(args, dtype) for _ in range(args.num_layers))


class SiglipVisionTransformer(nn.Module):
    """Pixels to the last hidden states ``[batch, patches, hidden]``, after the post LayerNorm."""

    def __init__(self, args: SiglipArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.embeddings = SiglipEmbeddings(args, dtype)
        self.encoder = SiglipEncoder(args, dtype)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps, dtype=dtype)
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.embeddings(pixel_values, position_ids)
        for layer in self.encoder.layers:
            h = layer(h, key_mask)
        return self.post_layernorm(h)


@torch.no_grad()
def load_named(module: nn.Module, tensors: Iterable[Tuple[str, torch.Tensor]], what: str,
               skip: Tuple[str, ...] = ()) -> None:
    """Copy HF-named tensors into ``module``'s parameters of the same names
    (those starting with a ``skip`` prefix are left out); every parameter
    must be set, each once, with its shape."""
    params = dict(module.named_parameters())
    seen: Set[str] = set()
    for name, tensor in tensors:
        if name.startswith(skip):
            continue
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor of the {what}: {name}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} of the {what} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(params[name].shape)}")
        params[name].copy_(tensor)
        seen.add(name)
    unset = sorted(set(params) - seen)
    if unset:
        raise ValueError(f"checkpoint lacks {len(unset)} tensor(s) of the {what}, e.g. {unset[:3]}")
