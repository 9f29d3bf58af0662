"""Figures for the benchmarks: matplotlib on the Agg backend (no display), one
PNG next to each result's JSON."""
import pathlib
from typing import Dict, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SYNTHETIC_NOTE = "synthetic seeded workloads (loadtest/workloads.py), not the real traces"


def figure(ncols: int = 1, width: float = 6.4, height: float = 4.0):
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def grouped_bars(ax, categories: Sequence[str], series: Dict[str, Sequence[float]],
                 ylabel: str = "", percent: bool = False, annotate: bool = True) -> None:
    """One group of bars per category, one bar per series."""
    n = max(len(series), 1)
    width = 0.8 / n
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(categories))]
        shown = [100 * v if percent else v for v in values]
        bars = ax.bar(xs, shown, width, label=label)
        if annotate:
            for bar, v in zip(bars, shown):
                ax.annotate(f"{v:.0f}" if percent else f"{v:.3g}",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel + (" (%)" if percent else ""))
    if percent:
        ax.set_ylim(0, 110)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def lines(ax, series: Dict[str, tuple], xlabel: str, ylabel: str, logy: bool = False,
          hline: Optional[float] = None, hline_label: str = "") -> None:
    """``series``: label -> (xs, ys)."""
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=hline_label)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def save(fig, out_dir: str, name: str, title: str = "", note: str = SYNTHETIC_NOTE) -> pathlib.Path:
    """Write ``out_dir/name.png`` with a title and a footnote saying what the data are."""
    if title:
        fig.suptitle(title, fontsize=11)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="grey")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = pathlib.Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"{name}.png"
    fig.savefig(target, dpi=90)
    plt.close(fig)
    return target
