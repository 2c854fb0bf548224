"""The table a CPU user reads, per size: knapspec beside llama.cpp, each against its floor.

Reads the raw lines of ``benchmarks/scale.py`` (knapspec's engine in float32 / bfloat16
and ``model.generate``) and of ``benchmarks/scale_gguf.py`` (llama.cpp on F16 / Q8_0 /
Q4_0 files of the same random weights) for one CPU and prints, per shape and depth, one
row per system and format: bytes per weight, the bandwidth floor (that format's weight
bytes over the measured triad bandwidth), the median one-row step and its ratio to the
floor, and the median greedy tokens per second (wall time with the prompt's prefill, as
both benchmarks time it). ``--quick`` lines are left out. No torch needed.

    python benchmarks/scale_table.py [--scale results/scale/<cpu>.jsonl] \
        [--llamacpp results/scale/llamacpp-<cpu>.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

_DTYPE_ORDER = {"float32": 0, "bfloat16": 1}
_QUANT_ORDER = {"F16": 0, "Q8_0": 1, "Q4_0": 2}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def table_rows(scale: list[dict[str, Any]], llamacpp: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (shape, layers, system, format), sorted by size then system.

    Each row: ``shape``, ``layers``, ``parameters``, ``system``, ``format``,
    ``bytes_per_weight``, ``floor_ms``, ``step_ms``, ``step_over_floor`` and
    ``tokens_per_second`` (medians over the lines; None where a kind of line is missing).
    """
    groups: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(
        lambda: {"steps": [], "rates": [], "floor_ms": None, "bytes_per_weight": None}
    )

    def add(key: tuple[Any, ...], line: dict[str, Any], bytes_per_weight: float) -> dict[str, Any]:
        group = groups[key]
        group.update(parameters=line["parameters"], bytes_per_weight=bytes_per_weight)
        if line["kind"] == "steps":
            group["steps"].append(line["step_ms"]["1"])
            group["floor_ms"] = line["floor_ms"]
        return group

    for line in scale:
        if line.get("quick") or line.get("kind") not in ("steps", "generate"):
            continue
        per_weight = line["weight_bytes"] / line["parameters"]
        shape_key = (line["shape"], line["layers"])
        rank = _DTYPE_ORDER.get(line["dtype"], 9)
        group = add((*shape_key, 0, rank, "knapspec plain", line["dtype"]), line, per_weight)
        if line["kind"] == "generate":
            group["rates"].append(line["new_tokens"]["plain"] / line["seconds"]["plain"])
            hf = add(
                (*shape_key, 2, rank, "transformers generate", line["dtype"]), line, per_weight
            )
            hf["rates"].append(line["new_tokens"]["generate"] / line["seconds"]["generate"])
    for line in llamacpp:
        if line.get("kind") not in ("steps", "generate"):
            continue
        rank = _QUANT_ORDER.get(line["quant"], 9)
        key = (line["shape"], line["layers"], 1, rank, "llama.cpp", line["quant"])
        group = add(key, line, line["bytes_per_weight"])
        if line["kind"] == "generate":
            group["rates"].append(line["tokens_per_second"])
    rows = []
    for key in sorted(groups, key=lambda k: (groups[k]["parameters"], k)):
        group = groups[key]
        step, floor = _median(group["steps"]), group["floor_ms"]
        rows.append(
            {
                "shape": key[0],
                "layers": key[1],
                "parameters": group["parameters"],
                "system": key[4],
                "format": key[5],
                "bytes_per_weight": group["bytes_per_weight"],
                "floor_ms": floor,
                "step_ms": step,
                "step_over_floor": step / floor if step is not None and floor else None,
                "tokens_per_second": _median(group["rates"]),
            }
        )
    return rows


def _cell(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (``step_ms`` blank for ``model.generate``)."""
    columns = ["shape", "layers", "system", "format", "bytes/weight", "floor ms", "step ms"]
    columns += ["x floor", "tok/s"]
    out = ["| " + " | ".join(columns) + " |"]
    out.append("|" + "---|" * len(columns))
    for row in rows:
        timed = row["system"] != "transformers generate"  # no step of its own
        cells = [
            row["shape"].rsplit("/", 1)[-1],
            str(row["layers"]),
            row["system"],
            row["format"],
            _cell(row["bytes_per_weight"], 2),
            _cell(row["floor_ms"], 1) if timed else "",
            _cell(row["step_ms"], 1) if timed else "",
            _cell(row["step_over_floor"], 2) if timed else "",
            _cell(row["tokens_per_second"], 1),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cpu_slug() -> str:
    name = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    slug = _cpu_slug()
    parser.add_argument("--scale", type=Path, default=Path(f"results/scale/{slug}.jsonl"))
    parser.add_argument(
        "--llamacpp", type=Path, default=Path(f"results/scale/llamacpp-{slug}.jsonl")
    )
    args = parser.parse_args()
    print(markdown(table_rows(_read(args.scale), _read(args.llamacpp))))


if __name__ == "__main__":
    main()
