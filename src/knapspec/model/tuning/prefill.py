"""The kernels of a cold prefill's many-row products, timed once per machine.

An exact engine runs every product through row-invariant kernels
(:mod:`knapspec.model.tuning.invariance`), except a *cold prefill* (a prompt from position 0 while
chunk invariance is off): no verification and no one-token step has its shape, and plain
and speculative decoding share it, so it may run whatever is fastest. Which that is
depends on the machine, the dtype and the prompt's length, so whole cold prefills are
timed at :data:`PREFILL_LENGTHS` tokens through each candidate, the measured table's
kernels for many rows (``F.linear`` where it has none) and the row-invariant ones, and the
faster runs: the row-invariant kernels up to the longest timed prompt below which they won
every length (:class:`RowSwitch`), the measured ones beyond. Whole prefills rather than
single products, because the products alone misjudge it: in bf16 the packed row-invariant
product has beaten ``F.linear`` by a little on isolated 256- and 1,024-row products and by
more on whole SmolLM2 prefills (its weights are already packed and warm from
decoding), while in fp32 oneDNN's packed product stayed ahead, and on AMX tiles the
framework's products won bf16 prefills (figures: ``results/engine/HISTORY.md``).
The timings are cached under ``cache_root()/prefill/`` like the probe's verdicts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.model import cachefiles
from knapspec.model.kernels.row_linear import build_tag
from knapspec.model.kernels.table import (
    KERNELS,
    PLAIN_KERNEL,
    Kernel,
    KernelTable,
    Shape,
)
from knapspec.model.tuning.autotune import KernelKey
from knapspec.model.tuning.timing import DEFAULT_MARGIN, linear_roles
from knapspec.paths import cache_root

if TYPE_CHECKING:
    from knapspec.model.tuning.tunable import TunableEngine

#: Prompt lengths (tokens) whole cold prefills are timed at: chat turns to documents.
PREFILL_LENGTHS: tuple[int, ...] = (64, 512, 2048)

#: Bump when the timing or the rule changes, so that cached timings are measured again.
PREFILL_REVISION = 2

#: The most weight-elements x tokens one timed prefill may multiply (a 2,048-token prompt
#: through a 0.75B model): longer prompts are not timed on bigger models, whose 2,048-token
#: prefills take far longer than a decode step on a CPU (each length is timed 5 times). The
#: shortest length is always timed; lengths past the last timed one follow its verdict.
PREFILL_BUDGET = 1.5e12

#: The candidates' names in the timings.
CANDIDATES = ("measured", "row-invariant")

#: Per weight shape, a product kernel (the engine's many-row dispatch).
Dispatch = dict[tuple[int, ...], Kernel]

#: Seconds of one cold prefill per (candidate, prompt length).
Timings = dict[tuple[str, int], float]

#: Seconds of one cold prefill of ``length`` tokens with ``dispatch`` as its many-row kernels.
PrefillTimer = Callable[[Mapping[tuple[int, ...], Kernel], int], float]


@attrs.frozen
class RowSwitch:
    """A kernel: ``up_to_rows`` rows or fewer through ``small``, more through ``large``.

    Called like every kernel: ``x (..., in)``, ``weight (out, in)``, ``bias (out,) | None``
    to ``(..., out)``.
    """

    small: Kernel
    large: Kernel
    up_to_rows: int

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return (self.small if rows <= self.up_to_rows else self.large)(x, weight, bias)


def switch_rows(
    timings: Timings, lengths: Sequence[int], *, margin: float = DEFAULT_MARGIN
) -> int | None:
    """Up to how many rows the row-invariant kernels run: the longest of ``lengths`` such
    that they beat the measured ones by more than ``margin`` there and at every shorter
    length; 0 where they lost at the shortest; None where they won at every length.

    Raises:
        KeyError: a length the answer depends on was not timed.
    """
    up_to = 0
    for length in sorted(lengths):
        fast, slow = timings[(CANDIDATES[1], length)], timings[(CANDIDATES[0], length)]
        if fast >= (1 - margin) * slow:
            return up_to
        up_to = length
    return None


def time_prefills(
    candidates: Mapping[str, Mapping[tuple[int, ...], Kernel]],
    lengths: Sequence[int],
    timer: PrefillTimer,
    *,
    repeats: int = 2,
    margin: float = DEFAULT_MARGIN,
) -> Timings:
    """Best-of-``repeats`` seconds of each of the two :data:`CANDIDATES` per length,
    shortest first, interleaved so that a machine's drift falls on both alike; longer
    lengths are not timed once the row-invariant kernels lost (:func:`switch_rows` is then
    decided: an fp32 engine whose oneDNN products win at once times one short prompt)."""
    for dispatch in candidates.values():  # warm-up: packs, reorders, faults pages in
        timer(dispatch, min(lengths))
    best: Timings = {}
    for length in sorted(lengths):
        for _ in range(repeats):
            for name in CANDIDATES:
                seconds = timer(candidates[name], length)
                best[(name, length)] = min(best.get((name, length), seconds), seconds)
        if best[(CANDIDATES[1], length)] >= (1 - margin) * best[(CANDIDATES[0], length)]:
            break
    return best


def _cache_path(engine: TunableEngine, measured: KernelTable, exact: KernelTable) -> Path:
    key = KernelKey.for_engine(engine).digest()
    name = f"{key}-{measured.fingerprint()}-{exact.fingerprint()}-r{PREFILL_REVISION}"
    return cache_root() / "prefill" / f"{name}{build_tag(engine.dtype)}.json"


def _parse(text: str) -> Timings:
    data = json.loads(text)
    timings = {(str(name), int(length)): float(s) for name, length, s in data["timings"]}
    if {name for name, _ in timings} - set(CANDIDATES):
        raise ValueError(f"candidates other than {CANDIDATES}")
    return timings


def _render(timings: Timings) -> str:
    rows = [[name, length, seconds] for (name, length), seconds in sorted(timings.items())]
    return json.dumps({"timings": rows}, indent=1) + "\n"


def _names(table: KernelTable) -> dict[Shape, str]:
    return {shape: name for shape, name in table.large.items() if name != PLAIN_KERNEL}


def prefill_dispatch(
    engine: TunableEngine,
    measured: KernelTable,
    exact: KernelTable,
    timer: PrefillTimer,
    *,
    lengths: Sequence[int] = PREFILL_LENGTHS,
    use_cache: bool = True,
) -> Dispatch:
    """Per weight shape, the kernel of a cold prefill's products over ``max_rows`` rows
    (module docstring): ``measured``'s many-row kernels (the table before the
    row-invariance probe), ``exact``'s, or a :class:`RowSwitch` of both. Shapes left out
    run ``F.linear`` (the engine's fallback). ``timer`` runs one cold prefill (the engine's)
    at each of ``lengths`` shorter than the model's context."""
    slow = measured.large_dispatch()
    fast = exact.large_dispatch()
    if _names(measured) == _names(exact):
        return slow
    lengths = timed_lengths(engine, lengths)
    if not lengths:
        return slow

    def measure() -> Timings:
        return time_prefills(dict(zip(CANDIDATES, (slow, fast), strict=True)), lengths, timer)

    def valid(cached: Timings) -> str | None:
        try:
            switch_rows(cached, lengths)
        except KeyError:
            return "lacks some prompt lengths"
        return None

    timings = (
        cachefiles.load_or_measure(
            _cache_path(engine, measured, exact),
            parse=_parse,
            valid=valid,
            measure=measure,
            render=_render,
            what="cold-prefill timings",
            measures="cold prefills through the measured and the row-invariant product "
            "kernels (a few seconds)",
        )
        if use_cache
        else measure()
    )
    up_to = switch_rows(timings, lengths)
    if up_to is None:
        return fast
    if up_to == 0:
        return slow
    plain = KERNELS[PLAIN_KERNEL]
    return {
        shape: RowSwitch(fast.get(shape, plain), slow.get(shape, plain), up_to)
        for shape in {*slow, *fast}
    }


