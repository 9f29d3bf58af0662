"""The launches the engine makes of each Triton-lang kernel, described without
a GPU for :mod:`pagedbackend.kernels.gpu_report` to compile ahead of time.

A :class:`Launch` names a kernel and gives every one of its arguments as the
engine passes it: a tensor as its dtype (``"*bf16"``), an integer or float as
a representative value (Triton specialises an integer equal to 1 into a
constant and one divisible by 16 into an alignment hint, so the value picks
the same binary a real launch gets), a constexpr as its value; ``options``
are ``num_warps`` / ``num_stages`` when the launch sets them.

Shapes follow the families the README lists, per tensor-parallel rank: 8 KV
heads (1 to 8 is covered by the padded group size and ``HEADS``), head dims
64 / 128 / 256, query groups 1-8, block sizes 16 and 32 (both give
``BLOCK_N`` 32 and a ``block_size`` divisible by 16: one binary), LoRA ranks
8-64, and the expert shapes of Mixtral, Qwen3-MoE and gpt-oss.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 4, 8)             # query heads per KV head, padded to a power of two
DTYPES = ("bf16", "fp16", "fp32")  # fp32: the engine's default dtype (fp32 tiles, IEEE dots)
KV_HEADS = 8
BLOCK_SIZE = 16
_NO_WINDOW = 1 << 30              # paged_attention's window for full attention (a runtime int)
_ROWS_PER_PROGRAM = 64            # paged_attention._MAX_ROWS: a prefill tile's query rows
LORA_RANKS = (8, 16, 32, 64)
# (family, hidden, expert intermediate, top-k, biases): one rank's experts.
MOE_SHAPES = (("mixtral", 4096, 14336, 2, False), ("qwen3_moe", 2048, 768, 8, False),
              ("gpt_oss", 2880, 2880, 4, True))
# fp8 KV caches: write_kv's saturation and rounding constants, and the oldest
# arch Triton converts the type on (e4m3 needs sm_89; sm_80 has e5m2).
FP8_KV = {"fp8e4nv": (dict(CLAMP=448.0, MANTISSA=3, MIN_EXP=-6), 89),
          "fp8e5": (dict(CLAMP=57344.0, MANTISSA=2, MIN_EXP=-14), 80)}
KV_DTYPES = ("bf16", "i8", *FP8_KV)   # kv_cache_dtype beside a bf16 / fp16 model


@dataclass
class Launch:
    """One launch of the kernel ``name`` of the module ``module`` (a dotted
    name, imported where the launch is compiled: descriptions stay cheap and
    picklable)."""
    module: str
    name: str
    args: Dict[str, Any]
    dtype: str
    shape: str = ""
    options: Dict[str, int] = field(default_factory=dict)
    min_arch: int = 0   # compiled for this arch and newer (the engine refuses it before)

    @property
    def label(self) -> str:
        return f"{self.module.rpartition('.')[2]}.{self.name}"

    def kernel(self):
        from importlib import import_module
        return getattr(import_module(self.module), self.name)


_PACKAGE = "pagedbackend.kernels"


def _contiguous(*shape: int) -> List[int]:
    """Strides of a contiguous tensor of ``shape``."""
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def _tensor(dtype: str) -> str:
    return f"*{dtype}"


def _cache(dim: int, dtype: str, kv: Optional[str]):
    """A KV cache's pointer type, its scales' and its row length: the model's
    ``dtype``, or ``kv`` ("bf16", an fp8 type, or "i8": rows of int8 values
    and float16 scales, ``kv_cache_dtype.py``)."""
    if kv == "i8":
        return "*i8", "*fp16", dim + dim // 8
    return _tensor(kv or dtype), _tensor(kv or dtype), dim


def paged_attention(dim: int, group: int, rows: int, dtype: str, sinks: bool,
                    block_n: Optional[int] = None, options: Optional[Dict[str, int]] = None,
                    kv: Optional[str] = None) -> Launch:
    """``paged_attention.paged_attention`` for ``group`` query heads per KV
    head and plan tiles of ``rows`` query rows (16: a decode batch; 64: a
    prefill), with the kernel's own ``tiling`` unless ``block_n`` and
    ``options`` replace it (``attention_sweep``); ``kv``: the cache's dtype
    when it is not the model's."""
    from pagedbackend.kernels.paged_attention import QUANT_OPTIONS, tiling
    if block_n is None:
        shape = tiling(dim, dtype != "fp32", kv not in (None, dtype))
        rows = min(rows, max(group, shape.max_rows))
        block_n, options = shape.block_n, {"num_warps": shape.num_warps, "num_stages": shape.num_stages}
    options = {**(options or {}), **(QUANT_OPTIONS if kv == "i8" else {})}
    heads = KV_HEADS * group
    q_strides = _contiguous(1024, heads, dim)
    cache, scales, row = _cache(dim, dtype, kv)
    cache_strides = _contiguous(4096, BLOCK_SIZE, KV_HEADS, row)
    t, i32 = _tensor(dtype), "*i32"
    args = dict(q_ptr=t, k_cache_ptr=cache, v_cache_ptr=cache, k_scale_ptr=scales, v_scale_ptr=scales,
                out_ptr=t, block_tables_ptr=i32,
                cu_seqlens_q_ptr=i32, seq_lens_ptr=i32, tile_seq_ptr=i32, tile_q_start_ptr=i32,
                sinks_ptr="*fp32" if sinks else i32,
                sm_scale_log2=0.5, head_dim=dim, block_size=BLOCK_SIZE, group=group, window=_NO_WINDOW)
    args.update(zip(("stride_qt", "stride_qh", "stride_qd"), q_strides))
    args.update(zip(("stride_ot", "stride_oh", "stride_od"), q_strides))
    args.update(zip(("stride_kb", "stride_ks", "stride_kh", "stride_kd"), cache_strides))
    args.update(zip(("stride_vb", "stride_vs", "stride_vh", "stride_vd"), cache_strides))
    args["stride_bts"] = 512
    args.update(BLOCK_Q=rows // group, GROUP_PAD=group, BLOCK_N=block_n, DIM=dim,
                LOWP_DOT=dtype != "fp32", HAS_SINKS=sinks, QUANT=kv == "i8")
    return Launch(f"{_PACKAGE}.paged_attention", "_paged_attention_kernel", args, dtype + (f"/kv {kv}" if kv else ""),
                  options=dict(options or {}), min_arch=FP8_KV.get(kv, (None, 0))[1])


