"""The KV cache's element formats (``EngineConfig.kv_cache_dtype``) and the
torch rules that write and read them; every kernel (C, Triton-lang, torch)
follows these rules, and the tests compare each against them.

- ``auto``: the model's dtype, as it was before this setting.
- ``bfloat16``: a cast on write (round to nearest even) and on read.
- ``int8``: symmetric absmax in groups of 16 channels, one float16 scale
  per (token, KV head, group): a cache row (one token's one KV head) holds
  ``head_dim`` int8 values and then their ``head_dim / 16`` scales, so an
  int8 cache is ``[blocks, block_size, kv_heads, head_dim * 9 / 8]`` of int8
  (72 bytes a row at head size 64, against bfloat16's 128: 1.78x the tokens).
  Each row is quantised once, as its token is written, and never again: a
  block filling up never re-scales what it holds.
  Groups, not one scale per row: a key's few large channels (RoPE pairs at
  low frequencies) set a row's absmax, and one scale for the row left its
  other channels a handful of levels; the default model then kept its 32
  greedy tokens on 18 of 32 prompts, with float32 scales per 32 channels on
  29, and float16 ones per 16 (the same 72 bytes) on 30 (bfloat16: 30),
  docs/kv_cache_dtype.md.
  The scales live in the row rather than in a side tensor so that every
  move of a block (copy-on-write, swap to the host, a KV group's layers in
  one tensor) moves the scales with their values as the same bytes, with no
  second tensor for any of them to forget; the float16 view of the same
  cache (``scale_view``) reads them where a kernel wants them.
  ``value = int8 * scale``, ``int8 = round(x * (1 / scale))`` clamped to
  ±127, with ``scale`` the smallest float16 with ``127 * scale >= absmax``
  (rounded up, so that no value lands past ±127; never 0 for a group that
  is not all zeros, down to float16's subnormals: 2^-24 for an absmax below
  about 7.6e-6) and at most 65504, float16's largest (a group whose absmax
  passes 127 * 65504 = 8.3e6 saturates there). A group of zeros: scale 0.
- ``fp8_e4m3`` (alias ``fp8``) and ``fp8_e5m2``: one byte a value, torch's
  ``float8_e4m3fn`` / ``float8_e5m2``, no scale in the row (2x bfloat16's
  tokens). A value is clamped to the format's largest finite magnitude (448,
  57344) and rounded to nearest even, as torch converts; a row is read by
  widening each byte (exact). The per-layer ``k_scale`` / ``v_scale`` (a
  checkpoint's, or calculated: ``models/fp8_scales.py``) are applied outside
  the kernels: the attention op stores ``k / k_scale`` and folds ``k_scale``
  into the softmax scale and ``v_scale`` into the output, so the kernels
  see scale 1.
"""
from typing import Optional

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The largest finite magnitude of each fp8 format: values beyond it are clamped.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Channels per int8 scale; the scales (float16) follow a row's values.
GROUP = 16
# What an int8 row's bytes mean, for anything that keeps rows beyond this
# process (the disk tier refuses rows written in another format).
INT8_FORMAT = f"int8, float16 scale per {GROUP} channels"
SCALE_MAX = 65504.0   # float16's largest finite value: scales saturate there


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a cache of ``kv_cache_dtype`` for a model in ``model_dtype``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    return {"auto": model_dtype, "bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row (one token, one KV head) in a cache of ``dtype``."""
    return head_dim + 2 * (head_dim // GROUP) if dtype == torch.int8 else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    return row_width(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache ``[..., row]`` holds."""
    return cache.shape[-1] * GROUP // (GROUP + 2) if cache.dtype == torch.int8 else cache.shape[-1]


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


def int8_scales(absmax: torch.Tensor) -> torch.Tensor:
    """The float16 scales of groups with float32 ``absmax``: the smallest
    float16 ``s`` at most ``SCALE_MAX`` with ``127 * s >= absmax`` (0 for 0).
    The float16 nearest ``absmax / 127`` is at most one step short; ``127 * s``
    is exact in float32, so every kernel finds the same step however it
    rounded the division."""
    scale = (absmax / 127.0).clamp_(max=SCALE_MAX).to(torch.float16)   # to nearest even
    short = (scale.float() * 127.0 < absmax) & (scale < SCALE_MAX)
    return torch.where(short, (scale.view(torch.int16) + 1).view(torch.float16), scale)   # the next float16 up


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (any float dtype) as int8 rows ``[..., row_width]``."""
    check_head_dim(x.shape[-1], torch.int8)
    groups = x.float().unflatten(-1, (-1, GROUP))
    scale = int8_scales(groups.abs().amax(dim=-1, keepdim=True))
    wide = scale.float()
    inv = torch.where(wide > 0, 1.0 / wide, torch.zeros_like(wide))
    values = torch.round(groups * inv).clamp_(-127, 127).to(torch.int8).flatten(-2)
    return torch.cat([values, scale.squeeze(-1).contiguous().view(torch.int8)], dim=-1)   # the float16s' bytes


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x`` ``[..., head_dim]`` in the cache's format ``dtype``."""
    if dtype in FP8_DTYPES:
        return x.float().clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """The float16 scales ``[..., head_dim / 16]`` of an int8 cache (a view)."""
    head_dim = head_dim_of(cache)
    return cache.view(torch.float16)[..., head_dim // 2:]


def scale_pointers(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """What the Triton-lang kernels take as their scale pointers: an int8
    cache pair viewed as float16 (a row's scales at ``head_dim / 2`` on), any
    other pair as it is (unread)."""
    if k_cache.dtype != torch.int8:
        return k_cache, v_cache
    return k_cache.view(torch.float16), v_cache.view(torch.float16)


def decode(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows ``[..., row]`` as values ``[..., head_dim]`` in ``dtype``."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = head_dim_of(rows)
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float()
    values = rows[..., :head_dim].float().unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def native_kind(dtype: torch.dtype) -> Optional[int]:
    """The C kernels' number for a cache of ``dtype`` (``csrc/paged_decode.c``:
    0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3, 4 fp8 e5m2), None for a dtype they do not read."""
    return {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3,
            torch.float8_e5m2: 4}.get(dtype)