def timed_lengths(
    engine: TunableEngine, lengths: Sequence[int], budget: float = PREFILL_BUDGET
) -> list[int]:
    """The prompt lengths of ``lengths`` timed for ``engine``: shorter than its context, and
    within ``budget`` weight-elements x tokens (:data:`PREFILL_BUDGET`; the shortest always).
    :func:`switch_rows` then extends the last timed length's verdict to longer prompts."""
    separate, _ = linear_roles(engine)
    elements = sum(weight.numel() for role in separate for weight, _ in role.tensors)
    usable = sorted(n for n in lengths if n < engine.max_context)
    return [n for i, n in enumerate(usable) if i == 0 or elements * n <= budget]


def describe(dispatch: Mapping[tuple[int, ...], Kernel]) -> dict[str, str]:
    """Per shape name, what a cold prefill runs (for reports and logs)."""
    names = {kernel: name for name, kernel in KERNELS.items()}

    def name_of(kernel: Kernel) -> str:
        if isinstance(kernel, RowSwitch):
            small, large = name_of(kernel.small), name_of(kernel.large)
            return f"{small} up to {kernel.up_to_rows} rows, then {large}"
        return names.get(kernel, repr(kernel))

    return {
        "x".join(map(str, shape)): name_of(kernel) for shape, kernel in sorted(dispatch.items())
    }


__all__ = [
    "CANDIDATES",
    "PREFILL_LENGTHS",
    "PREFILL_REVISION",
    "Dispatch",
    "RowSwitch",
    "describe",
    "prefill_dispatch",
    "switch_rows",
    "time_prefills",
    "timed_lengths",
]
