"""Shared drawing for the benchmark scripts (matplotlib, Agg: files only)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen


def ratio_bars(ax, names: list[str], values: list[float], base: float, label: str) -> None:
    """One bar per name, each labelled with its value over ``base`` ("4.05x")."""
    bars = ax.bar(names, values, color="#4c72b0")
    for bar, value in zip(bars, values):
        ax.annotate(f"{value / base:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylabel(label)
    ax.tick_params(axis="x", labelrotation=15, labelsize=8)


def save(fig, path, title: str) -> None:
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


subplots = plt.subplots