def write_kv(dim: int, kv_heads: int, dtype: str, kv: Optional[str] = None) -> Launch:
    """``kv_write.write_kv``: one program per token, every KV head at once
    (``kv``: the cache's dtype when it is not the model's)."""
    t = _tensor(dtype)
    cache, scales, row = _cache(dim, dtype, kv)
    token_strides = _contiguous(1024, kv_heads, dim)
    cache_strides = _contiguous(4096, BLOCK_SIZE, kv_heads, row)
    args = dict(key_ptr=t, value_ptr=t, k_cache_ptr=cache, v_cache_ptr=cache, k_scale_ptr=scales,
                v_scale_ptr=scales, slot_ptr="*i64",
                num_kv_heads=kv_heads, head_dim=dim, block_size=BLOCK_SIZE)
    args.update(zip(("stride_kt", "stride_kh", "stride_kd"), token_strides))
    args.update(zip(("stride_vt", "stride_vh", "stride_vd"), token_strides))
    args.update(zip(("stride_kcb", "stride_kcs", "stride_kch", "stride_kcd"), cache_strides))
    args.update(zip(("stride_vcb", "stride_vcs", "stride_vch", "stride_vcd"), cache_strides))
    fp8, min_arch = FP8_KV.get(kv, (dict(CLAMP=0.0, MANTISSA=3, MIN_EXP=-6), 0))
    args.update(HEADS=kv_heads, DIM=dim, QUANT=kv == "i8", **fp8)
    return Launch(f"{_PACKAGE}.kv_write", "_write_kv_kernel", args, dtype + (f"/kv {kv}" if kv else ""),
                  min_arch=min_arch)


def lora_shrink(rank: int, dtype: str, in_features: int = 4096) -> Launch:
    """``lora.sgmv_triton``'s shrink into its float32 scratch."""
    block_r = max(16, 1 << (rank - 1).bit_length())
    t = _tensor(dtype)
    args = dict(x_ptr=t, a_ptr=t, s_ptr="*fp32", rows_ptr="*i32", pages_ptr="*i32", segs_ptr="*i32",
                in_features=in_features, stride_x=in_features, stride_a=in_features, stride_s=block_r,
                BLOCK_M=16, BLOCK_R=block_r, BLOCK_K=64)
    return Launch(f"{_PACKAGE}.lora", "_shrink_kernel", args, dtype)


