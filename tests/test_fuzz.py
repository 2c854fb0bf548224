"""A configuration fuzzer (issue #34): every registered planner x cost model x proxy x
drafter set x sampling settings x batch size x dtype x kernels, on tiny models.

Each drawn run either completes or raises one of :data:`DOCUMENTED` errors; any other
exception fails. Every completed run returns valid tokens (ids in the vocabulary, no more
than asked), and, in float32 and bfloat16 alike (the exactness contract, issue #29):

* a greedy run equals plain decoding (the ``autoregressive`` planner) token for token, row
  by row for a batch;
* a seeded position-keyed sampled run (the default scheme, issue #35) equals plain sampling
  with the same seed token for token, row ``r`` of a batch with seed ``seed + r``. Runs
  under the ``rejection`` scheme are checked for valid tokens only: their tokens depend on
  the drafts by design (their distribution is what the chi-square tests check).

Every registered planner gets an equal share of the budget: ``KNAPSPEC_FUZZ_EXAMPLES``
examples in all, 16 by default (two per planner, the same ones every run); ``nox -s fuzz``
runs 2,000 with fresh draws.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from knapspec import SpeculativeDecoder
from knapspec.config import COMPONENT_REGISTRIES, ConfigError, load_builtin_components
from knapspec.drafters import DRAFTERS
from knapspec.model.engine import SublayerEngine
from knapspec.testing import synthetic_profile, tiny_llama, tiny_model
from test_lossless_drafting import FORCING

load_builtin_components()

#: Examples over all planners (each planner gets an equal share, at least one).
EXAMPLES = int(os.environ.get("KNAPSPEC_FUZZ_EXAMPLES", "16"))
#: "damped": a Llama whose deep layers move the residual little, so drafts are accepted
#: often and rejected sometimes (random models of the other families rarely agree).
FAMILIES = ("damped", "llama", "qwen2", "qwen3", "mistral", "gemma3")
DTYPES = (torch.float32, torch.bfloat16)
#: The errors a configuration may rightly end in (each documented in
#: docs/configuration.md or docs/troubleshooting.md): a config the schema refuses.
DOCUMENTED: tuple[type[Exception], ...] = (ConfigError,)


@functools.cache
def _engine(family: str, dtype: torch.dtype, kernels: str) -> SublayerEngine:
    if family == "damped":
        model = tiny_llama(6, vocab_size=97, hidden_size=64, layer_damping=0.3, head_scale=8.0)
    else:
        model = tiny_model(family, num_layers=4, seed=FAMILIES.index(family))
    model = model.to(dtype)
    return SublayerEngine(model, kernels=kernels)


@functools.cache
def _profile_path(family: str, dtype: torch.dtype, kernels: str, root: str) -> str:
    engine = _engine(family, dtype, kernels)
    path = Path(root) / f"{family}-{str(dtype).removeprefix('torch.')}-{kernels}.json"
    synthetic_profile(engine).save(path)
    return str(path)


PLANNER_NAMES = sorted(COMPONENT_REGISTRIES["planner"].names())


@st.composite
def configurations(draw: st.DrawFn, planner: str, num_layers: int) -> dict[str, Any]:
    """A config for ``planner`` drawn from the other registries, with the decoder's own
    settings; half the planners' own fields that name layers are drawn to fit the model."""
    section: dict[str, Any] = {"name": planner}
    if planner in FORCING and draw(st.sampled_from([True, True, False])):
        section.update(FORCING[planner])  # gates opened: the planner drafts
    if planner == "knapsack":
        drafters = draw(st.sets(st.sampled_from(sorted(DRAFTERS.names())), min_size=1))
        section["drafters"] = sorted(drafters)
    if planner == "early-exit" and draw(st.booleans()):  # else its default, maybe too deep
        section["exit_layer"] = draw(st.integers(1, num_layers))
    if planner == "static":
        items = st.lists(st.integers(0, 2 * num_layers - 1), max_size=num_layers, unique=True)
        section["skipped_items"] = sorted(draw(items))
        section["draft_length"] = draw(st.integers(0, 6))
    return {
        "planner": section,
        "cost_model": {"name": draw(st.sampled_from(sorted(COMPONENT_REGISTRIES["cost_model"])))},
        "proxy": {"name": draw(st.sampled_from(sorted(COMPONENT_REGISTRIES["proxy"].names())))},
        "max_draft_length": draw(st.integers(1, 8)),
        "confidence_threshold": draw(st.sampled_from([0.0, 0.7])),
        "window_rounds": draw(st.integers(1, 5)),
    }


