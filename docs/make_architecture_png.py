"""Draw ``docs/architecture.png``: the data flow of one speculation round.

    python docs/make_architecture_png.py

Boxes are the library's stages, arrows the records they hand on. Kept as code (not a
binary made by hand) so the picture changes with the design.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parent / "architecture.png"

#: name -> (x, y, subtitle, colour); x, y are box centres in axis units.
BOXES: dict[str, tuple[float, float, str, str]] = {
    "SublayerEngine": (
        1.6,
        3.0,
        "model/engine.py\n2L items, KV cache,\nrun_item / run_masks",
        "#dbe9f6",
    ),
    "CostModel": (
        5.6,
        4.8,
        "costmodels/\nt_attn(n), t_mlp, t_verify(k)\nobserve() calibrates",
        "#fde9d9",
    ),
    "ValueProxy": (
        5.6,
        1.2,
        "proxies/\nscore (cosine), α estimate\n(Monte-Carlo, Lemma 4.1)",
        "#fde9d9",
    ),
    "Planner": (
        9.6,
        3.0,
        "planners/\nplan(context) -> DraftPlan\nupdate(StepOutcome), reset()",
        "#e2f0d9",
    ),
    "SpeculativeDecoder": (
        13.6,
        3.0,
        "decoding/decoder.py\ndraft, verify, commit,\ncrop the cache",
        "#fff2cc",
    ),
    "GenerationStats / bench": (
        13.6,
        0.5,
        "decoding/stats.py, bench/\nα, τ, tokens/s, time split;\nraw JSONL, report, plots",
        "#eeeeee",
    ),
}

WIDTH, HEIGHT = 2.9, 1.25
_HALF_W, _HALF_H = WIDTH / 2, HEIGHT / 2

#: (start point, end point, label, label position, curvature)
ARROWS: list[tuple[tuple[float, float], tuple[float, float], str, tuple[float, float], float]] = [
    ((2.4, 3.0 + _HALF_H), (5.6 - _HALF_W, 4.6), "profile:\nlatencies", (3.1, 4.35), 0.0),
    ((2.4, 3.0 - _HALF_H), (5.6 - _HALF_W, 1.4), "window states,\nLM head", (3.1, 1.65), 0.0),
    ((5.6 + _HALF_W, 4.6), (8.8, 3.0 + _HALF_H), "weights, costs", (8.2, 4.45), 0.0),
    ((5.6 + _HALF_W, 1.4), (8.8, 3.0 - _HALF_H), "scores, α", (8.2, 1.55), 0.0),
    ((9.6 + _HALF_W, 3.25), (13.6 - _HALF_W, 3.25), "DraftPlan (S, γ)", (11.6, 3.55), 0.0),
    ((13.6 - _HALF_W, 2.75), (9.6 + _HALF_W, 2.75), "StepOutcome", (11.6, 2.45), 0.0),
    (
        (13.6, 3.0 + _HALF_H),
        (5.6 + _HALF_W, 5.0),
        "LatencyObservation (measured step times)",
        (10.4, 5.35),
        0.12,
    ),
    ((13.6, 3.0 - _HALF_H), (13.6, 0.5 + _HALF_H), "GenerationResult", (12.5, 1.5), 0.0),
]


def draw(path: Path = OUT) -> Path:
    """Render the diagram to ``path`` (PNG) and return the path."""
    figure, axes = plt.subplots(figsize=(15, 6.2))
    axes.set_xlim(0, 15.2)
    axes.set_ylim(-0.3, 5.8)
    axes.axis("off")
    for name, (x, y, subtitle, colour) in BOXES.items():
        box = FancyBboxPatch(
            (x - WIDTH / 2, y - HEIGHT / 2),
            WIDTH,
            HEIGHT,
            boxstyle="round,pad=0.04,rounding_size=0.12",
            facecolor=colour,
            edgecolor="#444444",
        )
        axes.add_patch(box)
        axes.text(x, y + 0.36, name, ha="center", va="center", fontsize=11, weight="bold")
        axes.text(x, y - 0.16, subtitle, ha="center", va="center", fontsize=8.2)
    for start, end, label, where, curvature in ARROWS:
        arrow = FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=14,
            connectionstyle=f"arc3,rad={curvature}",
            color="#333333",
            linewidth=1.3,
        )
        axes.add_patch(arrow)
        axes.text(
            *where,
            label,
            ha="center",
            va="center",
            fontsize=8,
            style="italic",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
        )
    axes.set_title(
        "knapspec: data flows one way (engine -> cost model, proxy -> planner -> decoder -> "
        "stats / bench); feedback returns as small records",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    print(f"wrote {draw()}")
