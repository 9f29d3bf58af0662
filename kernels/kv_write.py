"""Scatter new tokens' K and V into their slots of a paged per-layer cache.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V.
A token's slot is ``physical_block * block_size + offset``; a negative slot
means "do not store" (a padding token).
"""
import torch


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