@st.composite
def samplings(draw: st.DrawFn) -> dict[str, Any] | None:
    if not draw(st.booleans()):
        return None  # greedy
    return {
        "do_sample": True,
        "temperature": draw(st.sampled_from([0.5, 1.0, 1.5])),
        "top_k": draw(st.sampled_from([0, 5])),
        "top_p": draw(st.sampled_from([1.0, 0.9])),
        "seed": draw(st.integers(0, 2**32)),
        "verification": draw(st.sampled_from(["position-keyed", "rejection"])),
    }


@st.composite
def prompts(draw: st.DrawFn, vocab_size: int) -> list[int]:
    """Random ids, half the time with a repeated stretch (where lookup drafts)."""
    head = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=16))
    if draw(st.booleans()):
        head = head + head[: draw(st.integers(1, len(head)))] * 2
    return head


def _plain(
    engine: SublayerEngine,
    prompt: list[int],
    max_new_tokens: int,
    sampling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Plain decoding (greedy, or sampled with ``sampling``'s seed) of one prompt."""
    decoder = SpeculativeDecoder(engine, {"planner": {"name": "autoregressive"}})
    return decoder.generate(
        torch.tensor(prompt), max_new_tokens=max_new_tokens, sampling=sampling
    ).tokens


def _row_sampling(sampling: dict[str, Any] | None, row: int) -> dict[str, Any] | None:
    """The sampling a batch's row ``row`` runs with alone: its seed is ``seed + row``."""
    if sampling is None:
        return None
    return {**sampling, "seed": (sampling["seed"] + row) % 2**64}


@pytest.mark.parametrize("planner", PLANNER_NAMES)
@settings(
    max_examples=max(1, EXAMPLES // len(PLANNER_NAMES)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=EXAMPLES <= 50,  # the CI budget is the same examples every run
)
@given(data=st.data())
def test_every_drawn_configuration_is_lossless_or_a_documented_error(
    planner: str, data: st.DataObject, tmp_path: Path
) -> None:
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    kernels = data.draw(st.sampled_from(["f.linear", "transposed"]), label="kernels")
    engine = _engine(family, dtype, kernels)
    config = data.draw(configurations(planner, engine.num_layers), label="config")
    config["cost_model"]["profile"] = _profile_path(family, dtype, kernels, str(tmp_path))
    sampling = data.draw(samplings(), label="sampling")
    batch = data.draw(st.integers(1, 3), label="batch")
    rows = [data.draw(prompts(engine.vocab_size), label=f"prompt {i}") for i in range(batch)]
    max_new_tokens = data.draw(st.integers(1, 16), label="max_new_tokens")
    try:
        decoder = SpeculativeDecoder(engine, config)
        if batch == 1:
            one = decoder.generate(rows[0], max_new_tokens=max_new_tokens, sampling=sampling)
            outputs, stats = [one.tokens], [one.stats]
        else:
            batched = [torch.tensor(row) for row in rows]
            result = decoder.generate(batched, max_new_tokens=max_new_tokens, sampling=sampling)
            outputs, stats = result.tokens, result.stats
    except DOCUMENTED as error:
        event(f"documented error: {type(error).__name__}: {str(error)[:80]}")
        return
    # Shown by --hypothesis-show-statistics: how often the runs draft at all.
    event(f"drafted: {any(row.drafted_tokens for row in stats)}")
    assert len(outputs) == batch
    repeatable = sampling is None or sampling["verification"] == "position-keyed"
    for index, (row, tokens) in enumerate(zip(rows, outputs, strict=True)):
        assert tokens.dtype == torch.long and 1 <= tokens.numel() <= max_new_tokens
        assert int(tokens.min()) >= 0 and int(tokens.max()) < engine.vocab_size
        if repeatable:
            alone = _plain(engine, row, max_new_tokens, _row_sampling(sampling, index))
            assert torch.equal(tokens, alone), (config, sampling, row)


def test_the_fuzzer_draws_from_every_registry() -> None:
    """A newly registered component is drawn without editing this file."""
    drawn: dict[str, set[str]] = {"cost_model": set(), "proxy": set()}

    @settings(max_examples=100, deadline=None, derandomize=True, database=None)
    @given(configurations("knapsack", 4))
    def collect(config: dict[str, Any]) -> None:
        for kind in drawn:
            drawn[kind].add(config[kind]["name"])

    collect()
    for kind, names in drawn.items():
        assert names == set(COMPONENT_REGISTRIES[kind].names()), kind
    assert set(PLANNER_NAMES) == set(COMPONENT_REGISTRIES["planner"].names())


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_decoding_reference_runs(dtype: torch.dtype) -> None:
    engine = _engine("llama", dtype, "f.linear")
    assert _plain(engine, [1, 2, 3], 4).numel() == 4
