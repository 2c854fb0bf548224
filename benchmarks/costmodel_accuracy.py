"""How well do the cost models predict step times they were not fitted on?

Profiles SmolLM2-135M-Instruct through the sublayer engine, fits
:class:`~knapspec.costmodels.FittedLinearCostModel`, then measures held-out steps at
contexts the profile never used (512..6144):

* draft steps: ``engine.forward`` over one token with a random mask (25-100% of the items),
  plus the argmax — what the decoder times as one draft token;
* verify steps: ``engine.forward`` over ``k`` tokens (random ``k`` in 1..11) with all
  items and all logits.

Reports the median absolute relative error |predicted - measured| / measured per kind for
the fitted model, and for the online model evaluated prequentially (it predicts each
held-out step, then observes it). Also times ``OnlineCalibratedCostModel.observe`` (the
decode hot path) against ``SGDRegressor.partial_fit`` on one sample.

Usage::

    python benchmarks/costmodel_accuracy.py [--quick] [--out results/costmodel]

Writes ``profile-smollm2.json`` (the profile), ``accuracy.jsonl`` (one line per held-out
measurement, then one summary line) and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers
from sklearn.linear_model import SGDRegressor

from knapspec.costmodels import (
    FittedLinearCostModel,
    LatencyObservation,
    OnlineCalibratedCostModel,
    profile_engine,
)
from knapspec.costmodels.profiler import fill_random_cache
from knapspec.model.engine import SublayerEngine
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.types import SublayerMask

DEFAULT_THREADS = 2
HELD_OUT_CONTEXTS = (512, 1536, 3072, 4608, 6144)
MAX_TOKENS = 11  # D + 1 with the paper's D = 10
ANCHOR_CONTEXT = 1024


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def median_time(call: Any, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def random_mask(rng: np.random.Generator, layers: int) -> SublayerMask:
    keep = rng.uniform(0.25, 1.0)
    executed = rng.random(2 * layers) < keep
    return SublayerMask(tuple(bool(x) for x in executed))


class LoadAnchor:
    """A fixed reference step (one full-model token at ANCHOR_CONTEXT) re-timed over the run.

    Other processes share this machine's cores, so its speed drifts by tens of percent over
    minutes. The anchor's time now over its time right after profiling measures that drift;
    the "load-normalised" errors divide it out, the raw errors do not.
    """

    def __init__(self, engine: SublayerEngine, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed + 1)
        self.cache = engine.new_cache(ANCHOR_CONTEXT + 2)
        fill_random_cache(engine, self.cache, ANCHOR_CONTEXT, generator)
        self.engine = engine
        self.reference = self.measure()

    def measure(self) -> float:
        token = torch.tensor([1])

        def step() -> None:
            self.engine.forward(token, ANCHOR_CONTEXT, self.cache, None, all_logits=False)

        return median_time(step, repeats=5, warmup=1)

    def ratio(self) -> float:
        return self.measure() / self.reference


def held_out(
    engine: SublayerEngine,
    anchor: LoadAnchor,
    *,
    masks: int,
    widths: int,
    repeats: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Measure held-out draft and verify steps; one record per measurement."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    cache = engine.new_cache(max(HELD_OUT_CONTEXTS) + MAX_TOKENS + 1)
    records: list[dict[str, Any]] = []
    token = torch.tensor([int(rng.integers(engine.vocab_size))])
    for context in HELD_OUT_CONTEXTS:
        fill_random_cache(engine, cache, context, generator)
        block: list[dict[str, Any]] = []
        before = anchor.ratio()
        for _ in range(masks):
            mask = random_mask(rng, engine.num_layers)

            def draft_step(mask: SublayerMask = mask, at: int = context) -> None:
                engine.forward(token, at, cache, mask, all_logits=False).logits.argmax(-1)

            seconds = median_time(draft_step, repeats, warmup=1)
            block.append(
                {
                    "kind": "draft",
                    "context": context,
                    "tokens": 1,
                    "skipped": list(mask.skipped),
                    "measured_s": seconds,
                }
            )
        for width in sorted(rng.choice(np.arange(1, MAX_TOKENS + 1), widths, replace=False)):
            ids = torch.from_numpy(rng.integers(engine.vocab_size, size=int(width)))

            def verify_step(ids: torch.Tensor = ids, at: int = context) -> None:
                engine.forward(ids, at, cache, None, all_logits=True).logits.argmax(-1)

            seconds = median_time(verify_step, repeats, warmup=1)
            block.append(
                {
                    "kind": "verify",
                    "context": context,
                    "tokens": int(width),
                    "skipped": None,
                    "measured_s": seconds,
                }
            )
        load = (before + anchor.ratio()) / 2
        records += [{**record, "load_ratio": load} for record in block]
    return records


def as_observation(record: dict[str, Any], layers: int) -> LatencyObservation:
    mask = (
        SublayerMask.from_skipped(layers, record["skipped"]) if record["kind"] == "draft" else None
    )
    return LatencyObservation(
        record["kind"], record["context"], record["measured_s"], record["tokens"], mask
    )


def predicted(model: FittedLinearCostModel, observation: LatencyObservation) -> float:
    """The model's predicted seconds for the step ``observation`` describes."""
    if observation.mask is not None:
        return float(model.draft_cost(observation.mask, observation.context_length))
    return float(model.verify_cost(observation.tokens, observation.context_length))


