"""Planning overhead of KnapsackPlanner on SmolLM2-135M, and the masks it picks vs context.

For each context length ``n`` (Austen text): prefill, build the reference window from the
last tokens, measure a cost model on the spot (full step, step without MLPs, step without
attention, verify over k tokens), then time

* one autoregressive decode step through the engine,
* one default ``KnapsackPlanner`` plan (which may stop at the provable α = 1 shortcut),
* one full DP plan (``allow_no_speculation=False``: the DP and the α estimate always run).

Writes ``results/planning/overhead.jsonl`` (one line per context and measurement),
``results/planning/masks.jsonl``, ``results/planning/masks_vs_context.png`` and
``results/planning/summary.md``. Usage::

    python benchmarks/planning_overhead.py [--contexts 512 2048 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from knapspec.bench.prompts import corpus_file
from knapspec.costmodels.base import CostModel
from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.planners.base import PlanningContext
from knapspec.planners.knapsack import KnapsackPlanner, KnapsackPlannerConfig
from knapspec.sampling import SamplingParams
from knapspec.types import SublayerMask
from knapspec.window import ReferenceWindow

RESULTS = Path(__file__).resolve().parents[1] / "results" / "planning"
TEXT = "prideprejudice.txt"  # the corpus file (knapspec.bench.prompts.corpus_file)
WINDOW_TOKENS = 16
MAX_DRAFT = 10


@attrs.frozen
class SpotCostConfig:
    """No hyper-parameters: every number is measured."""


class SpotCostModel(CostModel):
    """A cost model measured at one context length (benchmark-local, not a library model).

    ``t_mlp`` / ``t_attn`` are the step-time drops from skipping every MLP / attention item,
    divided by ``L``; the overhead is what remains; verify costs are measured for several
    ``k`` and interpolated linearly.
    """

    config_class = SpotCostConfig

    def __init__(
        self, t_attn: float, t_mlp: float, overhead: float, verify: dict[int, float]
    ) -> None:
        self._t_attn, self._t_mlp, self._overhead = t_attn, t_mlp, overhead
        self._ks = sorted(verify)
        self._verify = [verify[k] for k in self._ks]

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return self._t_attn

    def t_mlp(self, layer: int | None = None) -> float:
        return self._t_mlp

    def overhead(self, context_length: int) -> float:
        return self._overhead

    def verify_cost(self, tokens: int, context_length: int) -> float:
        return float(np.interp(tokens, self._ks, self._verify))


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def prefill(engine: SublayerEngine, ids: torch.Tensor) -> tuple[KVCache, ReferenceWindow]:
    """Cache of ``ids`` and a window of the last WINDOW_TOKENS with all item points."""
    n = ids.numel()
    cache = engine.new_cache(n + 32)
    head = n - WINDOW_TOKENS
    engine.forward(ids[:head], 0, cache, all_logits=False)
    out = engine.forward(ids[head:], head, cache, capture_points=True)
    assert out.points is not None
    window = ReferenceWindow(
        points=out.points,
        token_ids=ids[head:],
        target_tokens=out.logits.argmax(-1),
        start=head,
    )
    return cache, window


def measure_costs(
    engine: SublayerEngine, cache: KVCache, ids: torch.Tensor, repeats: int
) -> SpotCostModel:
    n = ids.numel()
    layers = engine.num_layers
    last = ids[-1:]

    def step(mask: SublayerMask | None, tokens: int = 1) -> Callable[[], object]:
        def run() -> object:
            out = engine.forward(
                ids[-tokens:] if tokens > 1 else last, n, cache, mask, all_logits=True
            )
            cache.crop(n)
            return out.logits.argmax(-1)

        return run

    full = median_seconds(step(None), repeats)
    no_mlp = median_seconds(
        step(SublayerMask.from_skipped(layers, range(1, 2 * layers, 2))), repeats
    )
    no_attn = median_seconds(
        step(SublayerMask.from_skipped(layers, range(0, 2 * layers, 2))), repeats
    )
    t_mlp = max((full - no_mlp) / layers, 1e-7)
    t_attn = max((full - no_attn) / layers, 1e-7)
    overhead = max(full - layers * (t_attn + t_mlp), 0.0)
    verify = {1: full}
    for k in (2, 4, 8, MAX_DRAFT + 1):
        verify[k] = median_seconds(step(None, k), repeats)
    return SpotCostModel(t_attn, t_mlp, overhead, verify)


def context_for(
    engine: SublayerEngine, cache: KVCache, window: ReferenceWindow, costs: CostModel
) -> PlanningContext:
    return PlanningContext(
        engine=engine,
        cache=cache,
        context_length=window.start + window.size,
        window=window,
        cost_model=costs,
        proxy=None,
        max_draft_length=MAX_DRAFT,
        sampling=SamplingParams(),
    )


def timed_plan(
    planner: KnapsackPlanner, context: PlanningContext, repeats: int
) -> tuple[float, Any]:
    times, search = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        search = planner.search(context)
        times.append(time.perf_counter() - started)
    return statistics.median(times), search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument(
        "--mask-contexts", type=int, nargs="+", default=[256, 512, 1024, 2048, 3072, 4096]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plan-repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    from knapspec.model.loading.provision import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer()
    engine = SublayerEngine(model)
    text = corpus_file(TEXT).read_text(encoding="utf-8")[:200_000]
    all_ids = torch.tensor(tokenizer(text)["input_ids"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = {
        "model": engine.model_name,
        "dtype": str(engine.dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg()[0],
    }
    rows: list[dict[str, Any]] = []
    for n in args.contexts:
        ids = all_ids[:n]
        cache, window = prefill(engine, ids)
        costs = measure_costs(engine, cache, ids, args.repeats)
        context = context_for(engine, cache, window, costs)
        step = costs.step_cost(n)
        default_time, default = timed_plan(KnapsackPlanner(), context, args.plan_repeats)
        full_time, full = timed_plan(
            KnapsackPlanner(KnapsackPlannerConfig(allow_no_speculation=False)),
            context,
            args.plan_repeats,
        )
        dp = full.dp
        row = {
            **env,
            "context": n,
            "decode_step_s": step,
            "t_attn_s": costs.t_attn(n),
            "t_mlp_s": costs.t_mlp(),
            "overhead_s": costs.overhead(n),
            "verify_s": {k: costs.verify_cost(k, n) for k in (1, 2, 4, 8, 11)},
            "weights": list(costs.weights(n)),
            "default_plan_s": default_time,
            "default_plan_steps": default_time / step,
            "default_draft_length": default.plan.draft_length,
            "default_shortcut": default.shortcut,
            "full_dp_plan_s": full_time,
            "full_dp_plan_steps": full_time / step,
            "full_dp_budgets": len(dp.budgets),
            "full_dp_window_tokens": dp.window.size,
            "full_dp_states_executed": dp.table.stats.states_executed,
            "full_dp_candidates_estimated": len(full.candidates),
            "full_dp_best_mask": list(full.plan.mask.skipped),
            "full_dp_draft_length": full.plan.draft_length,
            "full_dp_predicted_acceptance": full.plan.predicted_acceptance,
            "full_dp_predicted_tps": full.plan.predicted_tokens_per_second,
            "ar_tps": 1.0 / step,
            "first_plan_share_128_tokens": full_time / (full_time + 128 * step),
        }
        rows.append(row)
        print(
            json.dumps(
                {
                    k: row[k]
                    for k in (
                        "context",
                        "decode_step_s",
                        "default_plan_s",
                        "full_dp_plan_s",
                        "full_dp_plan_steps",
                        "default_draft_length",
                    )
                }
            )
        )
    with (RESULTS / "overhead.jsonl").open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")

    mask_rows = []
    for n in args.mask_contexts:
        ids = all_ids[:n]
        cache, window = prefill(engine, ids)
        costs = measure_costs(engine, cache, ids, 1)
        search = KnapsackPlanner(KnapsackPlannerConfig(allow_no_speculation=False)).search(
            context_for(engine, cache, window, costs)
        )
        mask = search.plan.mask
        mask_rows.append(
            {
                "context": n,
                "skipped": list(mask.skipped),
                "draft_length": search.plan.draft_length,
                "weights": list(search.weights),
                "attention_skipped": mask.num_items // 2 - mask.num_attention_executed,
                "mlp_skipped": mask.num_items // 2 - mask.num_mlp_executed,
            }
        )
        print(json.dumps(mask_rows[-1]))
    with (RESULTS / "masks.jsonl").open("w") as handle:
        for row in mask_rows:
            handle.write(json.dumps(row) + "\n")
    plot_masks(mask_rows, engine.num_items)
    write_summary(rows, mask_rows)


def plot_masks(mask_rows: list[dict[str, Any]], num_items: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.ones((num_items, len(mask_rows)))
    for column, row in enumerate(mask_rows):
        grid[row["skipped"], column] = 0.0
    fig, ax = plt.subplots(figsize=(6, 9))
    ax.imshow(grid, aspect="auto", cmap="Greys_r", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks(range(len(mask_rows)), [str(r["context"]) for r in mask_rows])
    ax.set_yticks(
        range(0, num_items, 4),
        [f"{'A' if i % 2 == 0 else 'M'}{i // 2}" for i in range(0, num_items, 4)],
    )
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("item (A = attention, M = MLP of layer)")
    ax.set_title(
        "KnapSpec draft masks vs context (black = skipped)\nbest TPT candidate, γ = 0 excluded"
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "masks_vs_context.png", dpi=120)
    plt.close(fig)


def write_summary(rows: list[dict[str, Any]], mask_rows: list[dict[str, Any]]) -> None:
    load = rows[0]["load_average"]
    lines = [
        "# KnapsackPlanner planning overhead (SmolLM2-135M, fp32, CPU)",
        "",
        "Generated by `python benchmarks/planning_overhead.py`; raw data in `overhead.jsonl`",
        f"and `masks.jsonl`. Load average at start: {load:.1f} (a shared 2-core machine:",
        "absolute times are noisy; ratios measured side by side hold better).",
        "",
        "| context | decode step ms | default plan ms (steps) | γ chosen "
        "| full DP plan ms (steps) | budgets × window tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        shortcut = " (α=1 shortcut)" if r["default_shortcut"] else ""
        lines.append(
            f"| {r['context']} | {1e3 * r['decode_step_s']:.1f} "
            f"| {1e3 * r['default_plan_s']:.1f} ({r['default_plan_steps']:.2f}) "
            f"| {r['default_draft_length']}{shortcut} "
            f"| {1e3 * r['full_dp_plan_s']:.0f} ({r['full_dp_plan_steps']:.1f}) "
            f"| {r['full_dp_budgets']} × {r['full_dp_window_tokens']} |"
        )
    lines += [
        "",
        "## Masks vs context (γ = 0 excluded)",
        "",
        "| context | weights (attn, mlp) | attention skipped | MLP skipped | γ |",
        "|---|---|---|---|---|",
    ]
    for r in mask_rows:
        lines.append(
            f"| {r['context']} | {tuple(r['weights'])} | {r['attention_skipped']} "
            f"| {r['mlp_skipped']} | {r['draft_length']} |"
        )
    first, last = mask_rows[0], mask_rows[-1]
    trend = "more" if last["attention_skipped"] > first["attention_skipped"] else "not more"
    lines += [
        "",
        f"Attention items skipped at {first['context']}: {first['attention_skipped']}; "
        f"at {last['context']}: {last['attention_skipped']}: attention is skipped {trend} "
        "as the context grows in this run.",
        "",
    ]
    (RESULTS / "summary.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
