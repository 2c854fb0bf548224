"""How often the hidden-state knapsack DP finds the brute-force optimum, on tiny random models.

With the hidden-state (mean cosine) value the DP of :func:`knapspec.planners.dp.hidden_state_dp`
is a per-state heuristic (docs/theory.md, "What the DP guarantees"). This benchmark measures
how good the heuristic is where brute force is affordable (``2L <= 12`` items): for random
instances (tiny random Llama and Qwen3 models, :func:`knapspec.testing.tiny_model`, the
models the DP tests run on; several model seeds, random integer item weights in ``[1, 4]``,
random windows, the half-budget bound) it
enumerates every mask of skipped weight ``<= max_budget``, scores all of them with the same
score function on the same teacher-forced window, and compares, for every budget ``b``, the
DP's mask for ``b`` with the best mask of skipped weight exactly ``b``.

Each instance is run without pruning (``min_score=None``) and with the default τ = 0.5.
With pruning, the oracle for ``b`` is the best mask of weight ``b`` whose final score is
``>= τ`` (a budget with no such mask is not a pair), and a budget the DP lost to pruning of
an intermediate state counts as a miss.

The tiny models come in two variants: as built (``output_scale = 1``) and with every
sublayer's output projection (``o_proj``, ``down_proj``) scaled by 8, which makes each
sublayer move the residual stream more (intermediate states then fall below τ, so the
pruning run differs from the unpruned one).

Writes ``results/planning/dp_match_rate.json`` (settings, versions, per-instance rows and
the summaries) and prints a table. Usage (about two minutes on one core)::

    taskset -c 1 .venv/bin/python benchmarks/dp_match_rate.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import transformers

from knapspec.bench.env import git_commit
from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.planners.dp import (
    ScoreFn,
    half_budget,
    hidden_state_dp,
    mean_cosine,
    single_items,
)
from knapspec.testing import random_window, tiny_model
from knapspec.types import SublayerMask
from knapspec.window import ReferenceWindow

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "planning" / "dp_match_rate.json"
#: A DP score within this of the brute-force best counts as a match.
TOLERANCE = 1e-6
TAU = 0.5
Flags = tuple[bool, ...]


# ------------------------------------------------------------------------- instances
@attrs.frozen
class Instance:
    """One random DP instance: a tiny model, item weights and a reference window."""

    family: str
    num_layers: int
    model_seed: int
    output_scale: float
    weights: tuple[int, ...]
    context: int
    window_tokens: int
    window_seed: int

    @property
    def num_items(self) -> int:
        return 2 * self.num_layers

    @property
    def max_budget(self) -> int:
        return half_budget(self.weights)


def filled(
    engine: SublayerEngine, length: int, window: int, seed: int
) -> tuple[KVCache, ReferenceWindow]:
    """Prefill ``length`` random tokens; the reference window is the last ``window``."""
    return random_window(engine, length, window, seed)


def scaled_model(family: str, num_layers: int, seed: int, output_scale: float) -> Any:
    """``tiny_model`` with every sublayer output projection scaled."""
    model = tiny_model(family, num_layers, seed)
    if output_scale == 1.0:
        return model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(output_scale)
            layer.mlp.down_proj.weight.mul_(output_scale)
    return model


def build(instance: Instance) -> tuple[SublayerEngine, KVCache, ReferenceWindow]:
    """Engine, prefilled cache and reference window of ``instance``."""
    model = scaled_model(
        instance.family, instance.num_layers, instance.model_seed, instance.output_scale
    )
    engine = SublayerEngine(model)
    cache, window = filled(engine, instance.context, instance.window_tokens, instance.window_seed)
    return engine, cache, window


def random_instances(
    families: Sequence[str],
    item_counts: Sequence[int],
    output_scales: Sequence[float],
    per_cell: int,
    seed: int,
    context: int = 24,
    window_tokens: int = 6,
) -> list[Instance]:
    """``per_cell`` instances per (family, 2L, scale): own model seed, weights and window."""
    generator = torch.Generator().manual_seed(seed)
    instances = []
    for family, items, scale in itertools.product(families, item_counts, output_scales):
        if items % 2:
            raise ValueError(f"2L must be even, got {items}")
        for _ in range(per_cell):
            weights = torch.randint(1, 5, (items,), generator=generator).tolist()
            model_seed, window_seed = torch.randint(0, 2**31 - 1, (2,), generator=generator)
            instances.append(
                Instance(
                    family=family,
                    num_layers=items // 2,
                    model_seed=int(model_seed),
                    output_scale=float(scale),
                    weights=tuple(int(w) for w in weights),
                    context=context,
                    window_tokens=window_tokens,
                    window_seed=int(window_seed),
                )
            )
    return instances


# ------------------------------------------------------------------------ brute force
def expand(flags: Flags, groups: Sequence[Sequence[int]]) -> SublayerMask:
    """DP-item executed flags -> a :class:`SublayerMask` over engine items."""
    return SublayerMask(tuple(run for run, group in zip(flags, groups, strict=True) for _ in group))


def brute_force_scores(
    engine: SublayerEngine,
    cache: KVCache,
    window: ReferenceWindow,
    weights: Sequence[int],
    max_budget: int,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    score_fn: ScoreFn = mean_cosine,
    chunk: int = 256,
) -> dict[Flags, tuple[int, float]]:
    """Every DP-item subset of skipped weight ``<= max_budget``: ``flags -> (budget, score)``.

    ``flags`` are the DP items' executed flags (as in ``KnapsackDPResult.executed``); each
    mask runs teacher-forced over the window (:meth:`SublayerEngine.run_masks`, in chunks
    because block-causal attention grows with the square of the batch) and is scored with
    ``score_fn`` against the full model's final state, as the DP scores its final states.
    """
    groups = single_items(engine.num_items) if groups is None else groups
    if len(weights) != len(groups):
        raise ValueError(f"{len(weights)} weights for {len(groups)} DP items")
    subsets: list[tuple[Flags, int]] = []
    for flags in itertools.product((True, False), repeat=len(groups)):
        budget = sum(w for w, run in zip(weights, flags, strict=True) if not run)
        if budget <= max_budget:
            subsets.append((flags, budget))
    table: dict[Flags, tuple[int, float]] = {}
    for start in range(0, len(subsets), chunk):
        part = subsets[start : start + chunk]
        masks = [expand(flags, groups) for flags, _ in part]
        final = engine.run_masks(masks, window.points[0], window.positions, cache, window.start)
        scores = score_fn(window.final_hidden, final).double().tolist()
        for (flags, budget), score in zip(part, scores, strict=True):
            table[flags] = (budget, float(score))
    return table


def best_per_budget(table: Mapping[Flags, tuple[int, float]]) -> dict[int, float]:
    """The brute-force optimum for every exactly-reachable budget."""
    best: dict[int, float] = {}
    for budget, score in table.values():
        best[budget] = max(best.get(budget, -math.inf), score)
    return best


# ------------------------------------------------------------------------- comparison
@attrs.frozen
class BudgetComparison:
    """The DP's answer for one budget next to the brute-force optimum.

    Attributes:
        budget: the skipped weight.
        best: the brute-force best score of the masks of this weight (that pass τ, if any).
        dp: the brute-force score of the DP's mask (None: the DP returned no mask).
        matched: the DP's mask scores ``best`` (within the tolerance).
    """

    budget: int
    best: float
    dp: float | None
    matched: bool

    @property
    def gap(self) -> float | None:
        """``best - dp`` (>= 0 up to rounding); None when the DP missed the budget."""
        return None if self.dp is None else self.best - self.dp

    @property
    def relative_gap(self) -> float | None:
        gap = self.gap
        return None if gap is None or self.best == 0.0 else gap / abs(self.best)


def compare(
    dp_choice: Mapping[int, Flags],
    table: Mapping[Flags, tuple[int, float]],
    *,
    min_score: float | None = None,
    tolerance: float = TOLERANCE,
) -> list[BudgetComparison]:
    """Per budget (ascending), the DP's choice scored by brute force vs the optimum.

    Args:
        dp_choice: the DP's executed flags per budget (``budget -> flags``).
        table: :func:`brute_force_scores` of the same instance.
        min_score: the τ the DP ran with: budgets whose best mask scores below it are no
            pairs (the pruned DP is not asked to return them).
        tolerance: how far below the optimum a match may be (scores of the same mask are
            identical: both come from ``table``).

    Raises:
        ValueError: a DP mask that brute force did not enumerate, or whose skipped weight is
            not its budget (the DP broke its own contract).
    """
    best = best_per_budget(table)
    expected = {b for b, s in best.items() if min_score is None or s >= min_score}
    comparisons = []
    for budget in sorted(expected | set(dp_choice)):
        if budget not in best:
            raise ValueError(f"the DP returned budget {budget}, which no subset weighs")
        flags = dp_choice.get(budget)
        if flags is None:
            comparisons.append(BudgetComparison(budget, best[budget], None, False))
            continue
        if flags not in table:
            raise ValueError(f"the DP's mask {flags} for budget {budget} was not enumerated")
        weight, score = table[flags]
        if weight != budget:
            raise ValueError(f"the DP's mask for budget {budget} skips weight {weight}")
        comparisons.append(
            BudgetComparison(budget, best[budget], score, score >= best[budget] - tolerance)
        )
    return comparisons


def instance_summary(
    comparisons: Sequence[BudgetComparison], tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Per instance: pairs, matches, misses, whether every budget / the overall best match.

    ``global_best_matched``: the best DP score over all its budgets equals the best score
    over all brute-force pairs; ``skipping_best_matched``: the same over budgets ``>= 1``
    (budget 0 is the full model, score 1, which any correct DP returns).
    """

    def best_of(values: Iterable[float | None]) -> float:
        present = [v for v in values if v is not None]
        return max(present) if present else -math.inf

    skipping = [c for c in comparisons if c.budget > 0]
    bf_all, dp_all = best_of(c.best for c in comparisons), best_of(c.dp for c in comparisons)
    bf_skip, dp_skip = best_of(c.best for c in skipping), best_of(c.dp for c in skipping)
    return {
        "pairs": len(comparisons),
        "matched": sum(c.matched for c in comparisons),
        "missed": sum(c.dp is None for c in comparisons),
        "all_matched": all(c.matched for c in comparisons),
        "global_best_matched": dp_all >= bf_all - tolerance,
        "skipping_best_matched": dp_skip >= bf_skip - tolerance,
        "gaps": [c.gap for c in comparisons if c.gap is not None],
        "relative_gaps": [c.relative_gap for c in comparisons if c.relative_gap is not None],
    }


