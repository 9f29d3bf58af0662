"""A GGUF file as a model source: ``LLM(model="file.gguf")``.

The file is read and checked first (``gguf_file``: a truncated or hostile
file is refused before anything else reads it). Its metadata becomes a small
folder in the cache, made once per file (path, size and time): config.json as
transformers builds it from the metadata, and the tokenizer with its chat
template as transformers builds them from the file, plus a note naming the
file (``SOURCE_FILE``). Everything that reads a model folder reads that one;
the weights stay in the GGUF, memory-mapped.

Loading (``load_gguf_weights``): every linear projection is served from its
GGUF tensors as they are (``gguf_linear.GGUFLinear``: a merged q/k/v or
gate/up takes each shard's tensor and type), the LM head from ``output`` (or,
tied, from ``token_embd``), the embedding from ``token_embd``'s rows as tokens
ask for them; norms and biases, which files keep in float, load as
tensors. Tensor names and layouts follow llama.cpp's: Llama-architecture q/k
rows permuted for its RoPE (read back through a row map), Gemma's norms held
as ``1 + w``, Phi-3's fused q/k/v and gate/up. A mixture of experts
(Qwen3-MoE) serves its experts from their 3-D GGUF tensors (``gguf_moe``).
"""
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Dict, Optional, Tuple

import torch

from pagedbackend.config import cache_root
from pagedbackend.models.gguf_file import QUANTIZED, GGUFError, GGUFFile
from pagedbackend.models.gguf_q4 import rope_rows_to_hf

logger = logging.getLogger("pagedbackend")

SOURCE_FILE = "gguf_source.json"
PREPARED_VERSION = 1
# GGUF architecture -> what transformers names it; the families served from GGUF files.
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma3": "gemma3_text", "phi3": "phi3", "qwen3moe": "qwen3_moe"}
# Hugging Face projection (inside model.layers.N) -> GGUF tensor (inside blk.N).
_PROJECTIONS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
                "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}
# GGUF tensor inside blk.N -> Hugging Face module inside model.layers.N, per architecture.
_LAYER_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj"}
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "post_attention_norm": "post_attention_layernorm",
                        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def is_gguf_path(model: str) -> bool:
    return str(model).lower().endswith(".gguf")


def gguf_of(folder: pathlib.Path) -> Optional[pathlib.Path]:
    """The GGUF file a prepared folder serves (None: a plain Hugging Face folder)."""
    note = pathlib.Path(folder) / SOURCE_FILE
    if not note.is_file():
        return None
    return pathlib.Path(json.loads(note.read_text())["path"])


