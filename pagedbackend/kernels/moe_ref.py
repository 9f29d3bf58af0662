"""The torch reference of the mixture-of-experts feed-forward (the semantics
every expert kernel follows are in ``fused_moe``'s docstring): a loop over the
experts a step uses, as Hugging Face's expert modules compute it. Plain torch,
no Triton, so importing it stays cheap."""
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "swigluoai")


def activate(h: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``[rows, 2I]`` gate/up projections -> ``[rows, I]``: ``silu(gate) * up``, or
    gpt-oss's ``swigluoai`` (gate clamped above at ``limit``, up to ``[-limit,
    limit]``, then ``gate * sigmoid(alpha * gate) * (up + 1)``)."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swigluoai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)
    raise ValueError(f"unknown expert activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")


def fused_experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, b13: Optional[torch.Tensor] = None,
                        b2: Optional[torch.Tensor] = None, activation: str = "silu",
                        alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The reference: each active expert, in ascending order, multiplies the
    rows routed to it (as Hugging Face's experts do); slots sum into ``out``."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = F.linear(rows, w13[e], None if b13 is None else b13[e])
        return F.linear(activate(h, activation, alpha, limit), w2[e], None if b2 is None else b2[e])
    return each_expert(x, ids, weights, w13.shape[0], expert)


def each_expert(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: int,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``sum_k weights[t, k] * expert(ids[t, k], x[t])`` for every token ``t``:
    ``expert(e, rows)`` runs once per active expert ``e`` (ascending) on the
    rows routed to it; ids outside ``[0, experts)`` are skipped."""
    out = torch.zeros_like(x)
    flat = ids.reshape(-1).long()
    hit = torch.unique(flat[(flat >= 0) & (flat < experts)]).tolist()
    k = ids.shape[1]
    for e in hit:
        pairs = torch.nonzero(flat == e).squeeze(1)
        tokens = pairs // k
        y = expert(e, x[tokens]) * weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
