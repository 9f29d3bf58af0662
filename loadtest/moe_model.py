"""Random mixture-of-experts checkpoints for tests and the ``moe`` benchmark,
written as transformers 5 writes them (per-expert tensors for Qwen3-MoE and
Mixtral, fused 3-D experts for gpt-oss), with SmolLM2's tokenizer.

Weights are seeded; each matrix is drawn with a standard deviation of
``gain / sqrt(fan_in)`` so activations keep their scale through the layers and
greedy decoding neither sits on near-ties nor repeats one token. A large
checkpoint is written tensor by tensor without building the model.
"""
import json
import pathlib
import shutil
from typing import Dict, Iterator, Tuple

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# The moe benchmark's checkpoint: Qwen3-30B-A3B's proportions (top-8 of 64
# experts, q/k norms, GQA 16/4) at 0.99 B parameters, 0.19 B active per token.
BENCH_QWEN3_MOE = dict(
    model_type="qwen3_moe", vocab_size=49152, hidden_size=1024, intermediate_size=3072,
    moe_intermediate_size=384, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1, eos_token_id=2,
)
# The dense model of the same active size: the experts' top-8 width (8 x 384)
# as one MLP, the same attention, embedding and depth (0.19 B parameters).
BENCH_DENSE = dict(
    model_type="qwen2", vocab_size=49152, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    bos_token_id=1, eos_token_id=2,
)


def _qwen_layer_tensors(cfg: dict, layer: int, sparse: bool) -> Iterator[Tuple[str, Tuple[int, ...]]]:
    hidden, heads, kv, dim = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                              cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    p = f"model.layers.{layer}."
    yield p + "input_layernorm.weight", (hidden,)
    yield p + "post_attention_layernorm.weight", (hidden,)
    yield p + "self_attn.q_proj.weight", (heads * dim, hidden)
    yield p + "self_attn.k_proj.weight", (kv * dim, hidden)
    yield p + "self_attn.v_proj.weight", (kv * dim, hidden)
    yield p + "self_attn.o_proj.weight", (hidden, heads * dim)
    if cfg["model_type"] == "qwen3_moe":
        yield p + "self_attn.q_norm.weight", (dim,)
        yield p + "self_attn.k_norm.weight", (dim,)
    elif cfg["model_type"] == "qwen2":
        for name, rows in (("q", heads * dim), ("k", kv * dim), ("v", kv * dim)):
            yield p + f"self_attn.{name}_proj.bias", (rows,)
    if sparse:
        inter = cfg["moe_intermediate_size"]
        yield p + "mlp.gate.weight", (cfg["num_experts"], hidden)
        for e in range(cfg["num_experts"]):
            yield p + f"mlp.experts.{e}.gate_proj.weight", (inter, hidden)
            yield p + f"mlp.experts.{e}.up_proj.weight", (inter, hidden)
            yield p + f"mlp.experts.{e}.down_proj.weight", (hidden, inter)
    else:
        inter = cfg["intermediate_size"]
        yield p + "mlp.gate_proj.weight", (inter, hidden)
        yield p + "mlp.up_proj.weight", (inter, hidden)
        yield p + "mlp.down_proj.weight", (hidden, inter)


def write_large_qwen(path, cfg: dict, seed: int = 0, gain: float = 1.0,
                     dtype: torch.dtype = torch.bfloat16) -> pathlib.Path:
    """A Qwen3-MoE or Qwen2 checkpoint of ``cfg`` written tensor by tensor in
    ``dtype`` (shards of at most 2 GB), with its config.json and tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    settings = dict(cfg)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    config.dtype = str(dtype).removeprefix("torch.")
    # What the class serving the checkpoint is called (vLLM picks its model by it).
    config.architectures = [ARCHITECTURES[cfg["model_type"]]]
    g = torch.Generator().manual_seed(seed)
    names = [("model.embed_tokens.weight", (cfg["vocab_size"], cfg["hidden_size"]))]
    for layer in range(cfg["num_hidden_layers"]):
        sparse = (cfg["model_type"] == "qwen3_moe" and layer not in cfg.get("mlp_only_layers", [])
                  and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        names += list(_qwen_layer_tensors(cfg, layer, sparse))
    names.append(("model.norm.weight", (cfg["hidden_size"],)))
    if not cfg.get("tie_word_embeddings"):
        names.append(("lm_head.weight", (cfg["vocab_size"], cfg["hidden_size"])))
    shard: Dict[str, torch.Tensor] = {}
    weight_map, shards, size = {}, 0, 0
    for index, (name, shape) in enumerate(names):
        if len(shape) == 1:
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=g) if name.endswith("norm.weight") else \
                0.1 * torch.randn(shape, generator=g)
        else:
            std = gain / shape[1] ** 0.5 if "embed_tokens" not in name else 1.0
            tensor = torch.randn(shape, generator=g) * std
        shard[name] = tensor.to(dtype)
        size += shard[name].numel() * shard[name].element_size()
        if size >= 2 << 30 or index == len(names) - 1:
            shards += 1
            file = f"model-{shards:05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(path)
    copy_tokenizer(path)
    return path


def copy_tokenizer(path: pathlib.Path) -> None:
    """SmolLM2's tokenizer files from the prepared default model."""
    from pagedbackend.models.default_model import resolve_model_path
    source = resolve_model_path("default")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)


