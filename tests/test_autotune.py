"""Kernel tables: selection from timings, the end-to-end check, the per-machine cache, and
the engine running whatever table it is given (outputs unchanged to rounding)."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from tests.tiny_models import tiny_model

from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.onednn import onednn_available, packed_count, release_packed
from knapspec.model.kernels.table import KERNELS, SMALL_ROWS, KernelTable
from knapspec.model.tuning.autotune import (
    KERNELS_ENV,
    KernelKey,
    LinearRole,
    TuneResult,
    choose_large,
    choose_table,
    kernel_table_path,
    linear_roles,
    load_or_tune,
    resolve_kernel_table,
    tune_kernel_table,
)

Q, K, GATE = (64, 64), (32, 64), (128, 64)


def _role(name: str, shape: tuple[int, int], parts: tuple[str, ...] = ()) -> LinearRole:
    return LinearRole(name, shape, (), parts)


def _timings(
    roles: list[LinearRole], seconds: dict[str, float], *, rows: int = 2
) -> dict[tuple[str, int, str], float]:
    """Every role at ``seconds[kernel]`` for row counts 1..rows."""
    return {
        (role.name, r, kernel): value
        for role in roles
        for r in range(1, rows + 1)
        for kernel, value in seconds.items()
    }


def test_the_faster_kernel_is_chosen_per_shape_and_row_count() -> None:
    roles = [_role("q", Q), _role("k", K)]
    timings = _timings(roles, {"f.linear": 1.0, "transposed": 2.0})
    timings[("k", 2, "transposed")] = 0.5  # k's shape at 2 rows prefers the transposed kernel
    table = choose_table(timings, roles, [], max_rows=2)
    assert table.kernel(Q, 1) == table.kernel(Q, 2) == "f.linear"
    assert table.kernel(K, 1) == "f.linear"
    assert table.kernel(K, 2) == "transposed"
    assert table.source == "measured"


def test_roles_sharing_a_shape_are_chosen_on_their_summed_time() -> None:
    roles = [_role("q", Q), _role("o", Q)]
    timings = _timings(roles, {"f.linear": 1.0, "transposed": 1.0}, rows=1)
    timings[("q", 1, "transposed")] = 0.5  # q gains 0.5 ...
    timings[("o", 1, "transposed")] = 1.7  # ... o loses 0.7: F.linear wins overall
    assert choose_table(timings, roles, [], max_rows=1).kernel(Q, 1) == "f.linear"


@pytest.mark.parametrize("other", [1.0, 0.99, 0.975])
def test_ties_within_the_margin_go_to_f_linear(other: float) -> None:
    roles = [_role("q", Q)]
    timings = _timings(roles, {"f.linear": 1.0, "transposed": other, "transposed-padded": other})
    table = choose_table(timings, roles, [], max_rows=2, margin=0.03)
    assert table.is_plain and table.fingerprint() == "f.linear"


def test_fusion_is_chosen_only_where_the_fused_product_beats_its_parts() -> None:
    parts = [_role("q", Q), _role("k", K), _role("v", K)]
    fused = [_role("qkv", GATE, ("q", "k", "v"))]
    timings = _timings(parts, {"f.linear": 1.0, "transposed": 1.0})
    timings |= _timings(fused, {"f.linear": 2.0, "transposed": 2.0})  # 2.0 < 3 x 1.0
    for kernel in ("f.linear", "transposed"):
        timings[("qkv", 2, kernel)] = 2.95  # within the margin of 3.0: separate
    table = choose_table(timings, parts, fused, max_rows=2)
    assert table.fused("qkv", 1) and not table.fused("qkv", 2)
    assert not table.fused("gate_up", 1)  # a group that was not timed is never fused


def test_row_counts_without_timings_run_f_linear() -> None:
    roles = [_role("q", Q)]
    timings = _timings(roles, {"f.linear": 1.0, "transposed": 0.1}, rows=1)
    table = choose_table(timings, roles, [], max_rows=3)
    assert [table.kernel(Q, r) for r in (1, 2, 3, 4)] == [
        "transposed",
        "f.linear",
        "f.linear",
        "f.linear",  # beyond max_rows
    ]


def test_tuning_with_an_injected_timer_keeps_f_linear_on_a_tie() -> None:
    """A timer that counts calls makes every kernel cost the same per call: every shape
    ties (F.linear), and the whole-step check finds no gain anywhere it looks, so the
    rows it checks run unfused; rows it does not check fuse (one call instead of three)."""
    engine = SublayerEngine(tiny_model("llama", seed=1), kernels="f.linear")
    engine = SublayerEngine(engine.model, kernels="transposed")  # fused, any table
    ticks = itertools.count()
    result = tune_kernel_table(
        engine, max_rows=4, repeats=1, validate_rows=(1, 2), timer=lambda: float(next(ticks))
    )
    table = result.table
    assert all(name == "f.linear" for names in table.choices.values() for name in names)
    assert [table.fused("qkv", r) for r in (1, 2, 3, 4)] == [False, False, True, True]
    # Every shape tied at the large row counts too, so no large-product check ran.
    assert not table.large
    assert [check.chosen for check in result.checks] == ["f.linear", "f.linear"]
    assert set(result.checks[0].seconds) == {"f.linear", "measured", "transposed"}
    assert engine.kernels == table  # the engine runs what was chosen


def test_a_large_product_kernel_must_win_at_every_large_row_count() -> None:
    roles = [_role("q", Q), _role("k", K), _role("gate", GATE)]
    seconds = {"f.linear": 1.0, "onednn": 1.0}
    timings = {
        (role.name, rows, kernel): value
        for role in roles
        for rows in (64, 512)
        for kernel, value in seconds.items()
    }
    timings[("q", 64, "onednn")] = timings[("q", 512, "onednn")] = 0.5  # wins at both
    timings[("k", 64, "onednn")] = 0.5  # wins at 64 only
    timings[("gate", 64, "onednn")] = timings[("gate", 512, "onednn")] = 0.98  # within margin
    assert choose_large(timings, roles, (64, 512), margin=0.03) == {Q: "onednn"}


def test_a_table_with_large_kernels_round_trips_and_runs_them_over_max_rows() -> None:
    table = KernelTable(max_rows=2, choices={Q: ("transposed", "f.linear")}, large={Q: "onednn"})
    again = KernelTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert again == table and again.fingerprint() == table.fingerprint()
    assert [table.kernel(Q, rows) for rows in (1, 2, 3, 500)] == [
        "transposed",
        "f.linear",
        "onednn",
        "onednn",
    ]
    assert table.kernel(K, 500) == "f.linear" and "rows 3+ onednn" in table.summary()
    assert table.with_large({}).fingerprint() != table.fingerprint()
    # A table with no large kernels keeps the fingerprint it had before they existed.
    legacy = {"max_rows": 2, "choices": {"64x64": ["transposed", "f.linear"]}, "fuse": {}}
    assert table.with_large({}).fingerprint() == _legacy_fingerprint(legacy)
    with pytest.raises(ValueError, match="unknown kernel"):
        KernelTable(max_rows=1, large={Q: "fastest"})


def test_a_table_running_the_compiled_kernel_names_its_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile timed with one build of row_linear.c, or of the layer operations beside
    it, is not reused with another."""
    from knapspec.model.kernels import table as kernels

    table = KernelTable(max_rows=1, choices={Q: ("row-linear",)}, large={Q: "row-linear"})
    plain_kernels = KernelTable(max_rows=1, choices={Q: ("transposed",)})
    untouched = plain_kernels.fingerprint()
    for library in (kernels.ROW_LINEAR_LIBRARY, kernels.LAYER_OPS_LIBRARY):
        before = table.fingerprint()
        edited = tmp_path / library.source.name
        edited.write_text(library.source.read_text() + "\n/* edited */\n")
        monkeypatch.setattr(library, "source", edited)
        assert table.fingerprint() != before
    assert plain_kernels.fingerprint() == untouched  # no compiled kernel: nothing to name


