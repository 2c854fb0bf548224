"""Plots of one run (matplotlib, Agg backend): speedup against context, the masks
KnapSpec chose, and the verification cost curves v(k)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from knapspec.bench.report.stats import MethodRow, RunData

SPEEDUP_PLOT = "speedup_vs_context.png"
MASKS_PLOT = "knapspec_masks.png"
VK_PLOT = "vk_curves.png"


def plot_speedup(data: RunData, rows: Sequence[MethodRow], path: Path) -> None:
    """Speedup vs AR against context, one panel per scenario, the oracle as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(row.scenario for row in rows))
    figure, axes = plt.subplots(
        1, len(scenarios), figsize=(4.5 * len(scenarios), 3.8), squeeze=False
    )
    for axis, scenario in zip(axes[0], scenarios, strict=True):
        mine = [row for row in rows if row.scenario == scenario]
        for method in dict.fromkeys(row.method for row in mine):
            points = sorted(
                (row.context_length, row.speedup_vs_ar)
                for row in mine
                if row.method == method and row.speedup_vs_ar is not None
            )
            xs = [x for x, _ in points]
            medians = [s.median for _, s in points if s is not None]
            low = [s.median - s.low for _, s in points if s is not None]
            high = [s.high - s.median for _, s in points if s is not None]
            axis.errorbar(xs, medians, yerr=[low, high], marker="o", capsize=3, label=method)
        oracle = sorted(
            (line["context_length"], line["speedup"])
            for line in data.oracle
            if line["scenario"] == scenario
        )
        if oracle:
            axis.plot(*zip(*oracle, strict=True), "k--", marker="x", label="oracle")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(scenario)
        axis.set_xlabel("prompt tokens")
        axis.set_ylabel("speedup vs AR (engine)")
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_masks(data: RunData, path: Path, method: str = "knapspec") -> bool:
    """The skipped attention / MLP items and γ KnapSpec chose, against context length."""
    plans = [plan for row in data.raw if row["method"] == method for plan in row.get("plans", [])]
    if not plans:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.8))
    xs = [plan["context_length"] for plan in plans]
    axis.scatter(xs, [p["skipped_attention"] for p in plans], label="skipped attention", s=12)
    axis.scatter(xs, [p["skipped_mlp"] for p in plans], label="skipped MLP", s=12, marker="s")
    axis.scatter(xs, [p["draft_length"] for p in plans], label="γ", s=12, marker="^")
    axis.set_xlabel("context length at planning time")
    axis.set_ylabel("count")
    axis.set_title(f"plans chosen by {method}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def plot_vcurves(data: RunData, path: Path) -> bool:
    """v(k) at each measured context, engine (solid) and HF DynamicCache (dashed)."""
    if not data.vcurve:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.8))
    colours: dict[int, Any] = {}
    for line in sorted(data.vcurve, key=lambda item: item["context_length"]):
        length = line["context_length"]
        style = {"engine": "-", "engine-f.linear": ":"}.get(line["backend"], "--")
        kwargs: dict[str, Any] = {"color": colours[length]} if length in colours else {}
        (handle,) = axis.plot(
            line["k"],
            line["ratio"],
            style,
            marker="o",
            markersize=3,
            label=f"n={length} {line['backend']}",
            **kwargs,
        )
        colours[length] = handle.get_color()
    axis.set_xlabel("k (tokens verified in one step)")
    axis.set_ylabel("v(k) = t(k) / t(1)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


__all__ = ["MASKS_PLOT", "SPEEDUP_PLOT", "VK_PLOT", "plot_masks", "plot_speedup", "plot_vcurves"]
