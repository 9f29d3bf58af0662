"""Scatter new tokens' K and V into their slots of a paged per-layer cache.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V.
A token's slot is ``physical_block * block_size + offset``; a negative slot
means "do not store" (a padding token).
"""
import torch

from pagedbackend.kernels import interpret_without_gpu

interpret_without_gpu()   # before any kernel is defined
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference: ``key``/``value`` are ``[num_tokens, num_kv_heads, head_dim]``."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEADS: tl.constexpr, DIM: tl.constexpr,
):
    # One program per token: every KV head of the token moves as one [HEADS, DIM] tile.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size

    # A negative slot leaves no heads to move, so a skipped token touches no memory.
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, DIM)[None, :]
    mask = (h < heads) & (d < head_dim)

    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    # Through fp32, so any source dtype reaches the cache dtype by one rule
    # (and the interpreter never does arithmetic on raw bf16).
    k = k.to(tl.float32).to(k_cache_ptr.dtype.element_ty)
    v = v.to(tl.float32).to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd,
             k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd,
             v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton-lang twin of :func:`write_kv_ref`: one program per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        num_kv_heads, head_dim, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        HEADS=triton.next_power_of_2(num_kv_heads), DIM=triton.next_power_of_2(head_dim),
    )