def parameter_counts(cfg: dict) -> Dict[str, int]:
    """Total and active (per token) parameters of a Qwen3-MoE or Qwen2 config,
    the embedding counted once when tied (its one row per token is not counted active)."""
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg.get("head_dim") or hidden // heads
    attention = hidden * dim * (2 * heads + 2 * kv)
    embed = cfg["vocab_size"] * hidden
    if cfg["model_type"] == "qwen3_moe":
        expert = 3 * hidden * cfg["moe_intermediate_size"]
        total_mlp, active_mlp = cfg["num_experts"] * expert, cfg["num_experts_per_tok"] * expert
    else:
        total_mlp = active_mlp = 3 * hidden * cfg["intermediate_size"]
    layers = cfg["num_hidden_layers"]
    head = embed   # the LM head reads every row, tied or not
    return {"total": embed * (1 if cfg.get("tie_word_embeddings") else 2) + layers * (attention + total_mlp),
            "active": head + layers * (attention + active_mlp),
            "expert_bytes_fp32": (3 * hidden * cfg.get("moe_intermediate_size", 0)) * 4}


# Tiny random checkpoints of each family for tests (hidden 256, 4 layers, SmolLM2's vocabulary).
TINY_MOE = {
    # Top-3 of 8 with norm_topk_prob; layer 1 dense (mlp_only_layers), q/k norms.
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=64, num_experts=8, num_experts_per_tok=3,
                      norm_topk_prob=True, head_dim=64, decoder_sparse_step=1, mlp_only_layers=[1],
                      tie_word_embeddings=False),
    # Top-2 of 4, untied.
    "mixtral": dict(model_type="mixtral", intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=False),
    # Top-4 of 8, alternating 128-position windows and full layers, yarn RoPE as published.
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=64, num_local_experts=8, num_experts_per_tok=4,
                    head_dim=64, sliding_window=128, max_position_embeddings=4096, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096,
                                     "rope_theta": 150000.0}),
}


def build_tiny_moe(path, family: str, seed: int = 0, **overrides) -> pathlib.Path:
    """A tiny random checkpoint of ``family`` (``TINY_MOE``), saved by transformers
    itself. gpt-oss gets sinks of a unit scale (they take a real share of each
    softmax) and gate/up weights three times wider (some activations reach the clamp)."""
    from loadtest.tiny_model import build_tiny_llama
    path = build_tiny_llama(path, seed=seed, **{**TINY_MOE[family], **overrides})
    if family == "gpt_oss":
        _edit_tensors(path, lambda name, t: (torch.randn(t.shape, generator=torch.Generator().manual_seed(
            seed)) + 0.5 if name.endswith("sinks") else 3 * t if name.endswith("gate_up_proj") else t))
    return path


def _edit_tensors(path: pathlib.Path, edit) -> None:
    from safetensors.torch import load_file, save_file
    file = path / "model.safetensors"
    tensors = {name: edit(name, t) for name, t in load_file(str(file)).items()}
    save_file(tensors, str(file), metadata={"format": "pt"})


def write_mxfp4_copy(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """``source`` (a gpt-oss checkpoint) with its experts' projections in MXFP4,
    as gpt-oss publishes them: ``..._blocks`` and ``..._scales`` in the linear
    orientation and a ``quantization_config`` saying ``mxfp4``."""
    from safetensors.torch import load_file, save_file

    from pagedbackend.models import mxfp4
    target = pathlib.Path(target)
    shutil.copytree(source, target, dirs_exist_ok=True)
    tensors = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4.quantize(
                tensor.transpose(1, 2).contiguous())
        else:
            tensors[name] = tensor
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
