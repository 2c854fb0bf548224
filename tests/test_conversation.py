"""Conversations keep the KV cache across turns; every turn equals a cold call, bitwise.

What they rely on is tested first: on an exact engine a sequence's K/V and logits do not
depend on how it is split into forward calls (``SublayerEngine.chunk_invariant``). Then
turn-by-turn greedy equality with a cold ``generate`` on the whole conversation (token
ids and chat-template text, tiny Llama and Qwen3, layer-skipping and lookup drafts), and
misuse: two threads, another engine, a turn past the context, an error or an interrupt
mid-turn.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.tiny_models import tiny_model

from knapspec import (
    ContextLengthError,
    ConversationBusyError,
    ConversationError,
    SpeculativeDecoder,
    SublayerEngine,
    SublayerMask,
)
from knapspec.planners import LookupPlanner, StaticPlanner

VOCAB = 97  # tiny_model's


def _decoder(family: str, drafter: str) -> SpeculativeDecoder:
    planner = (
        LookupPlanner()
        if drafter == "lookup"
        else StaticPlanner(SublayerMask((True, False) * 3), 3)
    )
    return SpeculativeDecoder(tiny_model(family), planner=planner, confidence_threshold=0)


def _ids(generator: torch.Generator, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=generator)


# ------------------------------------------------------------- chunk invariance
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(
    length=st.integers(2, 200),
    cuts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_a_prefill_in_pieces_equals_one_prefill_bitwise(
    family: str, dtype: torch.dtype, length: int, cuts: list[float], seed: int
) -> None:
    engine = _engine(family, dtype)
    assert engine.chunk_invariant
    ids = _ids(torch.Generator().manual_seed(seed), length)
    bounds = sorted({int(c * (length - 1)) + 1 for c in cuts} - {length})

    def prefill(splits: list[int]) -> tuple[Any, torch.Tensor]:
        cache, start = engine.new_cache(length), 0
        for end in [*splits, length]:
            out = engine.forward(ids[start:end], start, cache, all_logits=True)
            start = end
        return cache, out.logits

    whole, whole_logits = prefill([])
    pieces, piece_logits = prefill(bounds)
    last = length - (bounds[-1] if bounds else 0)
    assert torch.equal(piece_logits, whole_logits[-last:])
    for layer in range(engine.num_layers):
        assert torch.equal(pieces.keys(layer), whole.keys(layer))
        assert torch.equal(pieces.values(layer), whole.values(layer))


_ENGINES: dict[tuple[str, torch.dtype], SublayerEngine] = {}


def _engine(family: str, dtype: torch.dtype) -> SublayerEngine:
    key = (family, dtype)
    if key not in _ENGINES:
        model = tiny_model(family)
        _ENGINES[key] = SublayerEngine(
            model if dtype == torch.float32 else _copy(model, dtype), invariant_prefill=True
        )
    return _ENGINES[key]


def _copy(model: Any, dtype: torch.dtype) -> Any:
    import copy

    return copy.deepcopy(model).to(dtype)


def test_the_fused_prefill_is_not_chunk_invariant() -> None:
    """The check has power: PyTorch's fused attention (``invariant_prefill=False``) rounds
    a prefill in two pieces differently from one, so equality above is not luck."""
    engine = SublayerEngine(tiny_model("llama"), invariant_prefill=False)
    assert not engine.chunk_invariant
    ids = _ids(torch.Generator().manual_seed(3), 200)
    whole, pieces = engine.new_cache(200), engine.new_cache(200)
    engine.forward(ids, 0, whole)
    engine.forward(ids[:120], 0, pieces)
    engine.forward(ids[120:], 120, pieces)
    assert not all(
        torch.equal(whole.keys(layer), pieces.keys(layer)) for layer in range(engine.num_layers)
    )


# ------------------------------------------------------------ turns, token ids
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("drafter", ["subnetwork", "lookup"])
@given(
    first=st.integers(1, 40),
    turns=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 24)), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
def test_every_turn_equals_a_cold_call_on_the_whole_conversation(
    family: str, drafter: str, first: int, turns: list[tuple[int, int]], seed: int
) -> None:
    decoder = _decoder(family, drafter)
    conversation = decoder.conversation()
    generator = torch.Generator().manual_seed(seed)
    ids = _ids(generator, first)
    previous = 0  # tokens of the conversation before this turn's new message
    for added, new_tokens in turns:
        turn = conversation.generate(ids, max_new_tokens=new_tokens)
        cold = decoder.generate(ids, max_new_tokens=new_tokens)
        assert torch.equal(turn.tokens, cold.tokens)
        # Everything before the new message was reused, but perhaps the last reply token
        # (it is fed through the model only when a draft ran past it).
        assert previous - 1 <= turn.result.stats.cached_prompt_tokens <= previous
        assert torch.equal(conversation.tokens, torch.cat([ids, turn.tokens]))
        previous = ids.numel() + turn.tokens.numel()
        ids = torch.cat([ids, turn.tokens, _ids(generator, added)])


def test_second_turn_prefills_only_its_new_tokens() -> None:
    decoder = _decoder("llama", "subnetwork")
    conversation = decoder.conversation()
    generator = torch.Generator().manual_seed(1)
    ids = _ids(generator, 30)
    first = conversation.generate(ids, max_new_tokens=10)
    assert first.result.stats.cached_prompt_tokens == 0
    cached = conversation.cached_tokens
    assert cached in (39, 40)  # the last reply token has K/V only if a draft ran past it
    ids = torch.cat([ids, first.tokens, _ids(generator, 12)])
    second = conversation.generate(ids, max_new_tokens=10)
    assert second.result.stats.cached_prompt_tokens == cached
    assert second.result.stats.prompt_tokens == 52
    assert second.dropped_tokens == 0


def test_a_conversation_that_rewrites_history_recomputes_from_the_divergence() -> None:
    decoder = _decoder("qwen3", "lookup")
    conversation = decoder.conversation()
    generator = torch.Generator().manual_seed(2)
    ids = _ids(generator, 40)
    first = conversation.generate(ids, max_new_tokens=12)
    cached = conversation.cached_tokens
    edited = torch.cat([ids[:25], (ids[25:] + 1) % VOCAB, first.tokens, _ids(generator, 5)])
    second = conversation.generate(edited, max_new_tokens=12)
    assert second.result.stats.cached_prompt_tokens == 25
    assert second.dropped_tokens == cached - 25
    assert torch.equal(second.tokens, decoder.generate(edited, max_new_tokens=12).tokens)
    # The same prompt again: all but its last token (prefilled for its logits) reused.
    again = conversation.generate(edited, max_new_tokens=12)
    assert again.result.stats.cached_prompt_tokens == edited.numel() - 1
    assert torch.equal(again.tokens, second.tokens)


def test_reset_forgets_the_cache() -> None:
    decoder = _decoder("llama", "lookup")
    conversation = decoder.conversation()
    ids = _ids(torch.Generator().manual_seed(4), 20)
    conversation.generate(ids, max_new_tokens=5)
    conversation.reset()
    assert conversation.cached_tokens == 0 and conversation.tokens.numel() == 0
    again = conversation.generate(ids, max_new_tokens=5)
    assert again.result.stats.cached_prompt_tokens == 0


# ------------------------------------------------------------ turns, chat template
WORDS = [f"w{i}" for i in range(VOCAB - 4)]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [END] {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def word_tokenizer(template: str = TEMPLATE) -> Any:
    """A word-level tokenizer over exactly tiny_model's 97 ids (every id decodes to a word
    and re-encodes to itself), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["[UNK]", "[END]", "user", "assistant", *WORDS]
    names[4 + 0] = "system"  # w0 -> the system role, still one id per word
    vocab = {word: index for index, word in enumerate(names)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[END]")
    fast.chat_template = template
    return fast


def _cold(decoder: SpeculativeDecoder, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """A cold call's tokens, stopping at the word tokenizer's [END] (id 1) as send does."""
    return decoder.generate(prompt, max_new_tokens=new_tokens, eos_token_id=1).tokens


def _text(generator: torch.Generator, words: int) -> str:
    picks = torch.randint(5, VOCAB - 4, (words,), generator=generator).tolist()
    return " ".join(f"w{i}" for i in picks)


def _cold_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_send_follows_the_chat_template_and_equals_cold_calls(family: str) -> None:
    tokenizer = word_tokenizer()
    decoder = _decoder(family, "lookup")
    conversation = decoder.conversation(tokenizer, system="w7 w8")
    generator = torch.Generator().manual_seed(5)
    for number in range(3):
        before = list(conversation.messages)
        message = _text(generator, 6 + 3 * number)
        turn = conversation.send(message, max_new_tokens=12)
        prompt = _cold_ids(tokenizer, [*before, {"role": "user", "content": message}])
        cold = decoder.generate(prompt, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id)
        assert torch.equal(turn.tokens, cold.tokens)
        assert conversation.messages[-1] == {"role": "assistant", "content": turn.text}
        assert turn.text == tokenizer.decode(cold.tokens.tolist(), skip_special_tokens=True)
        if number:  # (a generated [UNK] decodes to nothing: then the tail is recomputed)
            assert turn.result.stats.cached_prompt_tokens > 0
    assert [m["role"] for m in conversation.messages] == ["system"] + ["user", "assistant"] * 3


def test_a_template_that_rewrites_earlier_replies_still_equals_cold_calls() -> None:
    # Earlier assistant turns are shortened to their first word (as templates that drop
    # earlier reasoning do): the old tokens are no prefix, the tail is recomputed.
    template = (
        "{% for m in messages %}{{ m['role'] }} : "
        "{% if m['role'] == 'assistant' %}{{ m['content'].split(' ')[0] }}"
        "{% else %}{{ m['content'] }}{% endif %} [END] {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    tokenizer = word_tokenizer(template)
    decoder = _decoder("llama", "subnetwork")
    conversation = decoder.conversation(tokenizer)
    generator = torch.Generator().manual_seed(6)
    conversation.send(_text(generator, 8), max_new_tokens=10)
    before = list(conversation.messages)
    message = _text(generator, 5)
    turn = conversation.send(message, max_new_tokens=10)
    prompt = _cold_ids(tokenizer, [*before, {"role": "user", "content": message}])
    assert torch.equal(turn.tokens, _cold(decoder, prompt, 10))
    if len(before[-1]["content"].split(" ")) > 1:
        assert turn.dropped_tokens > 0


def test_add_turn_is_prefilled_by_the_next_send() -> None:
    tokenizer = word_tokenizer()
    decoder = _decoder("llama", "lookup")
    conversation = decoder.conversation(tokenizer)
    conversation.add_turn("user", "w10 w11")
    conversation.add_turn("assistant", "w12 w13 w14")
    turn = conversation.send("w15", max_new_tokens=8)
    prompt = _cold_ids(tokenizer, conversation.messages[:3])
    assert torch.equal(turn.tokens, _cold(decoder, prompt, 8))


def test_send_without_a_tokenizer_or_template_says_how() -> None:
    conversation = _decoder("llama", "lookup").conversation()
    with pytest.raises(ValueError, match="no tokenizer"):
        conversation.send("hello")
    templated = _decoder("llama", "lookup").conversation(word_tokenizer())
    templated.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        templated.send("hello")


# ------------------------------------------------------------------- misuse
class _Gate:
    """A streamer that holds the turn inside its first committed token until released."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.inside.set()
        assert self.release.wait(30)

    def end(self) -> None:
        pass


def test_a_second_thread_gets_a_clear_error_and_the_first_turn_completes() -> None:
    decoder = _decoder("llama", "lookup")
    conversation = decoder.conversation()
    ids = _ids(torch.Generator().manual_seed(7), 20)
    gate, results = _Gate(), {}

    def first() -> None:
        results["turn"] = conversation.generate(ids, max_new_tokens=6, streamer=gate)

    thread = threading.Thread(target=first)
    thread.start()
    assert gate.inside.wait(30)
    with pytest.raises(ConversationBusyError, match="another thread"):
        conversation.generate(ids, max_new_tokens=6)
    with pytest.raises(ConversationBusyError):
        conversation.reset()
    gate.release.set()
    thread.join(30)
    assert torch.equal(results["turn"].tokens, decoder.generate(ids, max_new_tokens=6).tokens)
    assert conversation.cached_tokens >= ids.numel() + 5


def test_another_engine_is_refused_and_the_conversation_stays_usable() -> None:
    decoder = _decoder("llama", "subnetwork")
    conversation = decoder.conversation()
    ids = _ids(torch.Generator().manual_seed(8), 16)
    first = conversation.generate(ids, max_new_tokens=6)
    other = SpeculativeDecoder(tiny_model("qwen3"), planner=LookupPlanner())
    with pytest.raises(ConversationError, match="another engine"):
        conversation.decoder = other
    same_engine = SpeculativeDecoder(decoder.engine, planner=LookupPlanner())
    conversation.decoder = same_engine  # the same engine: its cache still serves
    more = torch.cat([ids, first.tokens, ids[:5]])
    turn = conversation.generate(more, max_new_tokens=6)
    assert turn.result.stats.cached_prompt_tokens >= 21
    assert torch.equal(turn.tokens, decoder.generate(more, max_new_tokens=6).tokens)


def test_a_decoder_whose_engine_was_replaced_is_refused() -> None:
    decoder = _decoder("llama", "lookup")
    conversation = decoder.conversation()
    decoder.engine = SublayerEngine(tiny_model("llama", seed=1))
    with pytest.raises(ConversationError, match="another engine"):
        conversation.generate([1, 2, 3], max_new_tokens=2)


def test_a_turn_past_the_context_changes_nothing() -> None:
    decoder = _decoder("qwen3", "lookup")
    conversation = decoder.conversation()
    ids = _ids(torch.Generator().manual_seed(9), 100)
    first = conversation.generate(ids, max_new_tokens=20)
    tokens, cached = conversation.tokens, conversation.cached_tokens
    longer = torch.cat([ids, first.tokens, ids[:50]])
    with pytest.raises(ContextLengthError):
        conversation.generate(longer, max_new_tokens=200)  # 170 + 200 > 256
    assert torch.equal(conversation.tokens, tokens) and conversation.cached_tokens == cached
    turn = conversation.generate(longer, max_new_tokens=20)
    assert turn.result.stats.cached_prompt_tokens == cached
    assert torch.equal(turn.tokens, decoder.generate(longer, max_new_tokens=20).tokens)


def test_an_error_mid_turn_leaves_the_conversation_as_it_was() -> None:
    decoder = _decoder("llama", "subnetwork")
    conversation = decoder.conversation(word_tokenizer())
    conversation.send("w20 w21 w22", max_new_tokens=8)
    messages, cached = list(conversation.messages), conversation.cached_tokens

    calls = {"n": 0}

    def failing(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("processor failed")
        return scores

    with pytest.raises(RuntimeError, match="processor failed"):
        conversation.send("w23 w24", max_new_tokens=8, logits_processor=failing)
    assert conversation.messages == messages
    assert conversation.cached_tokens <= cached
    turn = conversation.send("w23 w24", max_new_tokens=8)
    prompt = _cold_ids(conversation.tokenizer, conversation.messages[:-1])
    assert torch.equal(turn.tokens, _cold(decoder, prompt, 8))


class _Interrupt:
    """A streamer that presses Ctrl-C after ``after`` committed tokens."""

    def __init__(self, after: int) -> None:
        self.after, self.seen, self.prompt_seen = after, 0, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.seen += value.numel()
        if self.seen >= self.after:
            raise KeyboardInterrupt

    def end(self) -> None:
        pass


def test_an_interrupt_keeps_the_partial_reply_and_the_next_turn_is_exact() -> None:
    tokenizer = word_tokenizer()
    decoder = _decoder("qwen3", "subnetwork")
    conversation = decoder.conversation(tokenizer)
    with pytest.raises(KeyboardInterrupt):
        conversation.send("w30 w31 w32 w33", max_new_tokens=40, streamer=_Interrupt(5))
    assert [m["role"] for m in conversation.messages] == ["user", "assistant"]
    reply = conversation.tokens.numel() - len(_cold_ids(tokenizer, conversation.messages[:1]))
    assert 5 <= reply < 40
    turn = conversation.send("w34", max_new_tokens=10)
    prompt = _cold_ids(tokenizer, conversation.messages[:-1])
    assert torch.equal(turn.tokens, _cold(decoder, prompt, 10))
    assert turn.result.stats.cached_prompt_tokens > 0


# --------------------------------------------------------------- real model
@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_turns_equal_cold_calls() -> None:
    """SmolLM2-135M-Instruct, its own chat template, fp32, the default decoder: three
    turns, each a cold call's greedy tokens bitwise, each prefilling only its new tokens."""
    from knapspec import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(progress=False)
    decoder = SpeculativeDecoder(model)
    conversation = decoder.conversation(tokenizer)
    questions = [
        "Name three rivers in Europe and say one thing about each.",
        "Which of them is the longest?",
        "Repeat your first answer, in one sentence.",
    ]
    previous_prompt = 0
    for question in questions:
        before = list(conversation.messages)
        turn = conversation.send(question, max_new_tokens=40)
        prompt = _cold_ids(tokenizer, [*before, {"role": "user", "content": question}])
        cold = decoder.generate(prompt, max_new_tokens=40, eos_token_id=tokenizer.eos_token_id)
        assert torch.equal(turn.tokens, cold.tokens)
        # At least the earlier prompts are reused (a reply may re-tokenize differently
        # once decoded: SmolLM2's tokenizer encodes a generated "\n\n" token as two).
        assert turn.result.stats.cached_prompt_tokens >= previous_prompt
        previous_prompt = prompt.numel()


# ------------------------------------------------------------ prefix cache
def _cached_decoder(family: str, mib: float = 8.0) -> SpeculativeDecoder:
    return SpeculativeDecoder(
        tiny_model(family),
        {"planner": {"name": "lookup"}, "prefix_cache_mib": mib},
        confidence_threshold=0,
    )


def _uncached(decoder: SpeculativeDecoder) -> SpeculativeDecoder:
    """The same decoder without a prefix cache, on the same engine (a second engine on the
    model would re-fuse its weights, and a fused product rounds unlike an unfused one)."""
    return SpeculativeDecoder(
        decoder.engine, {"planner": {"name": "lookup"}}, confidence_threshold=0
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@given(
    shared=st.integers(1, 60),
    tails=st.lists(st.integers(1, 20), min_size=2, max_size=3),
    seed=st.integers(0, 1000),
)
def test_prompts_sharing_a_prefix_reuse_it_and_equal_cold_calls(
    family: str, shared: int, tails: list[int], seed: int
) -> None:
    decoder = _cached_decoder(family)
    plain = _uncached(decoder)
    generator = torch.Generator().manual_seed(seed)
    system = _ids(generator, shared)
    for number, tail in enumerate(tails):
        # Each question starts with its own token, so only the system prompt is shared.
        question = torch.cat([torch.tensor([number]), _ids(generator, tail)])
        prompt = torch.cat([system, question])
        result = decoder.generate(prompt, max_new_tokens=8)
        assert torch.equal(result.tokens, plain.generate(prompt, max_new_tokens=8).tokens)
        assert result.stats.cached_prompt_tokens == (shared if number else 0)
    assert decoder.prefix_cache is not None
    assert decoder.prefix_cache.stats.hits == len(tails) - 1


def test_a_prompt_resent_with_its_reply_reuses_both() -> None:
    decoder = _cached_decoder("llama")
    generator = torch.Generator().manual_seed(11)
    prompt = _ids(generator, 40)
    first = decoder.generate(prompt, max_new_tokens=10)
    longer = torch.cat([prompt, first.tokens, _ids(generator, 6)])
    second = decoder.generate(longer, max_new_tokens=10)
    assert second.stats.cached_prompt_tokens >= 49
    assert torch.equal(second.tokens, _uncached(decoder).generate(longer, max_new_tokens=10).tokens)
    assert len(decoder.prefix_cache or ()) == 1  # the longer sequence replaced the first


def test_the_prefix_cache_evicts_least_recently_used_under_its_budget() -> None:
    from knapspec.decoding.prefix_cache import MIB, PrefixCache

    engine = _engine("llama", torch.float32)
    per_token = 2 * engine.num_layers * engine.kv_heads * engine.head_dim * 4
    prefixes = PrefixCache(70 * per_token / MIB)  # room for 70 tokens
    generator = torch.Generator().manual_seed(12)
    sequences = [_ids(generator, 30) for _ in range(3)]
    sequences = [torch.cat([torch.tensor([i]), s]) for i, s in enumerate(sequences)]  # distinct
    cache = engine.new_cache(64)

    def keep(tokens: torch.Tensor) -> None:
        cache.reset()
        engine.forward(tokens, 0, cache)
        prefixes.store(tokens, cache, tokens.numel())

    keep(sequences[0])
    keep(sequences[1])
    assert prefixes.restore(torch.cat([sequences[0], sequences[2][:3]]), cache) == 31
    keep(sequences[2])  # 93 tokens > 70: the least recently used (sequences[1]) goes
    assert prefixes.nbytes <= prefixes.budget_bytes and len(prefixes) == 2
    assert prefixes.stats.evictions == 1
    assert prefixes.restore(sequences[1], cache) == 0
    assert prefixes.restore(sequences[0], cache) == 30  # the last token is always run
    assert prefixes.restore(sequences[2], cache) == 30
    # The restored K/V are a cold prefill's.
    cold = engine.new_cache(64)
    engine.forward(sequences[2][:30], 0, cold)
    for layer in range(engine.num_layers):
        assert torch.equal(cache.keys(layer), cold.keys(layer))
    huge = _ids(generator, 100)  # larger than the whole budget: not kept
    keep(huge)
    assert prefixes.restore(huge, cache) == 0 and prefixes.nbytes <= prefixes.budget_bytes


def test_a_batch_reuses_cached_prefixes_and_equals_cold_rows() -> None:
    decoder = _cached_decoder("qwen3")
    generator = torch.Generator().manual_seed(13)
    system = _ids(generator, 30)
    prompts = [torch.cat([system, torch.tensor([i]), _ids(generator, 5)]) for i in range(3)]
    cached = decoder.generate(prompts, max_new_tokens=6)
    cold = _uncached(decoder).generate(prompts, max_new_tokens=6)
    for warm, plain in zip(cached.tokens, cold.tokens, strict=True):
        assert torch.equal(warm, plain)
    assert [s.cached_prompt_tokens for s in cached.stats] == [0, 30, 30]


def test_the_prefix_cache_is_off_by_default_and_on_inexact_engines() -> None:
    assert _decoder("llama", "lookup").prefix_cache is None
    inexact = SublayerEngine(tiny_model("llama"), invariant_prefill=False)
    decoder = SpeculativeDecoder(inexact, {"planner": {"name": "lookup"}, "prefix_cache_mib": 8})
    assert decoder.prefix_cache is None
    with pytest.raises(ValueError, match="prefix_cache_mib"):
        SpeculativeDecoder(tiny_model("llama"), {"prefix_cache_mib": -1})


def test_prefills_are_fused_until_a_conversation_or_a_prefix_cache_asks() -> None:
    """A plain ``generate`` keeps PyTorch's faster fused prefill; a conversation or a prefix
    cache makes the engine's prefills chunk-invariant from then on, unless the engine was
    built with ``invariant_prefill=False``."""
    engine = SublayerEngine(tiny_model("llama"))
    decoder = SpeculativeDecoder(engine)
    decoder.generate(torch.tensor([3, 5, 7, 9]), max_new_tokens=2)
    assert not engine.chunk_invariant
    decoder.conversation()
    assert engine.chunk_invariant
    cached = SublayerEngine(tiny_model("qwen3"))
    assert SpeculativeDecoder(cached, {"prefix_cache_mib": 8}).prefix_cache is not None
    assert cached.chunk_invariant
    never = SublayerEngine(tiny_model("llama"), invariant_prefill=False)
    SpeculativeDecoder(never).conversation()
    assert not never.chunk_invariant