def hot_path_costs(online: OnlineCalibratedCostModel, layers: int) -> dict[str, float]:
    """Microseconds per observation: online observe() (queues it), the absorption the
    next prediction does (the RLS update), and SGDRegressor.partial_fit on one sample."""
    mask = SublayerMask.full(layers)
    observation = LatencyObservation("draft", 1000, online.draft_cost(mask, 1000), 1, mask)
    count = 200  # below the queue's bound, so that observe() only queues
    observe_total = absorb_total = 0.0
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(count):
            online.observe(observation)
        observe_total += time.perf_counter() - start
        start = time.perf_counter()
        online.draft_cost(mask, 1000)  # absorbs the queue
        absorb_total += time.perf_counter() - start
    observe_us = observe_total / (10 * count) * 1e6
    absorb_us = absorb_total / (10 * count) * 1e6
    sgd = SGDRegressor()
    features, target = np.ones((1, 4)), np.ones(1)
    start = time.perf_counter()
    for _ in range(count // 4):
        sgd.partial_fit(features, target)
    sgd_us = (time.perf_counter() - start) / (count // 4) * 1e6
    return {"observe_us": observe_us, "absorb_us": absorb_us, "sgd_partial_fit_us": sgd_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="quick profile, fewer held-out steps")
    parser.add_argument("--out", type=Path, default=Path("results/costmodel"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help="torch threads (default %(default)s; 1 on a machine whose cores are oversubscribed)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model_and_tokenizer(progress=False)
    engine = SublayerEngine(model)

    began = time.perf_counter()
    if args.quick:
        profile = profile_engine(engine, quick=True, max_tokens=MAX_TOKENS)
    else:
        profile = profile_engine(engine, max_tokens=MAX_TOKENS, repeats=3, warmup=1)
    print(f"profiled in {time.perf_counter() - began:.1f} s")
    anchor = LoadAnchor(engine, args.seed)  # right after profiling: the reference speed
    fitted = FittedLinearCostModel.from_profile(profile)
    pooled = FittedLinearCostModel.from_profile(profile, pooled=True)
    online = OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(profile))

    masks, widths, repeats = (4, 3, 3) if args.quick else (6, 4, 3)
    records = held_out(engine, anchor, masks=masks, widths=widths, repeats=repeats, seed=args.seed)
    for record in records:
        observation = as_observation(record, engine.num_layers)
        record["predicted_linear_s"] = predicted(fitted, observation)
        record["predicted_pooled_s"] = predicted(pooled, observation)
        record["predicted_normalised_s"] = record["predicted_linear_s"] * record["load_ratio"]
        # Prequential: the online model predicts the step, then observes it.
        record["predicted_online_s"] = float(online.predict([observation])[0])
        online.observe(observation)

    def mare(kind: str, column: str) -> float:
        errors = [
            abs(r[column] - r["measured_s"]) / r["measured_s"] for r in records if r["kind"] == kind
        ]
        return float(np.median(errors))

    errors = {
        f"{kind}_{name}": mare(kind, f"predicted_{name}_s")
        for kind in ("draft", "verify")
        for name in ("linear", "pooled", "normalised", "online")
    }
    coefficients = fitted.coefficients()
    verify_ratio = fitted.verify_cost(8, 1024) / fitted.step_cost(1024)
    summary: dict[str, Any] = {
        "summary": True,
        "quick": args.quick,
        "median_abs_rel_error": errors,
        "held_out_contexts": HELD_OUT_CONTEXTS,
        "profile_contexts": profile.contexts,
        "profile_verify_contexts": sorted({v.context_length for v in profile.verify}),
        "profile_wall_s": profile.wall_seconds,
        "coefficients_s": {
            "overhead": coefficients.overhead,
            "attn_intercept": coefficients.attn_intercept,
            "attn_slope_per_token": coefficients.attn_slope,
            "mlp": coefficients.mlp,
            "verify_per_width_A_B": coefficients.verify,
        },
        "verify8_over_step_at_1024": verify_ratio,
        "weights_at": {str(n): fitted.weights(n) for n in (256, 1024, 2048, 4096, 8000)},
        "hot_path": hot_path_costs(
            OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(profile)),
            engine.num_layers,
        ),
        "model": profile.key.model_name,
        "threads": args.threads,
        "dtype": profile.key.dtype,
        "device": profile.key.device,
        "host_cpu": profile.key.host_cpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": git_commit(),
        "load_average": os.getloadavg(),
        "load_ratio_range": [
            min(r["load_ratio"] for r in records),
            max(r["load_ratio"] for r in records),
        ],
    }

    args.out.mkdir(parents=True, exist_ok=True)
    profile.save(
        args.out / ("profile-smollm2-quick.json" if args.quick else "profile-smollm2.json")
    )
    name = "accuracy-quick.jsonl" if args.quick else "accuracy.jsonl"
    with open(args.out / name, "w", encoding="utf-8") as stream:
        for record in [*records, summary]:
            stream.write(json.dumps(record) + "\n")
    lines = [
        "# Cost-model accuracy on held-out steps (SmolLM2-135M-Instruct)",
        "",
        f"Regenerate: `python benchmarks/costmodel_accuracy.py{' --quick' if args.quick else ''}"
        f"{'' if args.threads == DEFAULT_THREADS else f' --threads {args.threads}'}`"
        f" (commit {summary['commit']}, {args.threads} threads, {profile.key.host_cpu}, "
        f"load average at the end {summary['load_average'][0]:.1f}).",
        "",
        f"Profile ladder {list(profile.contexts)} (verify at {summary['profile_verify_contexts']},"
        f" k = 1..{MAX_TOKENS}), profiled in {profile.wall_seconds:.0f} s; held-out contexts "
        f"{list(HELD_OUT_CONTEXTS)}.",
        "",
        "| model | draft-step MARE | verify-step MARE |",
        "|---|---|---|",
    ]
    for name, label in (
        ("linear", "fitted, per layer"),
        ("normalised", "fitted, per layer, load-normalised"),
        ("pooled", "fitted, pooled"),
        ("online", "online (prequential)"),
    ):
        lines.append(
            f"| {label} | {errors[f'draft_{name}']:.1%} | {errors[f'verify_{name}']:.1%} |"
        )
    lines += [
        "",
        "Load-normalised: predictions times the slowdown of a fixed reference step (one token "
        f"at {ANCHOR_CONTEXT}) since profiling, which ranged "
        f"{summary['load_ratio_range'][0]:.2f}-{summary['load_ratio_range'][1]:.2f}x "
        "(other processes share the cores).",
        "",
        "MARE = median |predicted - measured| / measured over "
        f"{sum(r['kind'] == 'draft' for r in records)} draft and "
        f"{sum(r['kind'] == 'verify' for r in records)} verify measurements.",
        "",
        f"Fitted (layer mean): t_attn(n) = {coefficients.attn_intercept * 1e3:.3f} ms + "
        f"{coefficients.attn_slope * 1e6:.4f} µs·n; t_mlp = {coefficients.mlp * 1e3:.3f} ms; "
        f"overhead = {coefficients.overhead * 1e3:.2f} ms; verify(8, 1024) / step(1024) = "
        f"{verify_ratio:.2f}. Weights (w_attn, w_mlp): "
        + ", ".join(f"n={n}: {w}" for n, w in summary["weights_at"].items())
        + ".",
        "",
        f"Hot path: observe() {summary['hot_path']['observe_us']:.1f} µs per call (it "
        f"queues the observation); the next prediction absorbs it in "
        f"{summary['hot_path']['absorb_us']:.1f} µs (the RLS update); "
        f"SGDRegressor.partial_fit {summary['hot_path']['sgd_partial_fit_us']:.1f} µs per call.",
    ]
    (args.out / ("summary-quick.md" if args.quick else "summary.md")).write_text(
        "\n".join(lines) + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
