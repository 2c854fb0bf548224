"""How well does each value proxy predict a draft mask's true acceptance rate?

On the real SmolLM2-135M-Instruct and Jane Austen passages, for 50+ random masks skipping
1..30 of the 60 items:

* **truth** — per-token acceptance measured on a held-out continuation: the target's greedy
  continuation of ``--continuation`` tokens after the passage; at every position the draft
  (the mask) runs on the true prefix, attending to the full model's cached K/V of everything
  before it (the situation of a first draft token), and we record whether its argmax equals
  the target's next token (greedy α) and ``Σ min(p, q)`` at T = 0.7, top-p 0.9 (sampling α).
* **predictions** — from the reference window (the last ``--window`` passage tokens, with
  the full model's states at every item point captured on the preceding tokens, as the
  decoder keeps them): the cosine score (the DP's value), the Monte-Carlo α (greedy top-1
  agreement, which is also the cosine proxy's default α, and the sampling Σ min(p, q)), the
  Lemma 4.1 certified fractions, and -KL.

Reports Spearman rank correlation and calibration (MAE, reliability table) per proxy.

    python benchmarks/proxy_quality.py [--quick]
    python benchmarks/proxy_quality.py --report-only   # re-derive tables/plot from the jsonl

Writes ``results/proxies/proxy_quality.jsonl`` (one line per mask), ``summary.md``,
``run_info.json`` and ``proxy_vs_true.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from scipy.stats import spearmanr
from tqdm import tqdm

from knapspec.model.engine import SublayerEngine
from knapspec.proxies import CosineProxy, MonteCarloAcceptanceProxy, MonteCarloProxyConfig
from knapspec.sampling import SamplingParams, processed_probs
from knapspec.types import SublayerMask
from knapspec.window import ReferenceWindow

GREEDY = SamplingParams()
SAMPLING = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9)
AUSTEN = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "austen"
ALPHA_PREDICTORS = (
    "mc_greedy_alpha",
    "certified_fraction",
    "certified_exact_fraction",
    "certified_cosine_fraction",
    "cosine_score",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (minutes less)")
    parser.add_argument("--masks", type=int, default=60)
    parser.add_argument("--max-skipped", type=int, default=30)
    parser.add_argument("--passages", type=int, default=3)
    parser.add_argument(
        "--context", type=int, default=256, help="passage tokens before the window end"
    )
    parser.add_argument("--window", type=int, default=32, help="reference window tokens r")
    parser.add_argument("--continuation", type=int, default=64, help="held-out tokens per passage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/proxies"))
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="re-derive summary.md and the plot from an existing proxy_quality.jsonl",
    )
    args = parser.parse_args()
    if args.quick:
        args.masks, args.passages, args.context = 12, 1, 128
        args.window, args.continuation = 16, 16
    return args


def random_masks(num_layers: int, count: int, max_skipped: int, seed: int) -> list[SublayerMask]:
    """``count`` masks whose sizes cycle through 1..max_skipped, items uniformly at random."""
    rng = random.Random(seed)
    items = range(2 * num_layers)
    return [
        SublayerMask.from_skipped(num_layers, rng.sample(items, 1 + k % max_skipped))
        for k in range(count)
    ]


def passages(tokenizer: Any, count: int, length: int, seed: int) -> list[torch.Tensor]:
    """``count`` token spans of ``length`` from different novels, at seeded offsets."""
    rng = random.Random(seed)
    files = sorted(AUSTEN.glob("*.txt"))
    spans = []
    for index in range(count):
        text = files[index % len(files)].read_text(encoding="utf-8")
        start = rng.randrange(len(text) // 10, len(text) - 20 * length)
        ids = tokenizer(text[start : start + 12 * length], add_special_tokens=False)["input_ids"]
        spans.append(torch.tensor(ids[:length]))
    return spans


def measure_passage(
    engine: SublayerEngine,
    masks: list[SublayerMask],
    prefix: torch.Tensor,
    window_size: int,
    continuation: int,
) -> dict[str, Any]:
    """Truth and predictions for every mask on one passage."""
    n = prefix.numel()
    cache = engine.new_cache(n + continuation + 8)
    out = engine.forward(prefix, 0, cache, capture_points=True, capture_last=window_size)
    assert out.points is not None
    window = ReferenceWindow(
        points=out.points,
        token_ids=prefix[-window_size:],
        target_tokens=out.logits[-window_size:].argmax(dim=-1),
        start=n - window_size,
    )
    # The target's greedy continuation and its logits at each held-out position.
    full_logits = [out.logits[-1]]
    tokens = prefix.tolist()
    for step in range(continuation - 1):
        tokens.append(int(full_logits[-1].argmax()))
        step_out = engine.forward(torch.tensor(tokens[-1:]), n + step, cache)
        full_logits.append(step_out.logits[-1])
    tokens.append(int(full_logits[-1].argmax()))
    target_logits = torch.stack(full_logits)  # (T, V)
    targets = torch.tensor(tokens[n:])  # (T,)

    # Truth: each mask drafts position n-1+t on the true prefix (full-model K/V before it).
    greedy_hits = torch.zeros(len(masks))
    sampled = torch.zeros(len(masks))
    p_all = processed_probs(target_logits, SAMPLING)
    with torch.inference_mode():
        for t in range(continuation):
            position = n - 1 + t
            token = torch.tensor([tokens[position]])
            start_hidden = engine.embed_tokens(token)
            final = engine.run_masks(masks, start_hidden, torch.tensor([position]), cache, position)
            logits = engine.logits(final[:, 0])  # (B, V)
            greedy_hits += (logits.argmax(dim=-1) == targets[t]).float()
            q = processed_probs(logits, SAMPLING)
            sampled += torch.minimum(p_all[t][None], q).sum(dim=-1)

    # Predictions from the reference window (teacher-forced, like the planner's DP).
    candidates = engine.run_masks(masks, window.points[0], window.positions, cache, window.start)
    cosine = CosineProxy()
    montecarlo = MonteCarloAcceptanceProxy()
    neg_kl = MonteCarloAcceptanceProxy.from_config(MonteCarloProxyConfig(score="neg-kl"), engine)
    timer = time.perf_counter()
    mc_greedy = montecarlo.estimate_acceptance(engine, window, candidates, GREEDY)
    mc_greedy_s = time.perf_counter() - timer
    mc_sampling = montecarlo.estimate_acceptance(engine, window, candidates, SAMPLING)
    certified_proxy = CosineProxy(acceptance="certified")
    certified_proxy.estimate_acceptance(engine, window, candidates[:1], GREEDY)
    timer = time.perf_counter()  # the window's margins are cached now, as in a planner
    certified_proxy.estimate_acceptance(engine, window, candidates, GREEDY)
    certified_s = time.perf_counter() - timer
    certificates = cosine.certificate(
        engine, window, candidates, check_agreement=False, exact_radius=True
    )
    normed = CosineProxy(space="normed").certificate(
        engine, window, candidates, check_agreement=False
    )
    return {
        "true_greedy": (greedy_hits / continuation).tolist(),
        "true_sampling": (sampled / continuation).tolist(),
        "cosine_score": cosine.score(window.final_hidden, candidates).tolist(),
        "neg_kl": neg_kl.score(window.final_hidden, candidates).tolist(),
        "mc_greedy_alpha": [e.alpha for e in mc_greedy],
        "mc_greedy_low": [e.low for e in mc_greedy],
        "mc_greedy_high": [e.high for e in mc_greedy],
        "mc_sampling_alpha": [e.alpha for e in mc_sampling],
        "certified_fraction": [c.certified_fraction for c in certificates],
        "certified_exact_fraction": [c.certified_exact_fraction for c in certificates],
        "certified_cosine_fraction": [c.certified_cosine_fraction for c in certificates],
        "certified_fraction_normed": [c.certified_fraction for c in normed],
        "norm_ratio_max_abs_log": [c.norm_ratio_stats()["max_abs_log"] for c in certificates],
        "norm_ratio_normed_mean": [c.norm_ratio_stats()["mean"] for c in normed],
        "norm_ratio_normed_max_abs_log": [c.norm_ratio_stats()["max_abs_log"] for c in normed],
        "window_margin_median": float(certificates[0].margin.median()),
        "window_bound_median": float(certificates[0].bound.median()),
        "timing_s": {"mc_greedy_all": mc_greedy_s, "certified_all": certified_s},
    }


def reliability(predicted: np.ndarray, true: np.ndarray, bins: int = 5) -> list[dict[str, float]]:
    """Rows of (bin, count, mean predicted, mean true) over equal-width bins of [0, 1]."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.digitize(predicted, edges[1:-1]), 0, bins - 1)
    rows = []
    for b in range(bins):
        chosen = index == b
        if chosen.any():
            rows.append(
                {
                    "low": float(edges[b]),
                    "high": float(edges[b + 1]),
                    "count": int(chosen.sum()),
                    "predicted": float(predicted[chosen].mean()),
                    "true": float(true[chosen].mean()),
                }
            )
    return rows


