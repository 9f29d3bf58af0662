"""KV-cache memory accounting: how many token positions each allocation scheme
reserves for a set of sequences, and how many of them hold real token state.

The schemes (Orca Max / Pow2 / Oracle and paged allocation) and the per-token
KV size are defined once, in ``pagedbackend.core.kv_memory``.

Waste is split as in the paper's Sec. 3.1 and Fig. 2. *Internal
fragmentation* is the positions that are allocated but never written
(``allocated - effective`` once every request has finished).
*Reserved-but-unused* needs prompt lengths: the positions a request holds
right after its prompt is written that only later output tokens will fill; the
Orca schemes hold all of them from admission, paged allocation at most the
rest of the last prompt block. External fragmentation (holes left by a
contiguous allocator) is not modelled.

Sliding-window models (``--sliding-window N`` with ``--sliding-pattern
S:F``, or a ``--model-config`` whose layers have windows): the paged rows
add the bytes held when windowed layers give back the blocks that left their
window (KV groups, ``core.kv_groups``); every other figure is full
allocation, the paper's equation (2 x layers x KV heads x head size x bytes
per position).

CLI: ``python -m pagedbackend.accounting --lengths 37,91,128,201,511
--max-len 512 --block-sizes 16,32 [--preset opt-13b] [--json]``.
"""
import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from pagedbackend.core.kv_groups import kv_layout
from pagedbackend.core.kv_memory import (KVModel, check_block_size, check_positive_int,
                                         reserved_positions)

# Bytes per entry of a sequence's block table (an int32 physical block id).
BLOCK_TABLE_ENTRY_BYTES = 4

PRESETS = {
    # SmolLM2-135M: grouped-query attention, 3 KV heads.
    "smollm2-135m": {"layers": 30, "kv_heads": 3, "head_dim": 64},
    # OPT-13B: multi-head attention, 40 heads x 128 = 5120 hidden.
    "opt-13b": {"layers": 40, "kv_heads": 40, "head_dim": 128},
    # Gemma 3 4B (its text config): 34 layers, five of every six with a
    # 1,024-position sliding window, 4 KV heads of 256.
    "gemma3-4b": {"layers": 34, "kv_heads": 4, "head_dim": 256, "sliding_window": 1024,
                  "sliding_pattern": (5, 1)},
}


@dataclass(frozen=True)
class SchemeReport:
    """Positions (and optionally bytes) one scheme allocates for a workload."""

    scheme: str                 # "max", "pow2", "oracle" or "paged"
    label: str                  # human-readable name for tables
    block_size: Optional[int]   # paged only
    allocated: int              # positions reserved, summed over sequences
    effective: int              # positions holding token state (sum of lengths)
    utilisation: float          # effective / allocated
    internal_fragmentation: int  # allocated - effective: never written
    reserved_unused: Optional[int]  # held at admission for future tokens; None without prompt lengths
    num_blocks: Optional[int] = None          # paged only: blocks over all sequences
    allocated_bytes: Optional[int] = None     # KV bytes (+ block tables for paged)
    effective_bytes: Optional[int] = None
    block_table_bytes: Optional[int] = None   # paged only
    # paged, a model with sliding windows: KV bytes (and block tables, one per
    # KV group) when windowed layers give back blocks that left their window
    windowed_bytes: Optional[int] = None


def _admission_reserved(scheme: str, length: int, prompt_len: int,
                        block_size: Optional[int]) -> int:
    """Positions held right after the prompt is written that output will fill."""
    if scheme != "paged":
        return length - prompt_len  # the whole reservation exists from admission on
    held = math.ceil(prompt_len / block_size) * block_size
    return min(held, length) - prompt_len


def _label(scheme: str, max_len: int, block_size: Optional[int]) -> str:
    return {
        "max": f"Orca (Max), fixed {max_len}",
        "pow2": "Orca (Pow2)",
        "oracle": "Orca (Oracle)",
        "paged": f"Paged, {block_size}-position pages",
    }[scheme]


def _validate_lengths(lengths: Sequence[int], max_len: int,
                      prompt_lengths: Optional[Sequence[int]]) -> None:
    check_positive_int("max_len", max_len)
    if len(lengths) == 0:
        raise ValueError("lengths is empty: give at least one sequence length")
    for n in lengths:
        check_positive_int("length", n)
        if n > max_len:
            raise ValueError(f"length {n} exceeds max_len {max_len}")
    if prompt_lengths is not None:
        if len(prompt_lengths) != len(lengths):
            raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(lengths)} lengths")
        for p, n in zip(prompt_lengths, lengths):
            check_positive_int("prompt length", p)
            if p > n:
                raise ValueError(f"prompt length {p} exceeds its final length {n}")


