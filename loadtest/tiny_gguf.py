"""Tiny random checkpoints written as GGUF files, for the GGUF tests and benchmarks.

transformers builds a random model of a family; its tensors are written
under llama.cpp's names and layouts (q/k rows permuted for Llama and Mistral,
Gemma's norms stored as ``1 + w``, Phi-3's fused q/k/v and gate/up, Qwen3-MoE's
experts as 3-D ``ffn_{gate,up,down}_exps`` tensors, one expert after another) with the
``gguf`` package's writer, quantised per a scheme: ``Q8_0``, ``Q4_0``,
``Q4_1``, and the mixtures ``Q4_K_M`` (Q4_K, with Q6_K for the output and for
attn_v and ffn_down in the layers llama.cpp gives more bits) and ``Q5_K_M``
(the same with Q5_K); a K-quant tensor whose rows are not whole super-blocks
of 256 takes llama-quantize's fallback (Q5_0, Q5_1, Q8_0). gguf-py quantises Q8_0, Q4_0 and Q4_1 itself; it only
reads K-quants, so ``quantize_k`` writes their blocks here (plain min/max
rounding per sub-block: valid blocks, not llama.cpp's search for the best
scales). The tokenizer is a byte-level BPE of a few hundred tokens trained on
the spot, with a ChatML template. Only the GGUF file is written.
"""
import inspect
import json
import pathlib
from typing import Dict, List, Tuple

import numpy as np
import torch

QK_K = 256
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 384
# Shapes divisible by 256, as K-quant rows need.
TEXT = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
            bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
# family -> (model_type, GGUF architecture, config fields)
FAMILIES = {
    "llama": ("llama", "llama", dict(TEXT)),
    "mistral": ("mistral", "llama", dict(TEXT, sliding_window=None)),
    "qwen2": ("qwen2", "qwen2", dict(TEXT)),
    # transformers reads no head_dim from a qwen3 GGUF: its default (128) it is.
    "qwen3": ("qwen3", "qwen3", dict(TEXT, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                     tie_word_embeddings=True)),
    # Both layers sliding (transformers' default pattern from a GGUF), windows of 16 positions.
    "gemma3": ("gemma3_text", "gemma3", dict(TEXT, head_dim=64, sliding_window=16, tie_word_embeddings=True)),
    "phi3": ("phi3", "phi3", dict(TEXT)),
    # Every layer with 4 experts, top 2, renormalised (llama.cpp's rule, transformers' GGUF default).
    # transformers reads no expert_feed_forward_length from a qwen3moe GGUF: its default (768) it is.
    "qwen3_moe": ("qwen3_moe", "qwen3moe", dict(TEXT, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=768, norm_topk_prob=True)),
}
SCHEMES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "F16", "BF16", "F32")
FLOAT_SCHEMES = ("F16", "BF16", "F32")


# ---------------------------------------------------------------- tokenizer

