"""Model building and weight reading: from a model folder and the engine's
settings to one rank's model with its weights in place, and the facts that
planning needs before any model exists (device, dtype, bytes per KV block).

Quantisation, adapters and the KV cache come after, in the runner: w8a8's
calibration runs prefills through the cache.
"""
import json
import pathlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch

from pagedbackend.config import EngineConfig
from pagedbackend.core.kv_memory import KVModel
from pagedbackend.kernels.kv_cache_dtype import row_bytes
from pagedbackend.models import ModelArgs, model_args, model_class
from pagedbackend.models.default_model import resolve_model_path
from pagedbackend.models.gguf_source import gguf_of, load_gguf_weights
from pagedbackend.models.linear import Reduce

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}   # EngineConfig.dtype

__all__ = ["DTYPES", "LoadedModel", "kv_block_bytes", "load_model", "read_args", "read_safetensors",
           "resolve_device"]


@dataclass
class LoadedModel:
    """One rank's model, weights loaded, and what it was built from."""
    path: pathlib.Path            # the model folder
    hf_config: dict               # its config.json
    args: ModelArgs               # the architecture, as its family reads it
    model: torch.nn.Module        # a ``decoder.CausalLM`` on the device
    max_model_len: int            # positions served (the setting, bounded by the model)


def resolve_device(device: str) -> torch.device:
    """``EngineConfig.device`` as a torch device ("auto": CUDA when there is one)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def read_args(hf_config: dict, config: EngineConfig) -> ModelArgs:
    """The architecture of ``hf_config`` with the engine's choices applied
    (how the ranks of a mixture of experts split them)."""
    args = model_args(hf_config)
    if hasattr(args, "expert_parallel"):   # only a mixture of experts has the field
        args.expert_parallel = config.enable_expert_parallel
    return args


def load_model(config: EngineConfig, device: torch.device, tp_rank: int = 0, tp_size: int = 1,
               reduce: Optional[Reduce] = None) -> LoadedModel:
    """Build rank ``tp_rank`` of ``tp_size``'s shard of ``config.model`` on
    ``device`` in ``config.dtype`` and read its weights."""
    path = resolve_model_path(config.model)
    hf_config = {**json.loads((path / "config.json").read_text()), **(config.hf_overrides or {})}
    args = read_args(hf_config, config)
    if hf_config.get("classifier_from_token") is not None:
        args.classifier_token_ids = classifier_token_ids(path, hf_config["classifier_from_token"])
    max_model_len = fit_model_len(config.max_model_len, args.served_positions)
    if args.vision_config is not None and tp_size > 1:
        raise ValueError(f"{hf_config['model_type']}: a vision-language model serves with tensor_parallel_size=1")
    with torch.device(device):
        model = model_class(hf_config["model_type"])(args, DTYPES[config.dtype], max_model_len,
                                                     tp_rank, tp_size, reduce)
    gguf = gguf_of(path)
    if gguf is not None:   # its blocks served as the file holds them (models.gguf_source)
        load_gguf_weights(model, gguf, DTYPES[config.dtype])
    else:
        model.load_weights(read_safetensors(path))
    return LoadedModel(path, hf_config, args, model, max_model_len)


def classifier_token_ids(path: pathlib.Path, tokens) -> List[int]:
    """The ids of ``classifier_from_token`` (vLLM's override: a reranker whose
    score reads the LM head's rows of these tokens, e.g. ["no", "yes"])."""
    from tokenizers import Tokenizer
    if not (isinstance(tokens, list) and len(tokens) in (1, 2) and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier_from_token must list one or two tokens, got {tokens!r}")
    vocab = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = [vocab.token_to_id(t) for t in tokens]
    if None in ids:
        raise ValueError(f"classifier_from_token {tokens[ids.index(None)]!r} is not a token of {path}'s tokenizer")
    return ids


def fit_model_len(requested: Optional[int], model_limit: int) -> int:
    """``max_model_len`` as served: the model's limit unless the setting asks for fewer."""
    if requested is None:
        return model_limit
    if not 0 < requested <= model_limit:
        raise ValueError(f"max_model_len={requested} must be between 1 and the model's "
                         f"{model_limit} positions")
    return requested


def kv_block_bytes(args: ModelArgs, block_size: int, num_kv_heads: int, dtype: torch.dtype,
                   layers: Optional[int] = None) -> int:
    """Bytes of one KV block on one rank: K and V of ``layers`` layers (one
    KV group's; default every layer), the rank's KV heads, in a cache of
    ``dtype`` (int8: each row with its scale, ``kv_cache_dtype``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers = args.num_layers if layers is None else layers
    scale = row_bytes(args.head_dim, dtype) - args.head_dim * elem
    return KVModel(layers, num_kv_heads, args.head_dim, elem, scale_bytes=scale).kv_bytes_per_block(block_size)


def read_safetensors(path: pathlib.Path) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint (one file or the shards its index lists)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
