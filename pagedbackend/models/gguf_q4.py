"""The Q4_1 weights of a GGUF checkpoint as int4 (q, scale, minimum) per Hugging Face tensor.

A Q4_1 block holds 32 consecutive input features of one output row in 20
bytes: ``d`` and ``m`` (float16), then 16 bytes of nibbles, the low nibbles
being elements 0-15 and the high ones 16-31; the weight is ``d * q + m``. That
is ``quant.Int4Linear``'s format with group size 32, so the default model's
shipped blocks are served without a second rounding.

llama.cpp stores q_proj and k_proj with their rows permuted for its RoPE layout
(two halves of each head interleaved); the rows are put back in Hugging Face
order here.
"""
import os
import pathlib
import re
from typing import Dict, Tuple

import numpy as np
import torch

Q4_1_BLOCK = 32
Q4_1_BYTES = 20
# GGUF tensor -> Hugging Face projection inside model.layers.N.
_HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")

Int4Weight = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def unpack_q4_1(raw: np.ndarray, cols: int) -> Int4Weight:
    """(q uint8 ``[N, cols]``, d and m float32 ``[N, cols / 32]``) from Q4_1 rows of bytes."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // Q4_1_BLOCK, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return torch.from_numpy(q.reshape(rows, cols)), torch.from_numpy(d), torch.from_numpy(m)


def rope_rows_to_hf(rows: int, heads: int) -> torch.Tensor:
    """Index that puts llama.cpp's permuted q/k rows back in Hugging Face order."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def read_q4_1_weights(path: pathlib.Path, num_heads: int, num_kv_heads: int) -> Dict[str, Int4Weight]:
    """``{"model.layers.N.self_attn.q_proj.weight": (q, d, m), ...}`` for every Q4_1 projection."""
    from gguf import GGMLQuantizationType, GGUFReader

    out: Dict[str, Int4Weight] = {}
    for tensor in GGUFReader(str(path)).tensors:
        match = _LAYER_RE.match(tensor.name)
        if not match or match.group(2) not in _HF_NAMES:
            continue
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            raise ValueError(f"{path.name}: {tensor.name} is {tensor.tensor_type.name}, not Q4_1")
        cols = int(tensor.shape[0])   # GGUF lists the fastest (input) dimension first
        q, d, m = unpack_q4_1(np.asarray(tensor.data), cols)
        kind = match.group(2)
        if kind in ("attn_q", "attn_k"):
            order = rope_rows_to_hf(q.shape[0], num_heads if kind == "attn_q" else num_kv_heads)
            q, d, m = q[order], d[order], m[order]
        out[f"model.layers.{match.group(1)}.{_HF_NAMES[kind]}.weight"] = (q, d, m)
    return out


def cached_q4_1_weights(gguf_path: pathlib.Path, cache_file: pathlib.Path, num_heads: int,
                        num_kv_heads: int) -> Dict[str, Int4Weight]:
    """``read_q4_1_weights``, kept once in a safetensors file: the GGUF reader
    parses the whole tokenizer on every open (about 20 s), the cache loads in
    well under a second."""
    from safetensors.torch import load_file, save_file

    if not cache_file.is_file():
        weights = read_q4_1_weights(gguf_path, num_heads, num_kv_heads)
        flat = {f"{name}.{part}": t.contiguous() for name, qdm in weights.items()
                for part, t in zip(("q", "d", "m"), qdm)}
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        save_file(flat, str(tmp))
        os.replace(tmp, cache_file)   # atomic: a concurrent reader sees all or nothing
    flat = load_file(str(cache_file))
    names = {key.rsplit(".", 1)[0] for key in flat}
    return {name: (flat[f"{name}.q"], flat[f"{name}.d"], flat[f"{name}.m"]) for name in names}