def evaluate(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Spearman and calibration of every predictor against its truth."""
    true_greedy = np.array([r["true_greedy"] for r in records])
    true_sampling = np.array([r["true_sampling"] for r in records])
    table: dict[str, dict[str, Any]] = {}
    pairs = [(name, "true_greedy", true_greedy) for name in ALPHA_PREDICTORS]
    pairs += [
        ("neg_kl", "true_greedy", true_greedy),
        ("certified_fraction_normed", "true_greedy", true_greedy),
    ]
    pairs += [("mc_sampling_alpha", "true_sampling", true_sampling)]
    pairs += [
        ("cosine_score", "true_sampling", true_sampling),
        ("neg_kl", "true_sampling", true_sampling),
    ]
    for name, truth_name, truth in pairs:
        predicted = np.array([r[name] for r in records])
        # A constant predictor (e.g. a certificate that certifies nothing) has no rank
        # correlation; record None rather than NaN.
        constant = bool(np.all(predicted == predicted[0]))
        rho = None if constant else float(spearmanr(predicted, truth).statistic)
        entry: dict[str, Any] = {"spearman": rho, "truth": truth_name}
        if name != "neg_kl":
            entry["mae"] = float(np.abs(predicted - truth).mean())
            entry["bias"] = float((predicted - truth).mean())
            entry["reliability"] = reliability(predicted, truth)
        table[f"{name} vs {truth_name}"] = entry
    return table


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_summary(path: Path, table: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    lines = [
        "# Value-proxy quality on SmolLM2-135M-Instruct",
        "",
        f"Command: `{info['command']}` — {info['masks']} random masks (1..{info['max_skipped']} "
        f"of 60 items skipped), {info['passages']} Austen passages, window r = {info['window']}, "
        f"{info['continuation']} held-out tokens per passage; commit {info['commit'][:10]}.",
        "",
        "Truth: per-token acceptance of the mask drafting on the true prefix (greedy: argmax "
        "= target's next token; sampling: Σ min(p, q) at T = 0.7, top-p 0.9), on held-out "
        "continuation tokens distinct from the window.",
        "",
        "| predictor | truth | Spearman ρ | MAE | bias |",
        "|---|---|---|---|---|",
    ]
    for key, entry in table.items():
        name = key.split(" vs ")[0]
        mae = f"{entry['mae']:.3f}" if "mae" in entry else "—"
        bias = f"{entry['bias']:+.3f}" if "bias" in entry else "—"
        rho = "n/a (constant)" if entry["spearman"] is None else f"{entry['spearman']:.3f}"
        lines.append(f"| {name} | {entry['truth']} | {rho} | {mae} | {bias} |")
    lines += ["", "## Reliability (bins of the predicted value)", ""]
    for key in (
        "mc_greedy_alpha vs true_greedy",
        "mc_sampling_alpha vs true_sampling",
        "certified_fraction vs true_greedy",
        "cosine_score vs true_greedy",
    ):
        lines += [f"**{key}**", "", "| bin | n | mean predicted | mean true |", "|---|---|---|---|"]
        for row in table[key]["reliability"]:
            lines.append(
                f"| [{row['low']:.1f}, {row['high']:.1f}) | {row['count']} | "
                f"{row['predicted']:.3f} | {row['true']:.3f} |"
            )
        lines.append("")
    lines += [
        "Reading: the window predictions run each mask teacher-forced over all r window tokens "
        "with its own K/V (as the planner's DP does), while the truth drafts one token at a "
        "time on the full model's K/V, so the Monte-Carlo α is expected to be biased low. The "
        "cosine score is not an α; its MAE is shown only to make that visible. A "
        "certificate that certifies nothing has no rank correlation.",
        "",
        "## Premise and cost",
        "",
        f"- Norm ratio ‖x'‖/‖x‖ in the folded space: max |log ratio| over all masks and tokens "
        f"= {info['folded_max_abs_log']:.2e} (equal norms up to RMSNorm's eps).",
        f"- In the normed space (final_norm(h) against the raw head): mean ratio "
        f"{info['normed_mean_ratio']:.3f}, max |log ratio| {info['normed_max_abs_log']:.3f}.",
        f"- Window median margin ξ = {info['margin_median']:.3f}; median lemma bound "
        f"{info['bound_median']:.5f}.",
        f"- Time to estimate α for all {info['masks']} candidates of one window: Monte-Carlo "
        f"(head matmul per candidate) {info['mc_seconds']:.3f} s, certified fraction "
        f"(cached margins, no head matmul) {info['certified_seconds']:.3f} s (median over "
        "passages).",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def plot(path: Path, records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("cosine_score", "true_greedy", "cosine score (DP value)"),
        ("mc_greedy_alpha", "true_greedy", "Monte-Carlo greedy α"),
        ("certified_fraction", "true_greedy", "certified fraction (Lemma 4.1)"),
        ("mc_sampling_alpha", "true_sampling", "Monte-Carlo sampling α"),
    ]
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.3))
    figure.subplots_adjust(wspace=0.32)
    sizes = np.array([r["num_skipped"] for r in records])
    for axis, (name, truth, title) in zip(axes, panels, strict=True):
        x = np.array([r[name] for r in records])
        y = np.array([r[truth] for r in records])
        points = axis.scatter(x, y, c=sizes, cmap="viridis", s=18)
        low = min(0.0, float(x.min()))
        axis.plot([low, 1], [low, 1], color="grey", linewidth=0.8, linestyle="--")
        rho = "n/a" if np.all(x == x[0]) else f"{spearmanr(x, y).statistic:.3f}"
        axis.set_title(f"{title}\nSpearman ρ = {rho}", fontsize=10)
        axis.set_xlabel("predicted (reference window)")
        axis.set_ylabel(f"true ({truth.split('_')[1]}, held-out)")
    figure.colorbar(points, ax=axes, label="items skipped")
    figure.savefig(path, dpi=120, bbox_inches="tight")


def report(out: Path, records: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Derive the metrics, summary and plot from the raw per-mask records."""
    table = evaluate(records)
    info["metrics"] = table
    (out / "run_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    write_summary(out / "summary.md", table, info)
    plot(out / "proxy_vs_true.png", records)
    print((out / "summary.md").read_text(encoding="utf-8"))


def main() -> None:
    args = parse_args()
    if args.report_only:
        lines = (args.out / "proxy_quality.jsonl").read_text(encoding="utf-8").splitlines()
        info = json.loads((args.out / "run_info.json").read_text(encoding="utf-8"))
        report(args.out, [json.loads(line) for line in lines], info)
        return
    torch.set_num_threads(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from knapspec.model.loading.provision import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(progress=False)
    engine = SublayerEngine(model)
    masks = random_masks(engine.num_layers, args.masks, args.max_skipped, args.seed)
    spans = passages(tokenizer, args.passages, args.context, args.seed)
    per_passage = [
        measure_passage(engine, masks, span, args.window, args.continuation)
        for span in tqdm(spans, desc="passages")
    ]
    keys = [k for k in per_passage[0] if isinstance(per_passage[0][k], list)]
    records = []
    for index, mask in enumerate(masks):
        record: dict[str, Any] = {
            "mask_skipped": mask.to_list(),
            "num_skipped": mask.num_skipped,
            "attention_skipped": mask.num_layers - mask.num_attention_executed,
            "mlp_skipped": mask.num_layers - mask.num_mlp_executed,
        }
        for key in keys:
            values = [p[key][index] for p in per_passage]
            record[key] = float(np.mean(values))
            record[f"{key}_per_passage"] = values
        records.append(record)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "proxy_quality.jsonl").open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    info = {
        "command": "python benchmarks/proxy_quality.py" + (" --quick" if args.quick else ""),
        "masks": args.masks,
        "max_skipped": args.max_skipped,
        "passages": args.passages,
        "context": args.context,
        "window": args.window,
        "continuation": args.continuation,
        "seed": args.seed,
        "commit": git_commit(),
        "model": engine.model_name,
        "dtype": str(engine.dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "folded_max_abs_log": max(r["norm_ratio_max_abs_log"] for r in records),
        "normed_mean_ratio": float(np.mean([r["norm_ratio_normed_mean"] for r in records])),
        "normed_max_abs_log": max(r["norm_ratio_normed_max_abs_log"] for r in records),
        "margin_median": float(np.median([p["window_margin_median"] for p in per_passage])),
        "bound_median": float(np.median([p["window_bound_median"] for p in per_passage])),
        "mc_seconds": float(np.median([p["timing_s"]["mc_greedy_all"] for p in per_passage])),
        "certified_seconds": float(
            np.median([p["timing_s"]["certified_all"] for p in per_passage])
        ),
    }
    report(args.out, records, info)


if __name__ == "__main__":
    main()