def scheme_report(scheme: str, lengths: Sequence[int], max_len: int,
                  block_size: Optional[int] = None,
                  prompt_lengths: Optional[Sequence[int]] = None,
                  model: Optional[KVModel] = None) -> SchemeReport:
    """Account one scheme over all sequences."""
    _validate_lengths(lengths, max_len, prompt_lengths)
    if scheme == "paged":
        if block_size is None:
            raise ValueError("the paged scheme needs a block_size")
        check_block_size(block_size)
    else:
        block_size = None
    allocated = sum(reserved_positions(scheme, int(n), max_len, block_size) for n in lengths)
    effective = int(sum(lengths))
    reserved = None
    if prompt_lengths is not None:
        reserved = sum(_admission_reserved(scheme, n, p, block_size)
                       for n, p in zip(lengths, prompt_lengths))
    num_blocks = allocated // block_size if block_size else None
    allocated_bytes = effective_bytes = table_bytes = windowed = None
    if model is not None:
        table_bytes = num_blocks * BLOCK_TABLE_ENTRY_BYTES if block_size else None
        allocated_bytes = allocated * model.kv_bytes_per_token + (table_bytes or 0)
        effective_bytes = effective * model.kv_bytes_per_token
        if block_size and model.layer_windows:
            groups = len(kv_layout(model.layer_windows).groups)
            windowed = sum(model.windowed_blocks(int(n), block_size) for n in lengths) \
                * model.windowed_block_bytes(block_size) + groups * (table_bytes or 0)
    return SchemeReport(
        scheme=scheme, label=_label(scheme, max_len, block_size), block_size=block_size,
        allocated=allocated, effective=effective, utilisation=effective / allocated,
        internal_fragmentation=allocated - effective, reserved_unused=reserved,
        num_blocks=num_blocks, allocated_bytes=allocated_bytes,
        effective_bytes=effective_bytes, block_table_bytes=table_bytes, windowed_bytes=windowed)


def utilisation_report(lengths: Sequence[int], max_len: int,
                       block_sizes: Sequence[int] = (16,),
                       prompt_lengths: Optional[Sequence[int]] = None,
                       model: Optional[KVModel] = None) -> list[SchemeReport]:
    """One report per scheme: Max, Pow2, Oracle, then paged per block size."""
    for bs in block_sizes:
        check_block_size(bs)
    reports = [scheme_report(s, lengths, max_len, None, prompt_lengths, model)
               for s in ("max", "pow2", "oracle")]
    reports += [scheme_report("paged", lengths, max_len, bs, prompt_lengths, model)
                for bs in block_sizes]
    return reports


def model_from_config(path: str, dtype_bytes: int = 2) -> KVModel:
    """Read a Hugging Face ``config.json`` (a file or the folder holding it)."""
    if not path.endswith(".json"):
        path = path.rstrip("/") + "/config.json"
    with open(path) as f:
        cfg = json.load(f)
    try:
        layers = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    except KeyError as missing:
        raise ValueError(f"{path}: model config lacks {missing}") from None
    from pagedbackend.models.llama import sliding_windows   # as the engine reads them
    windows = tuple(sliding_windows(cfg))
    return KVModel(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
                   layer_windows=windows if any(windows) else ())


# ---------------------------------------------------------------- CLI

def _parse_int_list(name: str, text: str) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{name} is empty: give a comma-separated list of integers")
    values = []
    for t in items:
        try:
            values.append(int(t))
        except ValueError:
            raise ValueError(f"{name}: {t!r} is not an integer") from None
    return values