def aggregate(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Match rates and gaps over instances (``rows`` of :func:`instance_summary`)."""
    pairs = sum(r["pairs"] for r in rows)
    gaps = [g for r in rows for g in r["gaps"]]
    relative = [g for r in rows for g in r["relative_gaps"]]
    count = len(rows)

    def mean(values: Sequence[float]) -> float | None:
        return sum(values) / len(values) if values else None

    return {
        "instances": count,
        "pairs": pairs,
        "pair_match_rate": sum(r["matched"] for r in rows) / pairs if pairs else None,
        "missed_pairs": sum(r["missed"] for r in rows),
        "instance_all_budgets_match_rate": sum(r["all_matched"] for r in rows) / count,
        "instance_global_best_match_rate": sum(r["global_best_matched"] for r in rows) / count,
        "instance_skipping_best_match_rate": sum(r["skipping_best_matched"] for r in rows) / count,
        "mean_gap": mean(gaps),
        "worst_gap": max(gaps, default=None),
        "mean_relative_gap": mean(relative),
        "worst_relative_gap": max(relative, default=None),
    }


# ------------------------------------------------------------------------------- run
def run_instance(instance: Instance, min_scores: Sequence[float | None]) -> list[dict[str, Any]]:
    """Brute force once, the DP once per τ; one result row per τ."""
    engine, cache, window = build(instance)
    table = brute_force_scores(engine, cache, window, instance.weights, instance.max_budget)
    rows = []
    for min_score in min_scores:
        result = hidden_state_dp(
            engine,
            window,
            cache,
            instance.weights,
            max_budget=instance.max_budget,
            min_score=min_score,
        )
        choice = dict(zip(result.budgets, result.table.executed, strict=True))
        comparisons = compare(choice, table, min_score=min_score)
        recomputed = [table[flags][1] for flags in result.table.executed]
        drift = max(
            (abs(a - b) for a, b in zip(recomputed, result.scores.tolist(), strict=True)),
            default=0.0,
        )
        summary = instance_summary(comparisons)
        rows.append(
            {
                **attrs.asdict(instance),
                "items": instance.num_items,
                "max_budget": instance.max_budget,
                "min_score": min_score,
                "pruned_states": result.table.stats.pruned_states,
                "masks_enumerated": len(table),
                "table_vs_recomputed_max_abs": drift,
                **{k: v for k, v in summary.items() if k not in ("gaps", "relative_gaps")},
                "gaps": summary["gaps"],
                "relative_gaps": summary["relative_gaps"],
                "unmatched_budgets": [c.budget for c in comparisons if not c.matched],
                "unmatched_gaps": [c.gap for c in comparisons if not c.matched],
            }
        )
    return rows


def pruning_label(min_score: float | None) -> str:
    return "none" if min_score is None else f"tau={min_score:g}"


def breakdown(rows: Sequence[Mapping[str, Any]], *keys: str) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return [
        {**dict(zip(keys, key, strict=True)), **aggregate(group)}
        for key, group in sorted(groups.items(), key=lambda kv: kv[0])
    ]


def print_table(title: str, cells: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> None:
    print(f"\n{title}")
    header = [*keys, "inst", "pairs", "pair match", "all-b match", "best match", "best>0 match"]
    header += ["missed"]
    header += ["mean gap", "worst gap", "worst rel"]
    print(" | ".join(f"{h:>12}" for h in header))
    for cell in cells:
        values = [str(cell[k]) for k in keys]
        values += [str(cell["instances"]), str(cell["pairs"])]
        values += [
            f"{cell['pair_match_rate']:.3f}",
            f"{cell['instance_all_budgets_match_rate']:.3f}",
        ]
        values += [f"{cell['instance_global_best_match_rate']:.3f}"]
        values += [f"{cell['instance_skipping_best_match_rate']:.3f}", str(cell["missed_pairs"])]
        values += [f"{cell['mean_gap']:.2e}", f"{cell['worst_gap']:.2e}"]
        values += [f"{cell['worst_relative_gap']:.2e}"]
        print(" | ".join(f"{v:>12}" for v in values))


def to_json(report: Mapping[str, Any]) -> str:
    """The report, indented, with one line per instance (all gaps summarised, not listed)."""
    head = {k: v for k, v in report.items() if k != "instances"}
    text = json.dumps(head, indent=1)
    lines = [
        json.dumps({k: v for k, v in row.items() if k not in ("gaps", "relative_gaps")})
        for row in report["instances"]
    ]
    return text[:-2] + ',\n "instances": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3"])
    parser.add_argument("--items", nargs="+", type=int, default=[4, 6, 8, 10, 12])
    parser.add_argument("--scales", nargs="+", type=float, default=[1.0, 8.0])
    parser.add_argument("--per-cell", type=int, default=30, help="instances per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    min_scores: list[float | None] = [None, TAU]
    instances = random_instances(args.families, args.items, args.scales, args.per_cell, args.seed)
    began = time.perf_counter()
    rows = [row for instance in instances for row in run_instance(instance, min_scores)]
    elapsed = time.perf_counter() - began
    for row in rows:
        row["pruning"] = pruning_label(row["min_score"])
    by_items = breakdown(rows, "items", "pruning")
    by_pruning = breakdown(rows, "pruning")
    report = {
        "benchmark": "dp_match_rate",
        "command": " ".join(
            ["taskset -c 1 .venv/bin/python benchmarks/dp_match_rate.py", *sys.argv[1:]]
        ),
        "settings": {
            "families": args.families,
            "items_2L": args.items,
            "output_scales": args.scales,
            "instances_per_cell": args.per_cell,
            "seed": args.seed,
            "weights": "uniform integers in [1, 4]",
            "max_budget": "half_budget(weights) = floor(sum / 2)",
            "groups": "one DP item per sublayer (decoupled attention / MLP)",
            "score_fn": "mean_cosine (final hidden state vs the full model's)",
            "context_tokens": instances[0].context,
            "window_tokens": instances[0].window_tokens,
            "min_scores": min_scores,
            "match_tolerance": TOLERANCE,
            "threads": torch.get_num_threads(),
        },
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "commit": git_commit(),
        },
        "elapsed_s": round(elapsed, 1),
        "overall": by_pruning,
        "by_items_and_pruning": by_items,
        "by_family_scale_and_pruning": breakdown(rows, "family", "output_scale", "pruning"),
        "instances": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(report), encoding="utf-8")
    print_table("by 2L and pruning", by_items, ("items", "pruning"))
    print_table("overall", by_pruning, ("pruning",))
    print_table(
        "by family and output scale",
        report["by_family_scale_and_pruning"],
        ("family", "output_scale", "pruning"),
    )
    print(f"\n{len(instances)} instances in {elapsed:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
