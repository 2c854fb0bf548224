"""Report tables that explain each method's choices: per-drafter counts, the planning and
lookup overhead, and the lookup family of the oracle.

Every table is captioned with the machine it ran on (:func:`machine_caption`): a speed
figure without its CPU says nothing.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from knapspec.bench.markdown import markdown_table
from knapspec.bench.report.stats import ORACLE_SHARE_THRESHOLD

if TYPE_CHECKING:
    from knapspec.bench.report.stats import RunData

#: The method whose share of the oracle is reported.
KNAPSPEC = "knapspec"
#: Drafters in table order (``none``: plain steps, γ = 0).
DRAFTER_ORDER = ("lookup", "subnetwork", "none")


def machine_caption(data: RunData) -> str:
    """One line naming the machine, threads and model of the run (from ``run.json``)."""
    env = data.info.get("environment", {})
    threads = env.get("threads", data.info.get("threads", "?"))
    return (
        f"*Machine: {env.get('device', 'unknown CPU')}, {threads} threads; "
        f"{env.get('model', 'model ?')} ({env.get('dtype', '?')}), commit "
        f"`{env.get('commit', '?')}`.*"
    )


def drafter_counts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Rounds, drafted and accepted tokens per drafter, summed over ``rows`` (raw calls).

    Calls recorded before per-drafter counts existed count as one ``subnetwork`` /
    ``none`` split from their totals: drafted rounds are unknown there, so only the token
    totals are kept (under ``"all"``).
    """
    totals: dict[str, dict[str, int]] = defaultdict(lambda: dict(rounds=0, drafted=0, accepted=0))
    for row in rows:
        drafters = row.get("drafters")
        if drafters:
            for name, counts in drafters.items():
                for key in ("rounds", "drafted", "accepted"):
                    totals[name][key] += int(counts.get(key, 0))
        else:
            totals["all"]["rounds"] += len(row.get("accept_lengths", []))
            totals["all"]["drafted"] += int(row.get("drafted_tokens", 0))
            totals["all"]["accepted"] += int(row.get("accepted_tokens", 0))
    return dict(totals)


def _share(rows: Sequence[dict[str, Any]], key: str) -> float:
    total = sum(row["wall_time"] for row in rows)
    return sum(row.get(key, 0.0) for row in rows) / total if total > 0 else 0.0


def drafter_table(data: RunData) -> str:
    """Per scenario, length and engine method: who drafted how much, and the overhead.

    ``overhead`` is planning time (which includes proposing lookup drafts) over wall time;
    ``lookup`` is the proposing part alone.
    """
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in data.raw:
        if row.get("role") == "method" and row.get("plans") is not None:
            groups[(row["scenario"], row["context"], row["method"])].append(row)
    seen = {name for rows in groups.values() for name in drafter_counts(rows)}
    names = [name for name in DRAFTER_ORDER if name in seen]
    names += sorted(seen - set(names))
    header = [
        "scenario",
        "N",
        "method",
        *[f"{name}: rounds / drafted / accepted (α)" for name in names],
        "overhead (plan incl. lookup)",
        "lookup",
    ]
    table = []
    for key in groups:  # run order
        rows = groups[key]
        if all(not row.get("accept_lengths") for row in rows):
            continue  # model.generate calls: no rounds recorded
        counts = drafter_counts(rows)

        def cell(name: str, counts: dict[str, dict[str, int]] = counts) -> str:
            c = counts.get(name)
            if c is None:
                return "–"
            alpha = f" ({c['accepted'] / c['drafted']:.2f})" if c["drafted"] else ""
            return f"{c['rounds']} / {c['drafted']} / {c['accepted']}{alpha}"

        scenario, context, method = key
        table.append(
            [
                scenario,
                str(context) if context else "short",
                method,
                *[cell(name) for name in names],
                f"{_share(rows, 'plan_seconds'):.1%}",
                f"{_share(rows, 'lookup_seconds'):.1%}",
            ]
        )
    return markdown_table(header, table)


def _decode_seconds(row: dict[str, Any]) -> float | None:
    """Wall time past the prefill (None where the prefill was not timed: ``model.generate``)."""
    prefill = row.get("prefill_seconds")
    if not prefill:
        return None
    return float(row["wall_time"]) - float(prefill)


def decode_phase_ratios(
    data: RunData,
) -> tuple[dict[tuple[str, int, str], list[float]], dict[tuple[str, int], list[float]]]:
    """Per (scenario, length, method), each call's decode-phase speedup (the mean decode
    time of the plain calls before and after it on the same prompt over its own); and per
    (scenario, length), the plain calls' prefill share of their wall time."""
    order = list(data.raw)
    groups: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    prefill_share: dict[tuple[str, int], list[float]] = defaultdict(list)
    for index, row in enumerate(order):
        key = (row["scenario"], row["context"], row.get("prompt_id"))
        if row.get("role") == "reference":
            decode = _decode_seconds(row)
            if decode is not None:
                prefill_share[key[:2]].append(float(row["prefill_seconds"]) / row["wall_time"])
            continue
        decode = _decode_seconds(row)
        if decode is None or decode <= 0:
            continue

        def nearest(rows: Iterable[dict[str, Any]], key: tuple[Any, ...] = key) -> float | None:
            for other in rows:
                same = (other["scenario"], other["context"], other.get("prompt_id")) == key
                if same and other.get("role") == "reference":
                    return _decode_seconds(other)
            return None

        before = nearest(reversed(order[:index]))
        after = nearest(order[index + 1 :])
        references = [d for d in (before, after) if d]
        if references:
            groups[(row["scenario"], row["context"], row["method"])].append(
                statistics.fmean(references) / decode
            )
    return groups, prefill_share


