"""The exactness contract, tested directly: verifying ``k`` tokens in one pass gives logits
and K/V bitwise equal to ``k`` one-token steps, in float32 and bfloat16, for Llama and
Qwen3, every ``k`` and cache length, single sequences and every batch layout — and the
checks have the power to catch a row-count-dependent kernel (the mutant tests below).
"""

from __future__ import annotations

import functools
import os

import attrs
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.row_attention import attend_rows, kernel_available
from knapspec.model.kernels.table import FUSION_GROUPS, KERNELS, Kernel, KernelTable, blocked
from knapspec.model.passes.exact_pass import ExactLayerPass
from knapspec.model.tuning.invariance import is_row_invariant, row_invariant_table
from knapspec.testing.exactness import (
    RowCountingKernel,
    batch_mismatches,
    tree_mismatches,
    verification_mismatches,
)
from knapspec.testing.models import tiny_model

FAMILIES = ("llama", "qwen3", "gemma3")
DTYPES = (torch.float32, torch.bfloat16)
VOCAB = 97


@functools.cache
def _engine(family: str, dtype: torch.dtype, exact: bool = True) -> SublayerEngine:
    model = tiny_model(family).to(dtype)
    return SublayerEngine(model, exact=exact, kernels=None if exact else "f.linear")


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_attention_kernel_builds_here(dtype: torch.dtype) -> None:
    """CI machines have a C compiler; without it the engine falls back (tested below)."""
    assert kernel_available(dtype)


@given(
    family=st.sampled_from(FAMILIES),
    dtype=st.sampled_from(DTYPES),
    context=st.integers(1, 80),
    drafted=st.integers(1, 17),
    seed=st.integers(0, 10_000),
)
@example(family="qwen3", dtype=torch.bfloat16, context=77, drafted=13, seed=114)  # AMX Xeon
def test_verification_equals_one_token_steps(
    family: str, dtype: torch.dtype, context: int, drafted: int, seed: int
) -> None:
    engine = _engine(family, dtype)
    problems = verification_mismatches(engine, _tokens(context, seed), _tokens(drafted, seed + 1))
    assert problems == []


@given(
    dtype=st.sampled_from(DTYPES),
    widths=st.lists(st.integers(1, 11), min_size=1, max_size=5),
    contexts=st.lists(st.integers(1, 40), min_size=5, max_size=5),
    layout=st.sampled_from(["auto", "padded", "split"]),
    seed=st.integers(0, 10_000),
)
def test_batched_verification_equals_each_row_alone(
    dtype: torch.dtype, widths: list[int], contexts: list[int], layout: str, seed: int
) -> None:
    engine = _engine("llama", dtype)
    rows = len(widths)
    problems = batch_mismatches(
        engine,
        [_tokens(contexts[r], seed + r) for r in range(rows)],
        [_tokens(widths[r], seed + 100 + r) for r in range(rows)],
        attention=layout,  # type: ignore[arg-type]
    )
    assert problems == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_batches_equal_each_row_alone(dtype: torch.dtype) -> None:
    engine = _engine("qwen3", dtype)
    problems = batch_mismatches(
        engine,
        [_tokens(n, n) for n in (3, 30, 17)],
        [_tokens(6, 50 + r) for r in range(3)],
        packed=False,
    )
    assert problems == []


@given(
    kernel=st.sampled_from(sorted(KERNELS)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 100),
)
def test_the_engine_keeps_the_contract_under_any_forced_kernel(
    kernel: str, dtype: torch.dtype, seed: int
) -> None:
    """A table forcing one kernel everywhere is probed: a kernel that breaks the contract
    here is replaced, so the exact engine stays exact whatever the table asked for."""
    model = tiny_model("llama").to(dtype)
    shapes = sorted({tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2})
    table = KernelTable.uniform(shapes, kernel, fuse=seed % 2 == 0)  # type: ignore[arg-type]
    engine = SublayerEngine(model, kernels=table)
    assert verification_mismatches(engine, _tokens(20, seed), _tokens(9, seed + 1)) == []


def test_rowwise_is_row_invariant_by_construction() -> None:
    weight = torch.randn(48, 32)
    assert is_row_invariant(KERNELS["rowwise"], weight, None)


# ----------------------------------------------------------------- the checks' power
@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_count_dependent_engine_fails_the_contract(family: str) -> None:
    """The mutant: the framework's own products and attention (what the engine ran before
    the contract). In float32 on this machine's BLAS they break it; the check sees it."""
    engine = _engine(family, torch.float32, exact=False)
    if is_row_invariant(KERNELS["f.linear"], torch.randn(64, 64), None):
        pytest.skip("this machine's F.linear happens to be row-invariant")
    assert verification_mismatches(engine, _tokens(30, 1), _tokens(11, 2))


