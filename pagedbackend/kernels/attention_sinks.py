"""Attention sinks (gpt-oss): a learned logit per head that joins every
query's softmax as one more column with no value row, so it takes a share
of the weight and gives nothing back. The torch pieces the attention paths
share; the Triton-lang kernel and the C decode kernel add the sink in their
own softmax."""
from typing import Optional

import torch


def sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                    scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """One chunk's attention (``q`` ``[rows, heads, dim]``, ``k``/``v``
    ``[keys, kv_heads, dim]``, ``mask`` ``[rows, keys]`` or None: causal) with
    a sink logit per head: SDPA's output, which
    divides by ``L = sum(exp(scores))``, times ``L / (L + exp(sink))`` =
    ``sigmoid(lse - sink)``, with the log-sum-exp from the same flash kernel
    (CPU); elsewhere the scores are formed in full, the sink a last column."""
    group = q.shape[1] // k.shape[1]
    kh, vh = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, kh, vh))   # [1, heads, rows, dim]
    if q.device.type == "cpu":
        bias = None
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=qh.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, mask is None, attn_mask=bias, scale=scale)
        o = o.float() * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None]
        return o[0].transpose(0, 1).to(q.dtype)
    scores = torch.einsum("bhqd,bhkd->bhqk", qh.float(), kh.float()) * scale
    if mask is None:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril_()
    scores.masked_fill_(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, sinks.float()[None, :, None, None])
    return torch.einsum("bhqk,bhkd->bhqd", probs, vh.float())[0].transpose(0, 1).to(q.dtype)


def softmax_with_sinks(scores: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax over the last dimension of ``scores`` with ``sinks`` (broadcast
    to ``scores[..., :1]``) as one more logit whose weight is dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    both = torch.cat((scores, sinks.expand(*scores.shape[:-1], 1).to(scores.dtype)), dim=-1)
    return torch.softmax(both, dim=-1)[..., :-1]