def prepare_gguf(path) -> pathlib.Path:
    """The model folder of GGUF file ``path`` (config and tokenizer), made once."""
    path = pathlib.Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    gguf = GGUFFile(path)   # checks the whole header and every tensor's place
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not served; served: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    for name, info in gguf.tensors.items():
        if info.type_name not in QUANTIZED and info.type_name not in ("F32", "F16", "BF16"):
            raise GGUFError(f"{path.name}: tensor {name} is {info.type_name}, which is not served")
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{PREPARED_VERSION}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.stem}.", dir=target.parent))
    try:
        _write_folder(path, gguf, tmp)
        try:
            os.rename(tmp, target)   # atomic; another process may have made it meanwhile
        except OSError:
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_folder(path: pathlib.Path, gguf: GGUFFile, out: pathlib.Path) -> None:
    from transformers import AutoConfig, AutoTokenizer
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(path.parent, **kwargs).to_dict()
    config.pop("quantization_config", None)
    config["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    key_length = gguf.metadata.get(f"{gguf.architecture}.attention.key_length")
    if isinstance(key_length, int) and key_length > 0:   # transformers reads it for some families only
        config["head_dim"] = key_length
    expert_length = gguf.metadata.get(f"{gguf.architecture}.expert_feed_forward_length")
    if isinstance(expert_length, int) and expert_length > 0:   # transformers leaves its default
        config["moe_intermediate_size"] = expert_length
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    template = gguf.metadata.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    (out / SOURCE_FILE).write_text(json.dumps({"path": str(path), "architecture": gguf.architecture}))


# ---------------------------------------------------------------- loading

@torch.no_grad()
def load_gguf_weights(model, path: pathlib.Path, dtype: torch.dtype) -> Dict[str, int]:
    """Serve ``model`` (a ``decoder.CausalLM`` built from the prepared config)
    from GGUF file ``path``; returns the count of tensors per GGUF type."""
    from pagedbackend.models.gguf_linear import GGUFEmbedding, GGUFLinear
    from pagedbackend.models.gguf_moe import load_gguf_experts

    gguf = GGUFFile(path)
    arch, args = gguf.architecture, model.args
    types: Dict[str, int] = {}
    used = set()

    def matrix(name: str) -> Tuple[torch.Tensor, str]:
        if name not in gguf.tensors:
            raise GGUFError(f"{path.name} lacks tensor {name}, which the model needs")
        info = gguf.tensors[name]
        used.add(name)
        types[info.type_name] = types.get(info.type_name, 0) + 1
        return gguf.tensor(name), info.type_name

    params = dict(model.named_parameters())
    param_names = {id(param): name for name, param in params.items()}
    loaded = set()

    def fill(param: torch.nn.Parameter, tensor: torch.Tensor, what: str) -> None:
        """A float tensor of the file (F32, F16, BF16) into ``param``, in the run's dtype."""
        if tuple(tensor.shape) != tuple(param.shape):
            raise GGUFError(f"{path.name}: {what} is {tuple(tensor.shape)}, the model's config "
                            f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(param_names[id(param)])

    for hf_names, linear in model.hf_projections():
        if getattr(linear, "tp_size", 1) != 1:
            raise ValueError("a GGUF model is served on one rank: use tensor_parallel_size=1")
        shards, kinds, maps = [], [], []
        for hf_name in hf_names:
            parts = hf_name.split(".")
            name = f"blk.{parts[2]}.{_PROJECTIONS[parts[-2]]}.weight"
            tensor, kind = matrix(name)
            shards.append(tensor)
            kinds.append(kind)
            maps.append(_rope_map(arch, parts[-2], tensor.shape[0], args))
        if all(kind not in QUANTIZED for kind in kinds):   # an unquantised file: the float weight as loaded
            fill(linear.weight, torch.cat([t.float() if m is None else t.float()[m] for t, m in zip(shards, maps)]),
                 ", ".join(hf_names))
            continue
        if any(kind not in QUANTIZED for kind in kinds):
            raise GGUFError(f"{path.name}: the tensors of {', '.join(hf_names)} mix float and quantised types "
                            f"({', '.join(kinds)}); one merged projection is served from one or the other")
        rows, in_features = linear.weight.shape
        layer = GGUFLinear(shards, kinds, in_features, maps)
        if layer.out_features != rows:
            raise GGUFError(f"{path.name}: tensors {', '.join(hf_names)} have {layer.out_features} rows, "
                            f"the model's config {rows}")
        linear.use_matmul(layer)
    used |= load_gguf_experts(model, gguf, matrix)

    embed, embed_kind = matrix("token_embd.weight")
    head, head_kind = matrix("output.weight") if "output.weight" in gguf.tensors else (None, None)
    if embed_kind in QUANTIZED:
        model.embed_tokens = GGUFEmbedding(embed, embed_kind, args.hidden_size, dtype)
    else:
        fill(model.embed_tokens.weight, embed.float(), "token_embd.weight")
    if head is None and embed_kind not in QUANTIZED:   # tied: the head reads the embedding's float weight
        if model.lm_head is not None:
            fill(model.lm_head.weight, embed.float(), "token_embd.weight (as the head)")
    elif head is not None and head_kind not in QUANTIZED:
        if model.lm_head is None:
            raise GGUFError(f"{path.name} has its own output.weight, but its metadata ties the head "
                            "to the embedding")
        fill(model.lm_head.weight, head.float(), "output.weight")
    else:
        blocks, kind = (embed, embed_kind) if head is None else (head, head_kind)
        model.use_head_matmul(GGUFLinear([blocks], [kind], args.hidden_size))
        model.lm_head = None
    params = dict(model.named_parameters())   # without the float weights that GGUF layers replaced
    for name, info in gguf.tensors.items():
        if name in used:
            continue
        hf_name = _hf_name(arch, name)
        if hf_name is None:
            raise GGUFError(f"{path.name}: tensor {name} has no place in the {arch} model")
        tensor = gguf.tensor(name).float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor - 1.0   # llama.cpp stores Gemma's norms as 1 + w
        if tensor.shape[0] == 1:
            tensor = tensor[0]
        parts = hf_name.split(".")
        row_map = _rope_map(arch, parts[-2], tensor.shape[0], args) if parts[-1] == "bias" else None
        if row_map is not None:
            tensor = tensor[row_map]
        for ours, piece in model.checkpoint_tensors(hf_name, tensor.to(dtype)):
            loaded.add(model._load_one(hf_name, ours, piece, params))
    missing = sorted(set(params) - loaded)
    if missing:
        raise GGUFError(f"{path.name} lacks tensors for {len(missing)} parameter(s), e.g. {missing[:3]}")
    model.gguf_types = types
    return types


def _rope_map(arch: str, proj: str, rows: int, args) -> Optional[torch.Tensor]:
    """Row map of a Llama-architecture q/k tensor (llama.cpp permutes its rows)."""
    if arch != "llama" or proj not in ("q_proj", "k_proj"):
        return None
    return rope_rows_to_hf(rows, args.num_heads if proj == "q_proj" else args.num_kv_heads)


def _hf_name(arch: str, name: str) -> Optional[str]:
    """The Hugging Face name of a float GGUF tensor (norms, biases); None: unknown."""
    if name == "output_norm.weight":
        return "model.norm.weight"
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    table = _GEMMA_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    module = table.get(parts[2])
    return None if module is None else f"model.layers.{parts[1]}.{module}.{parts[3]}"
