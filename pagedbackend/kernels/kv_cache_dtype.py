"""The KV cache's element formats (``EngineConfig.kv_cache_dtype``) and the
torch rules that write and read them; every kernel (C, Triton-lang, torch)
follows these rules, and the tests compare each against them.

- ``auto``: the model's dtype, as it was before this setting.
- ``bfloat16``: a cast on write (round to nearest even) and on read.
- ``int8``: symmetric absmax in groups of 32 channels, one float32 scale
  per (token, KV head, group): a cache row (one token's one KV head) holds
  ``head_dim`` int8 values and then their ``head_dim / 32`` scales, so an
  int8 cache is ``[blocks, block_size, kv_heads, head_dim * 9 / 8]`` of int8
  (72 bytes a row at head size 64, against bfloat16's 128: 1.78x the tokens).
  Each row is quantised once, as its token is written, and never again: a
  block filling up never re-scales what it holds.
  Groups, not one scale per row: a key's few large channels (RoPE pairs at
  low frequencies) set a row's absmax, and one scale for the row left its
  other channels a handful of levels; the default model then kept its 32
  greedy tokens on 18 of 32 prompts, with groups of 32 on 29 (16: 30, at
  80 bytes a row; bfloat16: 30), docs/kv_cache_dtype.md.
  The scales live in the row rather than in a float32 side tensor so that
  every move of a block (copy-on-write, swap to the host, a KV group's
  layers in one tensor) moves the scales with their values as the same
  bytes, with no second tensor for any of them to forget; the float32 view
  of the same cache (``scale_view``) reads them where a kernel wants them.
  ``value = int8 * scale`` with ``scale = absmax / 127`` and
  ``int8 = round(x * (127 / absmax))`` per group (a group of zeros: scale 0).
- ``fp8_e4m3`` (alias ``fp8``) and ``fp8_e5m2``: one byte a value, torch's
  ``float8_e4m3fn`` / ``float8_e5m2``, no scale in the row (2x bfloat16's
  tokens). A value is clamped to the format's largest finite magnitude (448,
  57344) and rounded to nearest even, as torch converts; a row is read by
  widening each byte (exact). The per-layer ``k_scale`` / ``v_scale`` of
  vLLM's fp8 checkpoints are applied outside the cache (``fp8_scales.py``):
  the layer stores ``k / k_scale`` and folds ``k_scale`` into the softmax
  scale and ``v_scale`` into the output, so the kernels see scale 1.
"""
from typing import Optional

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The largest finite magnitude of each fp8 format: values beyond it are clamped.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Channels per int8 scale; the scales (float32) follow a row's values.
GROUP = 32


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a cache of ``kv_cache_dtype`` for a model in ``model_dtype``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    return {"auto": model_dtype, "bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row (one token, one KV head) in a cache of ``dtype``."""
    return head_dim + 4 * (head_dim // GROUP) if dtype == torch.int8 else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    return row_width(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache ``[..., row]`` holds."""
    return cache.shape[-1] * GROUP // (GROUP + 4) if cache.dtype == torch.int8 else cache.shape[-1]


def check_head_dim(head_dim: int, dtype: torch.dtype) -> None:
    if dtype == torch.int8 and head_dim % GROUP:
        raise ValueError(f"kv_cache_dtype int8 needs a head size that is a multiple of {GROUP} "
                         f"(a scale per {GROUP} channels); the model's is {head_dim}")


def check_triton_cache(device: torch.device, model_dtype: torch.dtype, kv_dtype: torch.dtype,
                       name: str) -> None:
    """Refuse, by name, a quantised cache the Triton-lang kernels cannot run
    on this GPU: beside float32 tiles (they spill registers), and fp8_e4m3 on
    a GPU older than sm_89 (Triton has no e4m3 there: ``make gpu-check``)."""
    if device.type != "cuda" or kv_dtype == model_dtype:
        return
    if model_dtype == torch.float32:
        raise ValueError(f"kv_cache_dtype={name} with the triton attention backend needs dtype bfloat16 or "
                         "float16 on a GPU (float32 tiles beside the cache's spill registers: "
                         "docs/kv_cache_dtype.md); got float32")
    capability = torch.cuda.get_device_capability(device)
    if kv_dtype == torch.float8_e4m3fn and capability < (8, 9):
        raise ValueError(f"kv_cache_dtype={name} needs a GPU of compute capability 8.9 or newer for the triton "
                         f"attention backend (Triton has no float8 e4m3 on sm_{capability[0]}{capability[1]}); "
                         "fp8_e5m2 or int8 run there")


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (any float dtype) as int8 rows ``[..., row_width]``."""
    check_head_dim(x.shape[-1], torch.int8)
    groups = x.float().unflatten(-1, (-1, GROUP))
    absmax = groups.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    values = torch.round(groups * inv).clamp_(-127, 127).to(torch.int8).flatten(-2)
    scales = (absmax / 127.0).squeeze(-1).contiguous().view(torch.int8)   # the float32s' bytes
    return torch.cat([values, scales], dim=-1)


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x`` ``[..., head_dim]`` in the cache's format ``dtype``."""
    if dtype in FP8_DTYPES:
        return x.float().clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``[..., head_dim / 32]`` of an int8 cache (a view)."""
    head_dim = head_dim_of(cache)
    return cache.view(torch.float32)[..., head_dim // 4:]


def decode(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows ``[..., row]`` as values ``[..., head_dim]`` in ``dtype``."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = head_dim_of(rows)
    scales = rows[..., head_dim:].contiguous().view(torch.float32)
    values = rows[..., :head_dim].float().unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def native_kind(dtype: torch.dtype) -> Optional[int]:
    """The C kernels' number for a cache of ``dtype`` (``csrc/paged_decode.c``:
    0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3, 4 fp8 e5m2), None for a dtype they do not read."""
    return {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3,
            torch.float8_e5m2: 4}.get(dtype)