#: The engine's paths a verification can take, and how to choose each (``EnginePaths``).
PATHS = {
    "layer-loop": {},
    "lean-items": {"compiled_loop": False},
    "general": {"lean_passes": False},
}


class _PathSpy:
    """Counts lean passes prepared and compiled layer loops that ran (the path taken)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prepared = self.looped = 0
        prepare, run_layers = ExactLayerPass.prepare.__func__, ExactLayerPass.run_layers  # type: ignore[attr-defined]

        def spy_prepare(cls: type[ExactLayerPass], *args: object, **kwargs: object) -> object:
            lean = prepare(cls, *args, **kwargs)
            self.prepared += lean is not None
            return lean

        def spy_run(lean: ExactLayerPass, *args: object, **kwargs: object) -> object:
            looped = run_layers(lean, *args, **kwargs)
            self.looped += looped is not None
            return looped

        monkeypatch.setattr(ExactLayerPass, "prepare", classmethod(spy_prepare))
        monkeypatch.setattr(ExactLayerPass, "run_layers", spy_run)

    def took(self, path: str) -> bool:
        if path == "layer-loop":
            return self.looped > 0
        if path == "lean-items":
            return self.prepared > 0 and self.looped == 0
        return self.prepared == 0


def _verify(check: str, engine: SublayerEngine) -> list[str]:
    """One check of the contract on ``engine``: a sequence, a batch or a token tree."""
    if check == "sequence":
        return verification_mismatches(engine, _tokens(12, 3), _tokens(5, 4))
    if check == "batch":
        contexts = [_tokens(n, n) for n in (9, 14, 5)]
        return batch_mismatches(engine, contexts, [_tokens(w, 40 + w) for w in (4, 6, 3)])
    parents = [-1, 0, 0, 1, 2, 3]
    return tree_mismatches(engine, _tokens(12, 3), _tokens(6, 4), parents, 5, _tokens(1, 5))


#: The drift of the row-count-dependent product (``KNAPSPEC_MUTANT_DRIFT=0`` removes it,
#: to show that the mutant arms then fail).
MUTANT_DRIFT = float(os.environ.get("KNAPSPEC_MUTANT_DRIFT", "1e-6"))


#: Per family, the weight shape the mutant product takes over (Llama's (64, 64) q/o; Gemma
#: 3's down product, its one (d, ff) weight), and how its engine is built: Gemma's fuses
#: gate/up at every row count so that the compiled loop serves it (a tiny model's measured
#: table may not fuse).
MUTANT_SHAPES = {"llama": (64, 64), "gemma3": (64, 128)}


@functools.cache
def _mutant_engine(family: str) -> SublayerEngine:
    if family == "llama":
        return _engine("llama", torch.float32)
    engine = SublayerEngine(tiny_model(family))
    table = engine.kernels
    engine.use_kernels(
        attrs.evolve(table, fuse={group: (True,) * table.max_rows for group in FUSION_GROUPS})
    )
    return engine


@pytest.mark.parametrize("mutant", [False, True], ids=["control", "mutant"])
@pytest.mark.parametrize("check", ["sequence", "batch", "tree"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("family", sorted(MUTANT_SHAPES))
def test_a_mutant_kernel_in_an_exact_engine_is_caught(
    family: str, path: str, check: str, mutant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bring back a row-count-dependent product behind the probe's back, on every path the
    engine verifies by, after the engine has already run (plans made, as in any suite
    order): the mutant must run there, and the contract check must fail. The control (the
    same kernel without the drift) runs there too and passes, so the drift alone is what
    the check caught. Llama, and Gemma 3 past its window (its contexts cross it)."""
    engine = _mutant_engine(family)
    with engine.use_paths(**PATHS[path]):
        assert _verify(check, engine) == []  # every plan made before the kernel changes
        spy = _PathSpy(monkeypatch)
        kernel = RowCountingKernel(MUTANT_DRIFT if mutant else 0.0, base=KERNELS["rowwise"])
        with engine.substituted_products(kernel, [MUTANT_SHAPES[family]]):
            problems = _verify(check, engine)
    assert kernel.multi_row_calls > 0, "the kernel never ran over several rows"
    assert spy.took(path), f"the check did not run the {path} path"
    assert bool(problems) == mutant, problems


