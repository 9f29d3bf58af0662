"""CLIP's vision transformer and LLaVA's projector: LLaVA's vision encoder.

pixels -> patch convolution (no bias) -> [class token; patches] + learned
positions -> pre-LayerNorm -> N x [LayerNorm -> attention (all tokens see
all) -> residual, LayerNorm -> MLP -> residual]. LLaVA takes the hidden
states after layer ``vision_feature_layer`` (-2: all but the last layer),
drops the class token under the "default" selection, and projects each
patch into the text model's width (linear -> GELU -> linear).
"""
from typing import Dict, Iterable, List, Mapping, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.models.model_args import refuse
from pagedbackend.models.vision.base import VisionEncoder

ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str, field: str):
    if name not in ACTIVATIONS:
        raise refuse(field, name, f"served activations: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class ViTLayer(nn.Module):
    """One pre-LayerNorm transformer layer over all patches of an image (no mask)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, act, dtype):
        super().__init__()
        self.heads = heads
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.out_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.fc1 = nn.Linear(hidden, intermediate, dtype=dtype)
        self.fc2 = nn.Linear(intermediate, hidden, dtype=dtype)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [images, tokens, hidden]
        b, n, d = x.shape
        q, k, v = self.qkv(self.layer_norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.out_proj(attended)
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class LlavaVision(VisionEncoder):
    """CLIP's tower (the layers LLaVA reads) and LLaVA's projector; one image
    is ``pixel_values [3, H, W]`` at the tower's ``image_size``."""

    def __init__(self, cfg: dict, text_hidden: int, dtype: torch.dtype):
        super().__init__()
        vision = cfg["vision_config"]
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise refuse("vision_config.model_type", vision.get("model_type"), "LLaVA's served tower: clip_vision_model")
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise refuse("vision_feature_layer", layer, "one layer (an integer)")
        self.strategy = cfg.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise refuse("vision_feature_select_strategy", self.strategy, "default or full")
        hidden, self.patch = vision["hidden_size"], vision["patch_size"]
        self.image_size = vision["image_size"]
        depth = vision["num_hidden_layers"]
        used = layer + 1 if layer >= 0 else depth + 1 + layer   # hidden_states[0] is the embedding
        if not 0 <= used <= depth:
            raise refuse("vision_feature_layer", layer, f"a layer of the {depth}-layer tower")
        self.num_patches = (self.image_size // self.patch) ** 2
        eps = vision.get("layer_norm_eps", 1e-5)
        act = activation(vision.get("hidden_act", "quick_gelu"), "vision_config.hidden_act")
        self.patch_embedding = nn.Conv2d(vision.get("num_channels", 3), hidden, self.patch, self.patch,
                                         bias=False, dtype=dtype)
        self.class_embedding = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)
        self.position_embedding = nn.Parameter(torch.zeros(self.num_patches + 1, hidden, dtype=dtype),
                                               requires_grad=False)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.layers = nn.ModuleList(ViTLayer(hidden, vision["num_attention_heads"], vision["intermediate_size"],
                                             eps, act, dtype) for _ in range(used))
        bias = cfg.get("multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(hidden, text_hidden, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)
        self.projector_act = activation(cfg.get("projector_hidden_act", "gelu"), "projector_hidden_act")
        self.requires_grad_(False)

    def split_images(self, processed: Mapping[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
        return [{"pixel_values": pixels} for pixels in processed["pixel_values"]]

    def num_embeds(self, image: Mapping[str, torch.Tensor]) -> int:
        return self.num_patches + (self.strategy == "full")

    def forward(self, image: Mapping[str, torch.Tensor]) -> torch.Tensor:
        pixels = image["pixel_values"].to(self.patch_embedding.weight)
        if tuple(pixels.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values of {tuple(pixels.shape[-2:])}; the tower takes "
                             f"{self.image_size}x{self.image_size} (the processor's crop)")
        patches = self.patch_embedding(pixels[None]).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(1, 1, -1), patches], dim=1) + self.position_embedding
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        if self.strategy == "default":
            x = x[:, 1:]
        return self.linear_2(self.projector_act(self.linear_1(x)))[0]

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        qkv: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
        loaded = set()
        for name, tensor in tensors:
            name = name.removeprefix("vision_tower.").removeprefix("vision_model.")
            name = name.removeprefix("multi_modal_projector.").removeprefix("embeddings.").removeprefix("encoder.")
            if name in ("post_layernorm.weight", "post_layernorm.bias", "position_ids"):
                continue   # LLaVA reads the hidden states before the final norm
            if name == "position_embedding.weight":
                name = "position_embedding"
            parts = name.split(".")
            if parts[0] == "layers":
                index = int(parts[1])
                if index >= len(self.layers):
                    continue   # past the layer LLaVA reads
                rest = ".".join(parts[2:]).removeprefix("self_attn.").removeprefix("mlp.")
                if rest[:6] in ("q_proj", "k_proj", "v_proj"):
                    qkv.setdefault((index, rest[7:]), {})[rest[0]] = tensor
                    continue
                name = f"layers.{index}.{rest}"
            if name not in params:
                raise ValueError(f"unexpected vision checkpoint tensor {name}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"vision checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
        for (index, kind), shards in qkv.items():
            if set(shards) != {"q", "k", "v"}:
                raise ValueError(f"vision layer {index} lacks some of q/k/v_proj.{kind}")
            params[f"layers.{index}.qkv.{kind}"].copy_(torch.cat([shards["q"], shards["k"], shards["v"]]))
            loaded.add(f"layers.{index}.qkv.{kind}")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks vision tensors, e.g. {missing[:3]}")