def decode_phase_table(data: RunData) -> str:
    """Per scenario, length and engine method: the speedup of the decoding phase alone.

    The wall-time speedup includes the prefill, which no drafter shortens: at a few
    thousand prompt tokens it can be a large share of a 128-token call on a CPU (the
    table's ``plain prefill share``), so ``ceiling`` (plain wall time over plain prefill)
    caps any wall-time speedup. Each call's
    decode time (wall minus prefill) is compared with the mean of the plain calls before
    and after it on the same prompt, as the wall-time ratio is; median [min-max].
    """
    groups, prefill_share = decode_phase_ratios(data)
    header = ["scenario", "N", "method", "decode-phase speedup", "plain prefill share", "ceiling"]
    table = []
    for (scenario, context, method), ratios in groups.items():
        shares = prefill_share.get((scenario, context), [])
        share = statistics.median(shares) if shares else None
        table.append(
            [
                scenario,
                str(context) if context else "short",
                method,
                f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]",
                f"{share:.0%}" if share is not None else "–",
                f"{1 / share:.2f}" if share else "–",
            ]
        )
    return markdown_table(header, table)


def _median_speedup(data: RunData, scenario: str, context: int, method: str) -> float | None:
    values = [
        row["speedup_vs_ar"]
        for row in data.raw
        if row["scenario"] == scenario
        and row["context"] == context
        and row["method"] == method
        and row.get("speedup_vs_ar") is not None
    ]
    return statistics.median(values) if values else None


def lookup_oracle_table(data: RunData) -> str:
    """Per oracle line: the layer-skip and lookup families' best, lookup k = 3 and 10 as
    replayed, the measured ``lookup-k3`` / ``lookup-k10`` / ``knapspec`` medians (wall
    time), KnapSpec's decode-phase median and its share of the oracle where the oracle
    exceeds ``ORACLE_SHARE_THRESHOLD``.

    The oracle replays the decode phase only (its rounds are priced with measured verify
    steps; the prefill, the same for every method, is not in it), so the share divides
    KnapSpec's decode-phase speedup by it: like for like. Where no prefill was timed (runs
    before the decode-phase records) it falls back to the wall-time speedup."""
    decode_phase, _ = decode_phase_ratios(data)
    header = [
        "scenario",
        "N (tokens)",
        "oracle",
        "layer-skip best",
        "lookup best (k, α)",
        "replayed k = 3 / 10",
        "measured lookup-k3 / k10",
        "measured knapspec",
        "knapspec decode phase",
        "knapspec of oracle",
    ]
    rows = []
    for line in data.oracle:
        lookup = {c["draft_length"]: c for c in line.get("lookup", [])}
        best = line.get("best_lookup")
        scenario, context = line["scenario"], line["context"]
        knapspec = _median_speedup(data, scenario, context, KNAPSPEC)
        measured = [
            _median_speedup(data, scenario, context, m) for m in ("lookup-k3", "lookup-k10")
        ]
        oracle = float(line["speedup"])
        phase = decode_phase.get((scenario, context, KNAPSPEC))
        knapspec_phase = statistics.median(phase) if phase else None
        comparable = knapspec_phase if knapspec_phase is not None else knapspec

        def fmt(value: float | None) -> str:
            return f"{value:.2f}" if value is not None else "–"

        alpha = f"{best['accepted'] / best['drafted']:.2f}" if best and best["drafted"] else "–"
        rows.append(
            [
                scenario,
                f"{context} ({line['context_length']})",
                f"{oracle:.2f}",
                fmt(line.get("subnetwork_speedup")),
                f"{best['speedup']:.2f} (k = {best['draft_length']}, α {alpha})"
                if best
                else ("1.00 (plain)" if lookup else "–"),
                " / ".join(fmt(lookup[k]["speedup"]) if k in lookup else "–" for k in (3, 10)),
                " / ".join(fmt(v) for v in measured),
                fmt(knapspec),
                fmt(knapspec_phase),
                (
                    f"{comparable / oracle:.0%}"
                    if comparable is not None and oracle > ORACLE_SHARE_THRESHOLD
                    else "–"
                ),
            ]
        )
    return markdown_table(header, rows)


__all__ = [
    "ORACLE_SHARE_THRESHOLD",
    "decode_phase_ratios",
    "decode_phase_table",
    "drafter_counts",
    "drafter_table",
    "lookup_oracle_table",
    "machine_caption",
]