def tiny_tokenizer() -> Tuple[List[str], List[int], List[str]]:
    """(tokens, token types, merges) of a byte-level BPE of ``VOCAB`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([inspect.getsource(json), inspect.getsource(pathlib)], trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    types = [3 if t in SPECIAL else 1 for t in tokens]   # 3: control, 1: normal
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, types, merges


# ---------------------------------------------------------------- K-quant blocks

def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes of eight 6-bit scales and minimums (Q4_K, Q5_K)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _q_minmax(blocks: np.ndarray, levels: int):
    """Blocks of 256 as (d, dmin, 6-bit scales, 6-bit minimums, q) for Q4_K (15) / Q5_K (31)."""
    sub = blocks.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / levels
    d = scale.max(-1) / 63
    dmin = (-low).max(-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d16[:, None], out=np.zeros_like(scale), where=d16[:, None] > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(-low, dmin16[:, None], out=np.zeros_like(low), where=dmin16[:, None] > 0)), 0, 63)
    step = d16[:, None] * sc
    offset = dmin16[:, None] * mn
    q = np.divide(sub + offset[..., None], step[..., None], out=np.zeros_like(sub), where=step[..., None] > 0)
    q = np.clip(np.round(q), 0, levels).astype(np.uint8).reshape(-1, QK_K)
    return d, dmin, sc, mn, q


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """128 bytes: chunk c holds elements 64c..64c+31 low and 64c+32.. high."""
    q = q.reshape(-1, 4, 2, 32)
    return ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(-1, 128)


def quantize_k(rows: np.ndarray, kind: str) -> np.ndarray:
    """``rows`` (float32 ``[N, K]``, K a multiple of 256) as Q4_K, Q5_K or Q6_K bytes ``[N, bytes]``."""
    n, k = rows.shape
    blocks = rows.reshape(-1, QK_K)
    if kind == "Q4_K":
        d, dmin, sc, mn, q = _q_minmax(blocks, 15)
        out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), _nibbles_k(q)], axis=1)
    elif kind == "Q5_K":
        d, dmin, sc, mn, q = _q_minmax(blocks, 31)
        high = (q.reshape(-1, 8, 32) >> 4) & 1
        qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
        out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, _nibbles_k(q)], axis=1)
    elif kind == "Q6_K":
        sub = blocks.reshape(-1, 16, 16).astype(np.float32)
        scale = np.abs(sub).max(-1) / 31
        d = scale.max(-1) / 127
        d16 = d.astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(np.divide(scale, d16[:, None], out=np.zeros_like(scale), where=d16[:, None] > 0)),
                     -128, 127)
        step = (d16[:, None] * sc)[..., None]
        q = np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)
        q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
        ql = ((q[:, :, :64] & 0xF) | ((q[:, :, 64:] & 0xF) << 4)).reshape(-1, 128)
        hi = (q >> 4).reshape(-1, 2, 4, 32)
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
        out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)
    else:
        raise ValueError(f"quantize_k writes Q4_K, Q5_K and Q6_K, not {kind}")
    return np.ascontiguousarray(out).reshape(n, -1)


def quantize(rows: np.ndarray, kind: str) -> np.ndarray:
    """``rows`` (``[..., K]``) as GGUF blocks of ``kind`` (uint8 ``[..., row bytes]``)."""
    import gguf
    flat = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, rows.shape[-1])
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        out = quantize_k(flat, kind)
    else:
        out = gguf.quants.quantize(flat, gguf.GGMLQuantizationType[kind])
    return out.reshape(*rows.shape[:-1], out.shape[-1])


# ---------------------------------------------------------------- the file

def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v and ffn_down Q4_K_M keeps at Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# llama-quantize's types for a K-quant tensor whose rows are not whole super-blocks of 256.
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def tensor_kind(name: str, scheme: str, layers: int, cols: int = QK_K) -> str:
    """The GGUF type of tensor ``name`` (rows of ``cols`` values) in a file of
    ``scheme``; a K-quant tensor whose rows are not whole super-blocks falls
    back to a 32-value type, as llama-quantize does (``K_FALLBACK``)."""
    kind = _scheme_kind(name, scheme, layers)
    if kind in K_FALLBACK and cols % QK_K:
        kind = K_FALLBACK[kind]
    return kind


def _scheme_kind(name: str, scheme: str, layers: int) -> str:
    if name.endswith(("norm.weight", ".bias", "ffn_gate_inp.weight")):   # llama.cpp keeps routers float
        return "F32"
    if scheme in FLOAT_SCHEMES:   # a converted, unquantised file: every matrix in that type
        return scheme
    if scheme in ("Q8_0", "Q4_0", "Q4_1"):
        return "Q6_K" if name == "output.weight" and scheme != "Q8_0" else scheme
    base = "Q4_K" if scheme == "Q4_K_M" else "Q5_K"
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and _more_bits(int(name.split(".")[1]), layers):
        return "Q6_K"
    return base


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of q/k for Llama-architecture files."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: Dict[str, torch.Tensor], cfg: dict, arch: str) -> Dict[str, np.ndarray]:
    """Hugging Face tensors under llama.cpp's names and layouts."""
    out = {}
    rename = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp"}
    if arch == "gemma3":
        rename.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                       "post_feedforward_layernorm": "post_ffw_norm"})
    for name, tensor in state.items():
        t = tensor.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0   # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif name == "model.norm.weight":
            out["output_norm.weight"] = t
        elif name == "lm_head.weight":
            if not cfg.get("tie_word_embeddings"):
                out["output.weight"] = t
        else:
            parts = name.split(".")
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            if name.endswith("mlp.experts.gate_up_proj"):   # [E, 2I, H]: gate rows, then up rows
                gate, up = np.split(t, 2, axis=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"] = gate
                out[f"blk.{layer}.ffn_up_exps.weight"] = up
                continue
            if name.endswith("mlp.experts.down_proj"):      # [E, H, I]
                out[f"blk.{layer}.ffn_down_exps.weight"] = t
                continue
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg["num_attention_heads"] if module.endswith("q_proj") else cfg["num_key_value_heads"]
                t = _permute(t, heads)
            out[f"blk.{layer}.{rename[module]}.{kind}"] = t
    return out


def write_gguf(path, state: Dict[str, torch.Tensor], cfg: dict, arch: str, scheme: str) -> pathlib.Path:
    """Write ``state`` (a Hugging Face state dict of config ``cfg``) as a GGUF of ``scheme``."""
    import gguf
    path = pathlib.Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")   # transformers saves the latter
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    tokens, types, merges = tiny_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, t in gguf_tensors(state, cfg, arch).items():
        kind = tensor_kind(name, scheme, cfg["num_hidden_layers"], t.shape[-1])
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
        elif kind == "F16":
            writer.add_tensor(name, np.ascontiguousarray(t, dtype=np.float16))
        elif kind == "BF16":
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32),
                                                         gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, quantize(t, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_checkpoint(family: str, seed: int = 0, std: float = 0.08,
                    **overrides) -> Tuple[Dict[str, torch.Tensor], dict, str]:
    """(state dict, config, GGUF architecture) of a random checkpoint of ``family`` (a key of ``FAMILIES``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, arch, settings = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**settings, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):   # Gemma's norms multiply by 1 + w
                param.copy_((0.0 if model_type.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(param))
            elif name.endswith("embed_tokens.weight") and model_type.startswith("gemma"):
                # Gemma scales embeddings by sqrt(hidden); its tied head would otherwise echo the input token
                param.normal_(0.0, std / 8)
            else:
                param.normal_(0.0, std)
    cfg = {**config.to_dict(), "head_dim": getattr(config, "head_dim", None)}
    cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return model.state_dict(), cfg, arch


def build_tiny_gguf(folder, family: str, scheme: str, seed: int = 0, std: float = 0.08,
                    **overrides) -> pathlib.Path:
    """``folder/<family>-<scheme>.gguf``: a random checkpoint of ``family`` (a key of ``FAMILIES``)."""
    state, cfg, arch = tiny_checkpoint(family, seed, std, **overrides)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return write_gguf(folder / f"{family}-{scheme}.gguf", state, cfg, arch, scheme)


def load_hf_gguf(path):
    """transformers' own reading of the GGUF file (its weights dequantised), fp32, for reference outputs."""
    from transformers import AutoModelForCausalLM
    path = pathlib.Path(path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
