"""Linear layers ready for a tensor-parallel split (Megatron style).

A column-parallel layer keeps a slice of the output features on each rank (no
communication); a row-parallel layer keeps a slice of the input features and
sums the partial outputs across ranks through ``reduce``. An attention or MLP
block is column -> local work -> row, so it needs one reduction. With
``tp_size == 1`` every slice is the whole tensor and ``reduce`` is the identity.
Each layer loads the full Hugging Face tensor and copies only its rank's part.
"""
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Reduce = Callable[[torch.Tensor], torch.Tensor]


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the default process group (the row-parallel reduction)."""
    torch.distributed.all_reduce(x)
    return x


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def even_split(size: int, tp_rank: int, tp_size: int, what: str) -> Tuple[int, int]:
    """(start, length) of ``tp_rank``'s equal part of ``size`` items."""
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({tp_size})")
    length = size // tp_size
    return tp_rank * length, length


def _empty(*shape: int, dtype: Optional[torch.dtype]) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _copy_checked(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(source.shape)} does not fit "
                         f"a parameter slice of shape {tuple(target.shape)}")
    target.copy_(source)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split across ranks.

    Several Hugging Face projections that read the same input (q/k/v, gate/up)
    can share one matmul: ``output_sizes`` lists their full sizes, and
    ``load(shard, name, tensor)`` fills shard ``shard`` from its full tensor.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.full_sizes = list(output_sizes)
        # Per shard: (start, length) of this rank's part of the full HF tensor.
        self.rank_slices: List[Tuple[int, int]] = [self.rank_slice(i, size)
                                              for i, size in enumerate(output_sizes)]
        self.output_sizes_per_rank = [length for _, length in self.rank_slices]
        self.offsets = [sum(self.output_sizes_per_rank[:i]) for i in range(len(output_sizes))]
        rows = sum(self.output_sizes_per_rank)
        self.weight = _empty(rows, in_features, dtype=dtype)
        self.bias = _empty(rows, dtype=dtype) if bias else None
        self.matmul: Optional[nn.Module] = None   # set by use_matmul()

    def rank_slice(self, shard: int, full_size: int) -> Tuple[int, int]:
        return even_split(full_size, self.tp_rank, self.tp_size, f"output size of shard {shard}")

    @torch.no_grad()
    def load(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        start, length = self.rank_slices[shard]
        target = getattr(self, name)
        if target is None:
            raise ValueError(f"checkpoint has a {name} this layer was built without")
        if tensor.shape[0] != self.full_sizes[shard]:
            raise ValueError(f"checkpoint {name} has {tensor.shape[0]} output rows, "
                             f"expected {self.full_sizes[shard]}")
        _copy_checked(target.narrow(0, self.offsets[shard], length), tensor.narrow(0, start, length))

    def use_matmul(self, module: nn.Module) -> None:
        """Serve ``x W^T`` through ``module`` (weight-only quantised or packed,
        holding its own copy of the weight) and drop the float weight."""
        self.matmul, self.weight = module, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is None:
            return F.linear(x, self.weight, self.bias)
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q/k/v projection split by attention heads.

    Each rank takes whole KV heads with the query heads that read them (see
    ``kv_heads_of_rank``), so every rank runs ordinary GQA on its share.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 dtype: Optional[torch.dtype] = None):
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, tp_rank, tp_size, dtype)
        self.num_heads = self.rank_slices[0][1] // head_dim
        self.num_kv_heads = self.rank_slices[1][1] // head_dim

    def rank_slice(self, shard: int, full_size: int) -> Tuple[int, int]:
        if shard == 0:
            start, heads = query_heads_of_rank(self.total_heads, self.total_kv_heads,
                                               self.tp_rank, self.tp_size)
        else:
            start, heads = kv_heads_of_rank(self.total_kv_heads, self.tp_rank, self.tp_size)
        return start * self.head_dim, heads * self.head_dim


def kv_heads_of_rank(num_kv_heads: int, tp_rank: int, tp_size: int) -> Tuple[int, int]:
    """(first KV head, KV head count) held by ``tp_rank``.

    With at least as many KV heads as ranks, each rank holds whole KV heads, as
    evenly as they divide: when ``tp_size`` does not divide ``num_kv_heads`` the
    first ``num_kv_heads % tp_size`` ranks hold one more (9 query / 3 KV heads on
    2 ranks: 6 / 2 on rank 0, 3 / 1 on rank 1), so rank 0 holds the largest KV
    share. With fewer KV heads than ranks, each KV head is replicated on
    ``tp_size / num_kv_heads`` consecutive ranks, which split its query heads.
    """
    if num_kv_heads >= tp_size:
        base, extra = divmod(num_kv_heads, tp_size)
        return tp_rank * base + min(tp_rank, extra), base + (tp_rank < extra)
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp_size}) exceeds num_key_value_heads "
                         f"({num_kv_heads}) and is not a multiple of it")
    return tp_rank // (tp_size // num_kv_heads), 1


def query_heads_of_rank(num_heads: int, num_kv_heads: int, tp_rank: int,
                        tp_size: int) -> Tuple[int, int]:
    """(first query head, query head count) of ``tp_rank``: the query heads of its KV heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of "
                         f"num_key_value_heads ({num_kv_heads})")
    if num_kv_heads >= tp_size:
        group = num_heads // num_kv_heads
        start, count = kv_heads_of_rank(num_kv_heads, tp_rank, tp_size)
        return start * group, count * group
    return even_split(num_heads, tp_rank, tp_size, "num_attention_heads")


class RowParallelLinear(nn.Module):
    """``y = reduce(x_rank W_rank^T) + b`` with W's input columns split across ranks.

    The bias is added once, after the reduction. ``in_slice`` (start, length)
    overrides the even split of the input features (attention heads split
    unevenly, see ``kv_heads_of_rank``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, reduce: Optional[Reduce] = None,
                 dtype: Optional[torch.dtype] = None,
                 in_slice: Optional[Tuple[int, int]] = None):
        super().__init__()
        self.in_features = in_features
        self.in_start, in_per_rank = in_slice or even_split(in_features, tp_rank, tp_size, "input size")
        self.reduce = reduce or (_identity if tp_size == 1 else all_reduce_sum)
        self.weight = _empty(out_features, in_per_rank, dtype=dtype)
        self.bias = _empty(out_features, dtype=dtype) if bias else None
        self.matmul: Optional[nn.Module] = None   # set by use_matmul()

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        if name == "weight":
            if tensor.dim() != 2 or tensor.shape[1] != self.in_features:
                raise ValueError(f"checkpoint weight of shape {tuple(tensor.shape)} does not have "
                                 f"{self.in_features} input columns")
            tensor = tensor.narrow(1, self.in_start, self.weight.shape[1])
        target = getattr(self, name)
        if target is None:
            raise ValueError(f"checkpoint has a {name} this layer was built without")
        _copy_checked(target, tensor)

    use_matmul = ColumnParallelLinear.use_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.matmul is None else self.matmul(x)
        y = self.reduce(y)
        return y if self.bias is None else y + self.bias