def test_the_substituted_products_are_the_tables_again_afterwards() -> None:
    engine = _engine("llama", torch.float32)
    before, generation = dict(engine._dispatch), engine.kernel_generation
    kernel = RowCountingKernel(1e-6)
    with engine.substituted_products(kernel):
        assert all(set(k) == {kernel} for k in engine._dispatch.values())
    assert dict(engine._dispatch) == before
    assert engine.kernel_generation == generation + 2
    assert verification_mismatches(engine, _tokens(12, 3), _tokens(5, 4)) == []
    with pytest.raises(TypeError):  # a direct write would bypass the plans' refresh
        engine._dispatch[(64, 64)] = (kernel,)  # type: ignore[index]
    with pytest.raises(ValueError, match="no product of this engine has"):
        engine.substituted_products(kernel, [(3, 3)]).__enter__()


def test_the_probe_rejects_a_row_count_dependent_kernel() -> None:
    def drifting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias) * (1 + 1e-6 * (x.shape[0] > 3))

    assert not is_row_invariant(drifting, torch.randn(16, 16), None)


def _split_k_above(threshold: int) -> Kernel:
    """A mutant shaped like the kernel that broke bf16 exactness on an AMX Xeon: it
    accumulates in float32 and rounds once, as oneDNN does, but over more than
    ``threshold`` rows it sums the two halves of the inner dimension apart (a blocking
    chosen by the row count). Only the float32 summation order changes, so on random
    inputs a bfloat16 output rarely shows it."""

    def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        terms = x.float().unsqueeze(-2) * weight.float()  # (..., out, in)
        if rows > threshold:
            half = x.shape[-1] // 2
            total = terms[..., :half].sum(-1) + terms[..., half:].sum(-1)
        else:
            total = terms.sum(-1)
        if bias is not None:
            total = total + bias.float()
        return total.to(x.dtype)

    return kernel


