"""Scatter new tokens' K and V into their slots of a paged per-layer cache.

Cache layout: ``[num_blocks, block_size, num_kv_heads, row]`` for K and V,
``row`` being ``head_dim`` (the model's dtype, or bfloat16) or ``head_dim * 9 / 8``
(int8 values and a float16 scale per 16 of them: ``kv_cache_dtype.py``), or
``head_dim`` fp8 bytes (clamped to the format's range). A token's slot
is ``physical_block * block_size + offset``; a negative slot means "do not
store" (a padding token).
"""
import torch

from pagedbackend.kernels import interpret_without_gpu
from pagedbackend.kernels.kv_cache_dtype import FP8_MAX, encode, scale_pointers

interpret_without_gpu()   # before any kernel is defined
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _int8_scale(absmax):
    """kv_cache_dtype.int8_scales in float32 arithmetic (the value of the
    float16): the float16 nearest absmax / 127, found from its float32 bits
    (or in whole steps of 2^-24 below float16's normals), and one step up
    where 127 times it falls short of absmax (127 * s is exact in float32)."""
    x = tl.minimum(absmax / 127.0, 65504.0)
    bits = x.to(tl.int32, bitcast=True)
    normal = (((bits + 0xFFF + ((bits >> 13) & 1)) >> 13) << 13).to(tl.float32, bitcast=True)
    # 1.5 * 2**23 added and taken away: to the nearest integer, ties to even.
    subnormal = ((x * 16777216.0 + 12582912.0) - 12582912.0) * 5.9604644775390625e-08
    s = tl.where(x < 6.103515625e-05, subnormal, normal)
    step_exp = tl.maximum((s.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 14) - 10
    step = (step_exp << 23).to(tl.float32, bitcast=True)   # float16's step at s: 2^-24 at least
    return tl.where((s * 127.0 < absmax) & (s < 65504.0), s + step, s)


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference: ``key``/``value`` are ``[num_tokens, num_kv_heads, head_dim]``."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat[slots] = encode(key[keep], k_cache.dtype)
    v_flat[slots] = encode(value[keep], v_cache.dtype)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEADS: tl.constexpr, DIM: tl.constexpr, QUANT: tl.constexpr, CLAMP: tl.constexpr,
    MANTISSA: tl.constexpr = 3, MIN_EXP: tl.constexpr = -6,
):
    # One program per token: every KV head of the token moves as one [HEADS, DIM] tile.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size

    # A negative slot leaves no heads to move, so a skipped token touches no memory.
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    hs = tl.arange(0, HEADS)
    h = hs[:, None]
    d = tl.arange(0, DIM)[None, :]
    mask = (h < heads) & (d < head_dim)

    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    # Through fp32, so any source dtype reaches the cache dtype by one rule
    # (and the interpreter never does arithmetic on raw bf16).
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    k_row = block * stride_kcb + offset * stride_kcs + hs * stride_kch
    v_row = block * stride_vcb + offset * stride_vcs + hs * stride_vch
    if QUANT:
        # int8 with an absmax scale (float16) per 16 channels after the
        # values (the scale pointers: the same caches viewed as float16).
        k_scale = tl.zeros([HEADS, DIM], dtype=tl.float32)   # each channel's group's scale
        v_scale = tl.zeros([HEADS, DIM], dtype=tl.float32)
        for g in tl.static_range(DIM // 16):
            in_group = (d // 16 == g) & mask
            k_top = _int8_scale(tl.max(tl.where(in_group, tl.abs(k), 0.0), 1))
            v_top = _int8_scale(tl.max(tl.where(in_group, tl.abs(v), 0.0), 1))
            k_scale = tl.where(d // 16 == g, k_top[:, None], k_scale)
            v_scale = tl.where(d // 16 == g, v_top[:, None], v_scale)
            stored = (hs < heads) & (hs * 0 + g * 16 < head_dim)
            tl.store(k_scale_ptr + (k_row + head_dim + 2 * g) // 2, k_top.to(tl.float16), mask=stored)
            tl.store(v_scale_ptr + (v_row + head_dim + 2 * g) // 2, v_top.to(tl.float16), mask=stored)
        # Clamped first (a group saturated at the largest scale can pass
        # 2**22), then 1.5 * 2**23 added and taken away: the nearest integer,
        # ties to even (torch.round's rule), in IEEE arithmetic on any device
        # and in the interpreter.
        # (A group of zeros has scale 0: its values divided by 1 instead.)
        k = tl.minimum(tl.maximum(k * (1.0 / tl.where(k_scale > 0, k_scale, 1.0)), -127.0), 127.0)
        v = tl.minimum(tl.maximum(v * (1.0 / tl.where(v_scale > 0, v_scale, 1.0)), -127.0), 127.0)
        k = (k + 12582912.0) - 12582912.0
        v = (v + 12582912.0) - 12582912.0
    if CLAMP > 0:
        # fp8: saturate at the format's largest finite value, then round to the
        # format's grid (to nearest even) in fp32, so that the conversion below
        # is exact on every device (the interpreter's own fp32 -> fp8 is not).
        # The step is a power of two made from the value's exponent bits (at
        # least the smallest normal's, for subnormals); x / step is below
        # 2**(MANTISSA + 1), so the 1.5 * 2**23 trick rounds it, ties to even.
        k = tl.minimum(tl.maximum(k, -CLAMP), CLAMP)
        v = tl.minimum(tl.maximum(v, -CLAMP), CLAMP)
        k_exp = tl.maximum((k.to(tl.int32, bitcast=True) >> 23) & 0xFF, MIN_EXP + 127) - MANTISSA
        v_exp = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, MIN_EXP + 127) - MANTISSA
        k_step = (k_exp << 23).to(tl.float32, bitcast=True)
        v_step = (v_exp << 23).to(tl.float32, bitcast=True)
        k = ((k / k_step + 12582912.0) - 12582912.0) * k_step
        v = ((v / v_step + 12582912.0) - 12582912.0) * v_step
    tl.store(k_cache_ptr + k_row[:, None] + d * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_row[:, None] + d * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton-lang twin of :func:`write_kv_ref`: one program per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quant = k_cache.dtype == torch.int8
    scales = scale_pointers(k_cache, v_cache)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, *scales, slot_mapping,
        num_kv_heads, head_dim, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        HEADS=triton.next_power_of_2(num_kv_heads), DIM=triton.next_power_of_2(head_dim), QUANT=quant,
        CLAMP=FP8_MAX.get(k_cache.dtype, 0.0), **({"MANTISSA": 2, "MIN_EXP": -14} if k_cache.dtype == torch.float8_e5m2 else {}),
    )