def lora_expand(rank: int, dtype: str, out_features: int = 4096) -> Launch:
    """``lora.sgmv_triton``'s expand into a column slice of a fused projection."""
    block_r = max(16, 1 << (rank - 1).bit_length())
    t = _tensor(dtype)
    args = dict(s_ptr="*fp32", b_ptr=t, y_ptr=t, rows_ptr="*i32", pages_ptr="*i32", segs_ptr="*i32",
                out_features=out_features, stride_s=block_r, stride_b=out_features,
                stride_y=3 * out_features, BLOCK_M=16, BLOCK_R=block_r, BLOCK_N=64)
    return Launch(f"{_PACKAGE}.lora", "_expand_kernel", args, dtype)


def moe_gemm(family: str, hidden: int, inter: int, top_k: int, bias: bool, second: bool,
             dtype: str) -> Launch:
    """``fused_moe.grouped_gemm``: the gate/up GEMM (rows of ``x`` shared by
    ``top_k`` pairs) or the down GEMM (one row per pair, routing weight applied)."""
    n, k = (hidden, inter) if second else (2 * inter, hidden)
    t = _tensor(dtype)
    args = dict(a_ptr=t, b_ptr=t, bias_ptr=t, c_ptr=t, weight_ptr="*fp32" if second else t,
                pair_ptr="*i32", block_expert_ptr="*i32", num_rows_ptr="*i32",
                N=n, K=k, num_pairs=256 * top_k,
                stride_am=k, stride_ak=1, stride_be=n * k, stride_bn=k, stride_bk=1,
                stride_biase=n if bias else 0, stride_cm=n, stride_cn=1,
                A_ROW_DIV=1 if second else top_k, HAS_BIAS=bias, MUL_WEIGHT=second,
                BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, LOWP_DOT=dtype != "fp32")
    return Launch(f"{_PACKAGE}.fused_moe", "_grouped_gemm_kernel", args, dtype, family)


def all_launches() -> Iterator[Launch]:
    """The whole matrix (``make gpu-check``)."""
    for dim in HEAD_DIMS:
        for group in GROUPS:
            for rows in (16, _ROWS_PER_PROGRAM):
                for dtype in DTYPES:
                    for sinks in (False, True):
                        yield paged_attention(dim, group, rows, dtype, sinks)
                    for kv in KV_DTYPES if dtype != "fp32" else ():   # kv_cache_dtype (refused
                        yield paged_attention(dim, group, rows, dtype, False, kv=kv)   # beside fp32)
    for dim in HEAD_DIMS:
        for kv_heads in (1, 2, 4, 8):
            for dtype in DTYPES:
                yield write_kv(dim, kv_heads, dtype)
                for kv in KV_DTYPES[1:] if dtype != "fp32" else ():
                    yield write_kv(dim, kv_heads, dtype, kv=kv)
    for rank in LORA_RANKS[1:]:          # ranks 8 and 16 share BLOCK_R 16
        for dtype in DTYPES:
            yield lora_shrink(rank, dtype)
            yield lora_expand(rank, dtype)
    for family, hidden, inter, top_k, bias in MOE_SHAPES:
        for dtype in DTYPES:
            for second in (False, True):
                yield moe_gemm(family, hidden, inter, top_k, bias, second, dtype)


def quick_launches() -> Iterator[Launch]:
    """One launch per kernel (``make test``'s subset): the shapes of Llama-3-8B."""
    yield paged_attention(128, 4, 16, "bf16", False)
    yield paged_attention(128, 4, 16, "bf16", False, kv="i8")
    yield paged_attention(128, 4, 16, "bf16", False, kv="fp8e4nv")
    yield write_kv(128, 8, "bf16")
    yield write_kv(128, 8, "bf16", kv="i8")
    yield write_kv(128, 8, "bf16", kv="fp8e4nv")
    yield lora_shrink(16, "bf16")
    yield lora_expand(16, "bf16")
    yield moe_gemm(*MOE_SHAPES[0], False, "bf16")


def attention_sweep() -> Iterator[Launch]:
    """The attention kernel's tile and launch choices side by side (``--set
    sweep``): BLOCK_N, warps and pipeline stages per head dim, tile and dtype."""
    for dim in HEAD_DIMS:
        for rows in (16, _ROWS_PER_PROGRAM):
            for warps in (4, 8):
                for block_n in (32, 64):
                    for stages in (2, 3):
                        yield paged_attention(dim, 4, rows, "bf16", False, block_n,
                                              {"num_warps": warps, "num_stages": stages})
                for block_n in (16, 32):
                    yield paged_attention(dim, 4, rows, "fp32", False, block_n, {"num_warps": warps})


SETS: Dict[str, Callable[[], Iterator[Launch]]] = {"all": all_launches, "quick": quick_launches,
                                                    "sweep": attention_sweep}
