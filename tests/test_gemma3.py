"""Gemma 3 through the engine: transformers' own ``Gemma3ForCausalLM`` forward is the oracle
(float32, allclose), its sliding window crossed; the exactness contract past the window,
in batches and token trees; the lean pass and the compiled layer loop serve Gemma's layers.

The tiny model (:func:`knapspec.testing.tiny_model` ``"gemma3"``) has a window of 8 tokens
on its first two layers and a global third, one K/V head for four query heads of 256, and
random norm weights, so that every Gemma difference changes the logits.
"""

from __future__ import annotations

import functools

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knapspec.model.engine import SublayerEngine, UnsupportedModelError
from knapspec.model.kernels import layer_loop
from knapspec.model.kernels.row_attention import attend_rows
from knapspec.model.kernels.table import FUSION_GROUPS
from knapspec.model.passes import exact_pass, sliding_window
from knapspec.model.passes.batched import forward_batch, new_batch_cache
from knapspec.testing.exactness import batch_mismatches, verification_mismatches
from knapspec.testing.models import tiny_model
from knapspec.types import SublayerMask

DTYPES = (torch.float32, torch.bfloat16)
VOCAB = 97
WINDOW = 8


@functools.cache
def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return tiny_model("gemma3").to(dtype)


@functools.cache
def _engine(dtype: torch.dtype = torch.float32, exact: bool = True) -> SublayerEngine:
    return SublayerEngine(_model(dtype), exact=exact, kernels=None if exact else "f.linear")


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def _reference(ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward over ``ids``: ``(n, vocab)`` float32 logits."""
    with torch.no_grad():
        logits: torch.Tensor = _model()(ids.unsqueeze(0)).logits[0].float()
    return logits


def test_the_tiny_model_is_laid_out_as_gemma_3() -> None:
    engine = _engine()
    assert engine.windows == [WINDOW, WINDOW, None]
    assert engine.sandwich_norms and engine.has_qk_norm
    assert engine.kv_groups == 4 and engine.head_dim == 256
    assert engine.attention_scale == 64**-0.5  # query_pre_attn_scalar, not head_dim
    assert engine.max_context == 256  # the window does not bound the context
    # Gemma's 1 + w form runs compiled, its sandwich and q/k norms too (every path).
    assert engine.compiled_norms and engine.compiled_qk_norms and engine.compiled_rotary


@pytest.mark.parametrize(
    "chunks",
    [[(0, 30)], [(0, 1), (1, 30)], [(0, 5), (5, 6), (6, 17), (17, 30)], [(0, 12), (12, 30)]],
)
def test_the_engine_equals_transformers_forward_past_the_window(
    chunks: list[tuple[int, int]],
) -> None:
    """Prefill, one-token steps and verifications of any width, before and past the
    window, against ``Gemma3ForCausalLM.forward`` over the whole sequence."""
    engine = _engine()
    ids = _tokens(30, 3)
    cache = engine.new_cache(4)  # it grows
    got = torch.cat([engine.forward(ids[a:b], a, cache).logits for a, b in chunks])
    torch.testing.assert_close(got, _reference(ids), atol=2e-5, rtol=1e-4)


def test_one_token_steps_equal_transformers_forward_to_the_end() -> None:
    engine = _engine()
    ids = _tokens(40, 4)
    cache = engine.new_cache(40)
    engine.forward(ids[:3], 0, cache)
    steps = torch.stack([engine.forward(ids[i : i + 1], i, cache).logits[0] for i in range(3, 40)])
    torch.testing.assert_close(steps, _reference(ids)[3:], atol=2e-5, rtol=1e-4)


def test_the_oracle_sees_a_missing_window() -> None:
    """Power: an engine that attends every layer globally differs from transformers past
    the window (and only there)."""
    engine = SublayerEngine(_model(), progress=False)
    engine.windows = [None] * engine.num_layers
    ids = _tokens(30, 3)
    got = engine.forward(ids, 0, engine.new_cache(30)).logits
    reference = _reference(ids)
    torch.testing.assert_close(got[:WINDOW], reference[:WINDOW], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got[WINDOW:], reference[WINDOW:], atol=1e-3, rtol=1e-3)


def _layer_by_layer(ids: torch.Tensor, mask: SublayerMask) -> torch.Tensor:
    """Oracle for a masked forward: the model's own Gemma layer modules, a skipped item
    the identity, transformers' attention with a causal (and windowed) mask."""
    model = _model()
    backbone = model.model
    n = ids.numel()
    hidden = backbone.embed_tokens(ids.unsqueeze(0))
    positions = torch.arange(n).unsqueeze(0)
    rows, columns = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    for index, layer in enumerate(backbone.layers):
        kind = model.config.layer_types[index]
        visible = columns <= rows
        if kind == "sliding_attention":
            visible &= columns > rows - WINDOW
        if mask.attention(index):
            attn, _ = layer.self_attn(
                layer.input_layernorm(hidden),
                position_embeddings=backbone.rotary_emb(hidden, positions, kind),
                attention_mask=visible[None, None],
            )
            hidden = hidden + layer.post_attention_layernorm(attn)
        if mask.mlp(index):
            fed = layer.mlp(layer.pre_feedforward_layernorm(hidden))
            hidden = hidden + layer.post_feedforward_layernorm(fed)
    logits: torch.Tensor = model.lm_head(backbone.norm(hidden))[0]
    return logits


@settings(max_examples=12, deadline=None)
@given(skip=st.lists(st.booleans(), min_size=6, max_size=6))
def test_a_masked_forward_equals_the_layer_by_layer_oracle(skip: list[bool]) -> None:
    engine = _engine()
    mask = SublayerMask(tuple(not s for s in skip))
    ids = _tokens(20, 2)
    with torch.no_grad():
        expected = _layer_by_layer(ids, mask)
    cache = engine.new_cache()
    got = torch.cat(
        [
            engine.forward(ids[:7], 0, cache, mask).logits,
            engine.forward(ids[7:12], 7, cache, mask).logits,
            engine.forward(ids[12:], 12, cache, mask).logits,
        ]
    )
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_run_item_branches_equal_a_cached_forward_past_the_window() -> None:
    engine = _engine()
    ids = _tokens(20, 5)
    cache = engine.new_cache()
    points = engine.forward(ids, 0, cache, capture_points=True).points
    assert points is not None
    prefix = 14
    cache.crop(prefix)
    for item in range(engine.num_items):
        got = engine.run_item(
            item, points[item, prefix:].unsqueeze(0), torch.arange(prefix, 20), cache, prefix
        )
        torch.testing.assert_close(got[0], points[item + 1, prefix:], atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------ the exactness contract
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("context", "drafted"), [(3, 4), (5, 9), (8, 1), (20, 17), (40, 6)])
def test_verification_equals_one_token_steps_across_the_window(
    dtype: torch.dtype, context: int, drafted: int
) -> None:
    problems = verification_mismatches(
        _engine(dtype), _tokens(context, context), _tokens(drafted, drafted)
    )
    assert problems == []


@pytest.mark.parametrize("path", ["general", "lean"])
def test_a_verification_that_ignores_the_window_fails_the_contract(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power: a mutant whose multi-row verification forgets the window (one-token steps
    keep it) is caught by the contract check, on the general path (the engine's windowed
    attention) and on the lean pass (its plan of the rows past the window)."""
    engine = _engine()
    if path == "general":
        real = sliding_window.attend_rows_windowed

        def forgetful(query, keys, values, lengths, window, scale):  # type: ignore[no-untyped-def]
            return real(
                query, keys, values, lengths, window if query.shape[1] == 1 else None, scale
            )

        monkeypatch.setattr("knapspec.model.engine.attend_rows_windowed", forgetful)
    else:
        plan = exact_pass.windowed_rows

        def forgets(inside, window, heads, scale, lengths, tree=None):  # type: ignore[no-untyped-def]
            rows = lengths.shape[1] if lengths is not None else tree[1].numel()
            return None if rows > 1 else plan(inside, window, heads, scale, lengths, tree)

        monkeypatch.setattr(exact_pass, "windowed_rows", forgets)
    with engine.use_paths(lean_passes=path == "lean"):
        assert verification_mismatches(engine, _tokens(20, 1), _tokens(6, 2))


def test_windowed_rows_equal_their_slice_attended_alone() -> None:
    """The kernel-level fact the contract rests on: a row past the window is the row
    attended alone over its slice, whatever other rows share the call."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 6, 256, generator=generator)
    keys = torch.randn(1, 30, 256, generator=generator)
    values = torch.randn(1, 30, 256, generator=generator)
    lengths = torch.tensor([5, 8, 9, 17, 29, 30])
    out = sliding_window.attend_rows_windowed(query, keys, values, lengths, WINDOW, 0.1)
    for row, end in enumerate(lengths.tolist()):
        first = max(0, end - WINDOW)
        alone = attend_rows(
            query[:, row : row + 1],
            keys[:, first:end],
            values[:, first:end],
            torch.tensor([end - first]),
            0.1,
        )
        assert torch.equal(out[:, row : row + 1], alone)


@settings(max_examples=15, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    widths=st.lists(st.integers(1, 11), min_size=2, max_size=4),
    contexts=st.lists(st.integers(1, 30), min_size=4, max_size=4),
    seed=st.integers(0, 10_000),
)
def test_batched_verification_equals_each_row_alone(
    dtype: torch.dtype, widths: list[int], contexts: list[int], seed: int
) -> None:
    problems = batch_mismatches(
        _engine(dtype),
        [_tokens(contexts[r], seed + r) for r in range(len(widths))],
        [_tokens(widths[r], seed + 100 + r) for r in range(len(widths))],
    )
    assert problems == []


@pytest.mark.parametrize("layout", ["auto", "padded", "split"])
def test_an_inexact_batch_is_each_row_alone_up_to_rounding(layout: str) -> None:
    """Without the contract the batch attends padded, the window in its mask (the split
    layout's masks know no window, so a windowed model never splits)."""
    engine = _engine(exact=False)
    contexts, drafted = [_tokens(n, n) for n in (3, 25, 14)], [_tokens(w, w) for w in (6, 1, 4)]
    cache = new_batch_cache(engine, 3, 40)
    alone = []
    for row, (context, tokens) in enumerate(zip(contexts, drafted, strict=True)):
        single = engine.new_cache(40)
        engine.forward(context, 0, single, all_logits=False)
        cache.load_row(row, single, context.numel())
        alone.append(engine.forward(tokens, context.numel(), single).logits)
    inputs = torch.zeros(3, 6, dtype=torch.long)
    for row, tokens in enumerate(drafted):
        inputs[row, : tokens.numel()] = tokens
    starts = [c.numel() for c in contexts]
    logits = forward_batch(
        engine, inputs, starts, cache, widths=[6, 1, 4], attention=layout, packed_logits=True
    )  # type: ignore[arg-type]
    torch.testing.assert_close(logits, torch.cat(alone), atol=2e-5, rtol=1e-4)


# -------------------------------------------------- the lean pass and the compiled loop
@pytest.mark.parametrize("path", ["layer-loop", "lean-items"])
def test_the_lean_pass_and_the_layer_loop_serve_gemma(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verification past the window and a batched pass take the compiled layer loop (or,
    with it off, the lean pass's items at every layer) and equal transformers."""
    engine = SublayerEngine(_model(), progress=False)
    table = engine.kernels  # fused q/k/v and gate/up at every row count: what both serve
    engine.use_kernels(
        attrs.evolve(table, fuse={group: (True,) * table.max_rows for group in FUSION_GROUPS})
    )
    looped: list[int] = []
    real_run = layer_loop.run_layers

    def run(*args: object, **kwargs: object) -> object:
        out = real_run(*args, **kwargs)  # type: ignore[arg-type]
        looped.extend([] if out is None else [out.numel() // out.shape[-1]])
        return out

    monkeypatch.setattr(layer_loop, "run_layers", run)
    items: list[str] = []
    real_attention, real_mlp = (
        exact_pass.ExactLayerPass.attention_item,
        exact_pass.ExactLayerPass.mlp_item,
    )

    def attention(lean: exact_pass.ExactLayerPass, layer: int, hidden: torch.Tensor) -> object:
        out = real_attention(lean, layer, hidden)
        items.extend([] if out is None else [f"attention {layer}"])
        return out

    def mlp(lean: exact_pass.ExactLayerPass, layer: int, hidden: torch.Tensor) -> object:
        out = real_mlp(lean, layer, hidden)
        items.extend([] if out is None else [f"mlp {layer}"])
        return out

    monkeypatch.setattr(exact_pass.ExactLayerPass, "attention_item", attention)
    monkeypatch.setattr(exact_pass.ExactLayerPass, "mlp_item", mlp)
    ids = _tokens(16, 7)
    with engine.use_paths(compiled_loop=path == "layer-loop"):
        cache = engine.new_cache(16)
        engine.forward(ids[:10], 0, cache)
        got = engine.forward(ids[10:], 10, cache).logits  # a verification past the window
        batch = new_batch_cache(engine, 2, 20)
        for row in range(2):
            single = engine.new_cache(20)
            engine.forward(ids[:10], 0, single, all_logits=False)
            batch.load_row(row, single, 10)
        logits = forward_batch(engine, ids[10:13].repeat(2, 1), [10, 10], batch)
    torch.testing.assert_close(got, _reference(ids)[10:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits[1], _reference(ids[:13])[10:], atol=2e-5, rtol=1e-4)
    every = [
        f"{kind} {layer}" for layer in range(engine.num_layers) for kind in ("attention", "mlp")
    ]
    if path == "layer-loop":
        assert looped == [6, 6] and items == []
    else:
        assert looped == [] and items == every * 2


def test_attention_soft_capping_is_refused() -> None:
    model = tiny_model("gemma3")
    model.config.attn_logit_softcapping = 50.0
    with pytest.raises(UnsupportedModelError, match="soft-caps"):
        SublayerEngine(model, progress=False)


def test_final_logit_soft_capping_is_applied_as_transformers_does() -> None:
    model = tiny_model("gemma3")
    model.config.final_logit_softcapping = 3.0
    engine = SublayerEngine(model, progress=False)
    ids = _tokens(12, 9)
    with torch.no_grad():
        reference = model(ids.unsqueeze(0)).logits[0]
    got = engine.forward(ids, 0, engine.new_cache(12)).logits
    assert float(got.abs().max()) <= 3.0
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-4)


def test_the_lemma_folds_gemmas_one_plus_w_final_norm_into_the_head() -> None:
    """The cosine proxy's folded space: Gemma's final norm scales by ``1 + w``, and the
    folded states times the folded head are the logits."""
    from knapspec.proxies.head_geometry import HeadGeometry, lemma_states, rms_norm_gain

    engine = _engine()
    gain = rms_norm_gain(engine.final_norm)
    torch.testing.assert_close(gain, 1.0 + engine.final_norm.weight.detach())
    hidden = torch.randn(5, engine.hidden_size, generator=torch.Generator().manual_seed(0))
    states = lemma_states(hidden, engine.final_norm, "folded")
    HeadGeometry.for_lm_head(engine.lm_head, engine.final_norm, "folded")  # accepted
    folded_head = engine.lm_head.weight.detach() * gain
    torch.testing.assert_close(states @ folded_head.T, engine.logits(hidden), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_continuous_batching_rows_equal_transformers_generate_alone(slots: int) -> None:
    """``generate_batch`` with lookup drafts and fewer slots than prompts: every row is
    ``model.generate`` of its prompt alone, past the window (transformers' sliding cache)."""
    from tests.test_batch import REPEATING
    from tests.tiny_models import greedy_reference

    from knapspec.decoding.decoder import SpeculativeDecoder
    from knapspec.planners import LookupPlanner
    from knapspec.planners.batch.policy import FixedLookupBatchPolicy

    decoder = SpeculativeDecoder(_engine(), planner=LookupPlanner())
    prompts = [REPEATING[:14], _tokens(3, 1).tolist(), REPEATING[5:11], _tokens(9, 2).tolist()]
    new = 12
    result = decoder.generate_batch(
        prompts, max_new_tokens=new, policy=FixedLookupBatchPolicy(3), max_batch_rows=slots
    )
    for row, prompt in enumerate(prompts):
        expected = greedy_reference(_model(), torch.tensor(prompt), new)
        assert torch.equal(result.tokens[row], expected), f"row {row} differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunk_invariant_prefills_are_bitwise_across_the_window(dtype: torch.dtype) -> None:
    """With chunk invariance on (a prefix cache, a conversation), a prefill split into
    chunks gives bitwise the logits and K/V of one cold prefill, past the window too."""
    engine = SublayerEngine(_model(dtype), progress=False, invariant_prefill=True)
    assert engine.chunk_invariant
    ids = _tokens(90, 11)  # more than EXACT_MAX_QUERIES rows: the blocked path
    whole = engine.new_cache(90)
    expected = engine.forward(ids, 0, whole).logits
    parts = engine.new_cache(90)
    got = torch.cat(
        [engine.forward(ids[a:b], a, parts).logits for a, b in [(0, 7), (7, 20), (20, 90)]]
    )
    assert torch.equal(got, expected)
    for layer in range(engine.num_layers):
        assert torch.equal(parts.keys(layer), whole.keys(layer))
        assert torch.equal(parts.values(layer), whole.values(layer))
    if dtype == torch.float32:
        torch.testing.assert_close(expected, _reference(ids), atol=2e-5, rtol=1e-4)


@pytest.mark.real_model
def test_the_real_gemma_equals_transformers_and_keeps_the_contract_past_its_window() -> None:
    """Gemma 3 270M (provisioned on first use): 600 tokens of text, past its 512-token
    window, through the engine and through transformers (float32), and a verification
    past the window against one-token steps."""
    from importlib.resources import files

    from knapspec.model.loading.provision import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("gemma-3-270m", progress=False)
    text = (files("knapspec") / "data" / "pride_and_prejudice_chapter3.txt").read_text()
    ids = torch.tensor(tokenizer(text)["input_ids"][:600])
    engine = SublayerEngine(model, progress=False)
    assert engine.windows.count(512) == 15 and engine.windows.count(None) == 3
    ours = engine.forward(ids, 0, engine.new_cache(600)).logits
    with torch.no_grad():
        reference = model(ids.unsqueeze(0)).logits[0].float()
    # float32 products summed in another order (the kernels this machine's table chose)
    # move a logit by ~1e-4; a wrong window or norm moves them by whole units.
    torch.testing.assert_close(ours, reference, atol=1e-3, rtol=1e-3)
    assert verification_mismatches(engine, ids[:590], ids[590:]) == []