def format_bytes(n: int) -> str:
    """``819200`` -> ``'819,200 B (800 KB)'``; binary units, trailing zeros dropped."""
    if n < 1024:
        return f"{n:,} B"
    value, unit = float(n), "B"
    for next_name in ("KB", "MB", "GB", "TB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_name
    return f"{n:,} B ({value:.2f}".rstrip("0").rstrip(".") + f" {unit})"


def format_table(reports: list[SchemeReport], model: Optional[KVModel] = None) -> str:
    """The reports as an aligned text table, preceded by the effective total."""
    r0 = reports[0]
    lines = [f"effective: {r0.effective} positions (token state really stored)"]
    header = ["scheme", "allocated", "utilisation", "internal frag"]
    with_reserved = r0.reserved_unused is not None
    if with_reserved:
        header.append("reserved at admission")
    windowed = any(r.windowed_bytes is not None for r in reports)
    if model is not None:
        header += ["allocated bytes", "block-table bytes"]
        if windowed:
            header.append("bytes, windows freed")
    rows = []
    for r in reports:
        row = [r.label, str(r.allocated), f"{100 * r.utilisation:.2f} %",
               str(r.internal_fragmentation)]
        if with_reserved:
            row.append(str(r.reserved_unused))
        if model is not None:
            row += [format_bytes(r.allocated_bytes),
                    "-" if r.block_table_bytes is None else f"{r.block_table_bytes:,} B"]
            if windowed:
                row.append("-" if r.windowed_bytes is None else format_bytes(r.windowed_bytes))
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def fmt(row):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join(cells).rstrip()

    lines += ["", fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    if model is not None:
        lines += [
            "",
            f"model: {model.layers} layers, {model.kv_heads} KV heads, head_dim "
            f"{model.head_dim}, {model.dtype_bytes} B per element",
            f"KV bytes per token: 2 x {model.layers} x {model.kv_heads} x {model.head_dim}"
            f" x {model.dtype_bytes} = {format_bytes(model.kv_bytes_per_token)}",
            f"effective KV bytes: {format_bytes(r0.effective_bytes)}",
        ]
        if windowed:
            kinds = sorted({w for w in model.layer_windows if w is not None})
            sliding = sum(1 for w in model.layer_windows if w is not None)
            groups = kv_layout(model.layer_windows).groups
            lines.append(f"sliding windows: {sliding} of {model.layers} layers (window "
                         f"{', '.join(map(str, kinds))}), {len(groups)} KV groups of "
                         f"{max(len(g.layers) for g in groups)} layers per block")
        for r in reports:
            if r.block_size:
                lines.append(f"KV bytes per {r.block_size}-position block: "
                             f"{format_bytes(model.kv_bytes_per_block(r.block_size))}")
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pagedbackend.accounting",
        description="Allocated vs effective KV-cache positions per allocation scheme.")
    p.add_argument("--lengths", required=True,
                   help="final sequence lengths (prompt + output), comma-separated")
    p.add_argument("--prompt-lengths",
                   help="prompt lengths, same order; adds the reserved-at-admission column")
    p.add_argument("--max-len", type=int, required=True, help="longest sequence a request may reach")
    p.add_argument("--block-sizes", default="16", help="paged block sizes, comma-separated powers of two")
    model = p.add_argument_group("model (optional; adds bytes)")
    src = model.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--model-config", help="a Hugging Face config.json or its folder")
    model.add_argument("--layers", type=int)
    model.add_argument("--kv-heads", type=int)
    model.add_argument("--head-dim", type=int)
    model.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element (default 2, fp16)")
    model.add_argument("--sliding-window", type=int,
                       help="sliding window of the windowed layers, in positions (adds the paged bytes "
                            "when their out-of-window blocks go back to the pool)")
    model.add_argument("--sliding-pattern", help="S:F, layers repeat S windowed then F full "
                                                 "(e.g. 5:1 for Gemma 3); default every layer windowed")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _model_from_args(args) -> Optional[KVModel]:
    dims = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    base, windows = {}, ()
    if args.preset:
        base = dict(PRESETS[args.preset])
    elif args.model_config:
        m = model_from_config(args.model_config)
        base, windows = {"layers": m.layers, "kv_heads": m.kv_heads, "head_dim": m.head_dim}, m.layer_windows
    base.update({k: v for k, v in dims.items() if v is not None})  # flags override
    if args.sliding_window is not None:
        base["sliding_window"] = args.sliding_window
    if args.sliding_pattern is not None:
        base["sliding_pattern"] = _parse_pattern(args.sliding_pattern)
    window, pattern = base.pop("sliding_window", None), base.pop("sliding_pattern", None)
    if not base and window is None:
        return None
    missing = [f"--{k.replace('_', '-')}" for k in ("layers", "kv_heads", "head_dim") if k not in base]
    if missing:
        raise ValueError(f"incomplete model: also give {', '.join(missing)} (or --preset / --model-config)")
    for k, v in {**base, "dtype_bytes": args.dtype_bytes}.items():
        check_positive_int(k.replace("_", "-"), v)
    if window is not None:
        check_positive_int("sliding-window", window)
        windowed, full = pattern or (1, 0)
        windows = tuple(window if i % (windowed + full) < windowed else None for i in range(base["layers"]))
    elif pattern is not None:
        raise ValueError("--sliding-pattern needs --sliding-window")
    return KVModel(dtype_bytes=args.dtype_bytes, layer_windows=windows if any(windows) else (), **base)


def _parse_pattern(text: str):
    """``"5:1"`` -> ``(5, 1)``: windowed layers, then full-attention layers, repeated."""
    parts = text.split(":")
    try:
        windowed, full = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--sliding-pattern: {text!r} is not S:F (two integers, e.g. 5:1)") from None
    if windowed < 1 or full < 0:
        raise ValueError(f"--sliding-pattern: {text!r} needs S >= 1 windowed and F >= 0 full layers")
    return windowed, full


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        lengths = _parse_int_list("--lengths", args.lengths)
        prompts = (_parse_int_list("--prompt-lengths", args.prompt_lengths)
                   if args.prompt_lengths is not None else None)
        block_sizes = _parse_int_list("--block-sizes", args.block_sizes)
        model = _model_from_args(args)
        reports = utilisation_report(lengths, args.max_len, block_sizes, prompts, model)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    if args.json:
        doc = {"lengths": lengths, "prompt_lengths": prompts, "max_len": args.max_len,
               "block_sizes": block_sizes, "effective": reports[0].effective,
               "schemes": [asdict(r) for r in reports]}
        if model is not None:
            doc["model"] = {**asdict(model), "kv_bytes_per_token": model.kv_bytes_per_token,
                            "kv_groups": len(kv_layout(model.layer_windows or [None] * model.layers).groups),
                            "kv_bytes_per_block": {str(bs): model.kv_bytes_per_block(bs)
                                                   for bs in block_sizes}}
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(reports, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