def _legacy_fingerprint(data: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this build")
def test_an_engine_reorders_its_onednn_weights_when_it_adopts_the_table() -> None:
    """No product pays a reorder: the first verification of a new width would otherwise
    be timed slow by the cost models."""
    model = tiny_model("llama", seed=6)
    plain = SublayerEngine(model, kernels="f.linear")
    shapes = sorted({role.shape for roles in linear_roles(plain) for role in roles})
    table = KernelTable(
        max_rows=4,
        choices={shape: ("f.linear", "onednn", "f.linear", "f.linear") for shape in shapes},
        large={shapes[0]: "onednn"},
    )
    release_packed()
    # exact=False adopts the table as given (an exact engine adopts what the row-invariance
    # probe lets through, oneDNN in blocks included: tests/test_exactness.py).
    engine = SublayerEngine(model, kernels=table, exact=False)
    before = packed_count()
    assert before > 0
    ids = torch.randint(0, engine.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    cache = engine.new_cache(40)
    engine.forward(ids[:-2], 0, cache)  # a 28-row prefill: large products
    engine.forward(ids[-2:], 28, cache)  # a 2-row step: oneDNN everywhere
    assert packed_count() == before  # every copy was made up front
    release_packed()


def test_non_cpu_devices_and_other_dtypes_get_the_framework_products() -> None:
    engine = SublayerEngine(tiny_model("llama", seed=1))
    meta = attrs.make_class("Stub", ["device", "dtype"])(torch.device("meta"), torch.float32)
    assert resolve_kernel_table(meta, "auto").is_plain  # type: ignore[arg-type]
    assert resolve_kernel_table(meta, "transposed").source == "framework"  # type: ignore[arg-type]
    bf16_model = copy.deepcopy(tiny_model("llama", seed=1)).to(torch.bfloat16)
    bf16 = SublayerEngine(bf16_model, exact=False)
    assert bf16.kernels.is_plain and bf16.kernels.source == "framework"
    assert all(f is None for f in bf16.fusions("qkv"))  # the model's weights untouched
    # The exact engine (the default) runs the framework's table where it passes the
    # row-invariance probe, else the probe's choice.
    assert SublayerEngine(bf16_model).kernels.source == "framework+row-invariant"
    assert engine.kernels.source == "measured+row-invariant"
    assert SublayerEngine(tiny_model("llama", seed=1), exact=False).kernels.source == "measured"


def test_the_switches_force_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the exactness contract the switches (``kernels="f.linear"``,
    ``$KNAPSPEC_KERNELS``) force the framework's products; with it (the default) the forced
    table is then made row-invariant, F.linear kept wherever it passes the probe here."""
    model = tiny_model("qwen3", seed=2)
    assert SublayerEngine(model, kernels="f.linear", exact=False).kernels.is_plain
    exact = SublayerEngine(model, kernels="f.linear")
    assert exact.invariance is not None
    plain_passes = all(
        name == "f.linear" or "f.linear" in exact.invariance.failed.get(shape, ())
        for shape, name in exact.invariance.kernels.items()
    )
    assert plain_passes
    monkeypatch.setenv(KERNELS_ENV, "f.linear")
    assert SublayerEngine(model, exact=False).kernels.is_plain
    monkeypatch.setenv(KERNELS_ENV, "fastest")
    with pytest.raises(ValueError, match="KNAPSPEC_KERNELS"):
        SublayerEngine(model)
    table = SublayerEngine(model, kernels="transposed", fuse_projections=False, exact=False).kernels
    assert not table.is_plain and not table.fused("qkv", 1)


def _fake_result(engine: SublayerEngine, kernel: str) -> TuneResult:
    separate, fused = linear_roles(engine)
    shapes = sorted({role.shape for role in (*separate, *fused)})
    table = attrs.evolve(KernelTable.uniform(shapes, kernel, fuse=False), source="measured")
    return TuneResult(KernelKey.for_engine(engine), table, 0.0, {}, ())


def test_the_table_is_cached_per_key_and_a_changed_key_measures_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    engine = SublayerEngine(tiny_model("llama", seed=4), kernels="f.linear")
    calls: list[int] = []

    def tune(engine: SublayerEngine, **_: Any) -> TuneResult:
        calls.append(torch.get_num_threads())
        return _fake_result(engine, "transposed")

    first = load_or_tune(engine, tune=tune)
    again = load_or_tune(engine, tune=tune)
    assert calls == [torch.get_num_threads()] and again == first
    path = kernel_table_path(KernelKey.for_engine(engine))
    assert path.parent == tmp_path / "kernels" and path.exists()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # another thread count is another key
    try:
        load_or_tune(engine, tune=tune)
    finally:
        torch.set_num_threads(threads)
    assert calls == [threads, threads + 1]
    path.write_text("{not json", encoding="utf-8")  # a corrupt cache file is replaced
    with pytest.warns(RuntimeWarning, match="unreadable"):
        load_or_tune(engine, tune=tune)
    assert len(calls) == 3 and json.loads(path.read_text())["table"]["source"] == "measured"


def test_a_changed_table_changes_the_profile_key() -> None:
    from knapspec.costmodels.profile import ProfileKey

    model = tiny_model("llama", seed=5)
    plain = ProfileKey.for_engine(SublayerEngine(model, kernels="f.linear", exact=False))
    fixed = ProfileKey.for_engine(SublayerEngine(model, kernels="transposed", exact=False))
    assert plain.kernel_table == "f.linear" and fixed.kernel_table not in ("", "f.linear")
    assert set(plain.differences(fixed)) == {"kernel_table"}
    assert plain.digest() != fixed.digest()


def _mixed_table(engine: SublayerEngine, seed: int) -> KernelTable:
    """Every shape and row count on a kernel drawn at random, fusion at random."""
    generator = torch.Generator().manual_seed(seed)
    names = list(KERNELS)
    separate, fused = linear_roles(engine)

    def draw(n: int) -> list[int]:
        return [int(i) for i in torch.randint(0, n, (SMALL_ROWS,), generator=generator)]

    return KernelTable(
        choices={
            role.shape: tuple(names[i] for i in draw(len(names))) for role in (*separate, *fused)
        },
        fuse={group: tuple(bool(i) for i in draw(2)) for group in ("qkv", "gate_up")},
        large={role.shape: names[draw(len(names))[0]] for role in separate},
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_any_table_gives_the_same_logits_to_rounding(family: str) -> None:
    model = tiny_model(family, seed=3)
    plain = SublayerEngine(model, kernels="f.linear")
    ids = torch.randint(0, plain.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    engines = [SublayerEngine(model, kernels=_mixed_table(plain, seed)) for seed in range(3)]
    for width in (1, 3, 4, 11, 16, 17):  # 17: over max_rows, the large-product kernels
        outs = []
        for engine in (plain, *engines):
            cache = engine.new_cache(32)
            engine.forward(ids[:-width], 0, cache)
            outs.append(engine.forward(ids[-width:], ids.numel() - width, cache).logits)
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.real_model
@pytest.mark.slow
def test_greedy_real_text_is_the_same_whichever_kernels_run() -> None:
    from knapspec import SpeculativeDecoder, StaticPlanner, SublayerMask
    from knapspec.bench.prompts import long_input_prompt
    from knapspec.model.loading.provision import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(progress=False)
    eos = model.generation_config.eos_token_id
    plain = SublayerEngine(model, kernels="f.linear")
    tables = ["f.linear", "transposed", _mixed_table(plain, 0)]
    # Drafts of 4 tokens skipping a few items: 1-row draft steps and 1-5-row verify steps.
    mask = SublayerMask.from_skipped(plain.num_layers, [9, 21, 33, 45])
    for seed in range(2):
        prompt = long_input_prompt(tokenizer, 96, seed=seed)
        ids = prompt.unsqueeze(0)
        reference = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
        )[0, prompt.numel() :]
        for table in tables:
            engine = SublayerEngine(model, kernels=table)
            planner = StaticPlanner(mask, 4)
            decoder = SpeculativeDecoder(engine, planner=planner, confidence_threshold=0.0)
            result = decoder.generate(prompt, max_new_tokens=16, eos_token_id=eos)
            assert torch.equal(result.tokens, reference), f"prompt {seed}, table {table!r}"
            assert result.stats.drafted_tokens > 0