@pytest.mark.parametrize("threshold", [2, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_probe_rejects_a_kernel_whose_summation_order_follows_the_row_count(
    threshold: int, dtype: torch.dtype
) -> None:
    """What the probe missed on the AMX Xeon: it probed random inputs, on which a changed
    float32 order rarely changes a bfloat16 output. The cancelling inputs expose it, past
    16 rows too (AMX's ``F.linear`` kept rows up to 32 and changed them from 33)."""
    assert not is_row_invariant(_split_k_above(threshold), torch.randn(32, 64).to(dtype), None)


@pytest.mark.parametrize("height", [2, 4, 16])
def test_a_kernel_in_blocks_of_its_safe_height_is_row_invariant_at_every_count(
    height: int,
) -> None:
    mutant = _split_k_above(height)
    weight = torch.randn(32, 64).to(torch.bfloat16)
    assert not is_row_invariant(mutant, weight, None)
    assert is_row_invariant(blocked(mutant, height), weight, None)
    assert not is_row_invariant(blocked(mutant, 2 * height), weight, None)


def test_the_mutant_forced_into_an_exact_bf16_engine_breaks_the_contract() -> None:
    """The AMX failure on any CPU: force the mutant past the probe into every product of
    an exact bfloat16 engine, and the contract test finds verifications that differ from
    one-token steps (with the probe in charge, the same seeds pass: the tests above)."""
    engine = SublayerEngine(tiny_model("qwen3").to(torch.bfloat16))
    mutant = RowCountingKernel(0.0, base=_split_k_above(2))
    with engine.substituted_products(mutant):
        broken = [
            seed
            for seed in range(40)
            if verification_mismatches(engine, _tokens(40, seed), _tokens(14, seed + 1))
        ]
    assert mutant.multi_row_calls > 0, "the mutant never ran over several rows"
    assert broken, "forcing a row-count-dependent kernel should break some verification"


def test_the_invariance_report_says_what_runs() -> None:
    engine = _engine("llama", torch.float32)
    report = row_invariant_table(engine, engine.kernels, use_cache=False)
    assert set(report.kernels) >= {"64x64", "97x64"}
    assert all(kernel in KERNELS for kernel in report.kernels.values())
    assert "97x64" in report.summary()


def test_the_fallback_attention_is_exact_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a compiler the engine attends one query at a time, which is a one-token
    step per row: still exact."""
    from knapspec.model.kernels import row_attention

    monkeypatch.setattr(row_attention, "load_library", lambda: None)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 5, 16, generator=generator)
    keys = torch.randn(2, 30, 16, generator=generator)
    values = torch.randn(2, 30, 16, generator=generator)
    lengths = torch.arange(26, 31)
    together = attend_rows(query, keys, values, lengths, 0.25)
    for i in range(5):
        alone = attend_rows(query[:, i : i + 1], keys, values, lengths[i : i + 1], 0.25)
        assert torch.equal(together[:, i : i + 1], alone)


@given(
    dtype=st.sampled_from(DTYPES),
    heads=st.sampled_from([(4, 2), (6, 3), (4, 4)]),
    head_dim=st.sampled_from([8, 16, 24, 64]),
    rows=st.integers(1, 20),
    start=st.integers(0, 300),
    seed=st.integers(0, 1000),
)
def test_the_attention_kernel_is_row_invariant_and_correct(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int, rows: int, start: int, seed: int
) -> None:
    """Each query row alone equals it among ``rows`` others (bitwise), and the result is
    softmax attention (float64 reference, to the dtype's precision)."""
    query_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(query_heads, rows, head_dim, generator=generator).to(dtype)
    keys = torch.randn(kv_heads, start + rows, head_dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, start + rows, head_dim, generator=generator).to(dtype)
    lengths = torch.arange(start + 1, start + rows + 1)
    scale = head_dim**-0.5
    together = attend_rows(query, keys, values, lengths, scale)
    for i in range(rows):
        alone = attend_rows(query[:, i : i + 1], keys, values, lengths[i : i + 1], scale)
        assert torch.equal(together[:, i : i + 1], alone)
    groups = query_heads // kv_heads
    k64 = keys.double().repeat_interleave(groups, 0)
    v64 = values.double().repeat_interleave(groups, 0)
    scores = query.double() @ k64.transpose(1, 2) * scale
    visible = torch.arange(start + rows)[None] < lengths[:, None]
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v64
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.double(), expected, atol=tolerance, rtol=tolerance)


def test_probe_verdicts_are_cached_and_a_bad_cache_file_is_probed_again(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from knapspec.model.cachefiles import CacheWarning
    from knapspec.model.tuning import invariance

    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    engine = _engine("llama", torch.float32)
    first = row_invariant_table(engine, engine.kernels)
    path = invariance._cache_path(engine, engine.kernels)
    assert path.exists()

    def no_probe(*args: object, **kwargs: object) -> bool:
        raise AssertionError("the cached verdicts should have been used")

    monkeypatch.setattr(invariance, "is_row_invariant", no_probe)
    assert row_invariant_table(engine, engine.kernels).kernels == first.kernels
    monkeypatch.undo()
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    path.write_text("{ not json")
    with pytest.warns(CacheWarning, match="measuring again"):
        again = row_invariant_table(engine, engine.kernels)
    assert again.kernels == first.kernels


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_exact_and_an_inexact_engine_on_one_model_work_independently(
    dtype: torch.dtype,
) -> None:
    """Building a second engine (``exact=False``) on the model of an exact one changes
    nothing for the first: fusion is shared, kernel tables are per engine."""
    from knapspec import SpeculativeDecoder

    model = tiny_model("llama").to(dtype)
    exact = SublayerEngine(model)
    before = SpeculativeDecoder(exact).generate(_tokens(30, 1), max_new_tokens=20).tokens
    loose = SublayerEngine(model, exact=False)
    assert not loose.exact and loose.invariance is None
    assert verification_mismatches(exact, _tokens(30, 2), _tokens(9, 3)) == []
    after = SpeculativeDecoder(exact).generate(_tokens(30, 1), max_new_tokens=20).tokens
    assert torch.equal(before, after)
    assert SpeculativeDecoder(loose).generate(_tokens(30, 1), max_new_tokens=20).tokens.numel()


def test_only_a_cold_prefill_runs_the_measured_kernels_for_many_rows() -> None:
    """A prompt prefilled from position 0 (chunk invariance off) may run the fastest kernels:
    no verification has its shape. Verifications past the prompt and every prefill once
    chunk invariance is on keep the row-invariant ones."""
    engine = SublayerEngine(tiny_model("llama"))
    calls: list[int] = []

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return torch.nn.functional.linear(x, weight, bias)

    engine._prefill_large = dict.fromkeys(engine._large or [(97, 64)], spy)
    engine._prefill_large[tuple(engine.lm_head.weight.shape)] = spy
    cache = engine.new_cache(128)
    engine.forward(_tokens(40, 1), 0, cache)  # cold prefill, 40 rows, every logit
    assert calls and set(calls) == {40}
    calls.clear()
    engine.forward(_tokens(30, 2), 40, cache)  # a 30-row verification past the prompt
    assert calls == []

    def failing(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise RuntimeError("injected")

    spies = engine._prefill_large
    engine._prefill_large = dict.fromkeys(spies, failing)
    with pytest.raises(RuntimeError, match="injected"):  # a cold prefill that fails midway
        engine.forward(_tokens(40, 4), 0, engine.new_cache(64))
    engine._prefill_large = spies
    engine.forward(_tokens(20, 5), 70, cache)  # leaves nothing behind for the next call
    assert calls == []
    if engine.enable_chunk_invariance():
        engine.forward(_tokens(40, 3), 0, engine.new_cache(64))
        assert calls == []
