"""The throughput scenario: ``B`` prompts decoded as one batch, for B in the scenario's
batch sizes, with transformers' batched ``model.generate`` as the baseline.

Per nominal length ``N`` and batch size ``B`` the scenario's first ``B`` prompts (the same
deterministic prompts as the single-prompt scenarios; their lengths differ a little, so
the batch is ragged and transformers gets it left-padded) are run by every method of the
scenario, greedily, EOS per row:

* a ``generate`` method: ``model.generate`` on the left-padded ``(B, n)`` batch with its
  attention mask (:func:`hf_generate_batch`);
* an engine method: :meth:`~knapspec.SpeculativeDecoder.generate` on the list of prompts
  (:func:`engine_generate_batch`): ``ar`` is our batched plain decoding, ``knapspec``
  our batched speculation with the batch-level draft policy. ``B = 1`` takes the
  single-sequence path (a user with one prompt calls it so; for ``knapspec`` that is the
  full planner).

Protocol: one warm-up call of every method on the same prompts (``warmup_tokens`` new
tokens), then ``pairs`` rounds; in each every method runs once, the order reversed every
other round. Each call is timed whole (prefill included). Throughput is new tokens over all
rows (each row up to and including its EOS) per second. Every engine method's rows must
equal the plain reference's (``ar``) row for row, or
:class:`~knapspec.bench.records.LosslessnessError` stops the run; whether transformers'
padded batch gave the same rows is recorded (``rows_equal``), since padding changes its
arithmetic slightly. The report divides each call's tokens/s by ``model.generate``'s and
by ``ar``'s in the same round.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch

from knapspec.bench.methods import REFERENCE, MethodSpec, SupportsGenerate
from knapspec.bench.records import THROUGHPUT, LosslessnessError, append_jsonl

if TYPE_CHECKING:
    from knapspec.bench.scenarios import BenchPrompt, Scenario
    from knapspec.decoding.decoder import SpeculativeDecoder


class ThroughputOptions(Protocol):
    """The run settings the throughput scenario reads (the harness's ``BenchOptions``)."""

    @property
    def methods(self) -> Sequence[MethodSpec]: ...

    @property
    def warmup_tokens(self) -> int: ...

    @property
    def pairs(self) -> int: ...


class ThroughputHarness(Protocol):
    """What :func:`run_throughput` needs of the bench harness
    (:class:`knapspec.bench.runner.Harness`, which calls it: naming the class here would
    make the two modules know each other)."""

    @property
    def options(self) -> ThroughputOptions: ...

    @property
    def model(self) -> Any: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos(self) -> list[int] | None: ...

    @property
    def decoders(self) -> Mapping[str, SupportsGenerate]: ...

    @property
    def bar(self) -> Any: ...

    @property
    def run_dir(self) -> Path: ...

    def record_extra(self) -> dict[str, Any]:
        """The fields every raw record of the run carries."""
        ...


@attrs.frozen
class BatchCall:
    """One timed batched call.

    Attributes:
        rows: per row, its new tokens up to and including its first EOS.
        seconds: the whole call (prefill included).
        drafted_tokens, accepted_tokens: over all rows (0 for ``model.generate``).
        prefill_seconds: the rows' prefills, summed (None for ``model.generate``, whose
            prefill is not timed apart).
    """

    rows: list[list[int]]
    seconds: float
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_seconds: float | None = None

    @property
    def new_tokens(self) -> int:
        """New tokens over all rows."""
        return sum(len(row) for row in self.rows)

    @property
    def tokens_per_second(self) -> float:
        """New tokens over all rows per second of the call."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def until_eos(tokens: Sequence[int], eos: Sequence[int] | None) -> list[int]:
    """``tokens`` up to and including the first EOS (transformers pads a batch after it)."""
    stop = set(eos or ())
    out: list[int] = []
    for token in tokens:
        out.append(int(token))
        if token in stop:
            break
    return out


def left_padded(prompts: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, n)`` ids left-padded with ``pad_id`` and their ``(B, n)`` attention mask."""
    width = max(prompt.numel() for prompt in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt.cpu()
        mask[row, width - prompt.numel() :] = 1
    return ids, mask


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def hf_generate_batch(
    model: Any,
    prompts: Sequence[torch.Tensor],
    new_tokens: int,
    eos: Sequence[int] | None,
    pad_id: int,
) -> BatchCall:
    """Transformers' batched greedy ``model.generate`` on the left-padded prompts."""
    device = next(model.parameters()).device
    ids, mask = left_padded(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    start = _clock(device)
    output = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    seconds = _clock(device) - start
    width = ids.shape[1]
    return BatchCall([until_eos(row[width:].tolist(), eos) for row in output], seconds)


def engine_generate_batch(
    decoder: SpeculativeDecoder,
    prompts: Sequence[torch.Tensor],
    new_tokens: int,
    eos: Sequence[int] | None,
) -> BatchCall:
    """``decoder.generate`` on the prompts: the batched path for several, the
    single-sequence path for one."""
    device = decoder.engine.device
    start = _clock(device)
    if len(prompts) == 1:
        single = decoder.generate(prompts[0], max_new_tokens=new_tokens, eos_token_id=eos)
        seconds = _clock(device) - start
        stats = [single.stats]
        rows = [single.tokens.tolist()]
    else:
        batch = decoder.generate(list(prompts), max_new_tokens=new_tokens, eos_token_id=eos)
        seconds = _clock(device) - start
        stats = batch.stats
        rows = [tokens.tolist() for tokens in batch.tokens]
    return BatchCall(
        rows,
        seconds,
        drafted_tokens=sum(s.drafted_tokens for s in stats),
        accepted_tokens=sum(s.accepted_tokens for s in stats),
        prefill_seconds=sum(s.prefill_time_s for s in stats),
    )


@attrs.frozen
class ThroughputRecord:
    """One timed batched call of the throughput scenario (a line of ``throughput.jsonl``).

    Attributes:
        scenario, method: what ran; pair: the round; position: the call's order in it.
        batch_size: B; context: nominal prompt length N; prompt_ids / prompt_tokens: the
            rows' prompts and their actual lengths.
        new_tokens: new tokens over all rows (each up to and including its EOS);
            row_new_tokens: per row.
        seconds: the whole call, prefill included; tokens_per_second: their ratio.
        rows_equal: rows identical to the plain reference's (``ar``) in the same round.
        lossless: every row equal to the reference's (always True for engine methods, whose
            difference stops the run; None for ``model.generate``, which is only counted).
        drafted_tokens, accepted_tokens: over all rows.
        prefill_seconds: the rows' prefills, summed (None for ``model.generate``); the
            rest of ``seconds`` is the decode phase.
    """

    scenario: str
    method: str
    pair: int
    position: int
    batch_size: int
    context: int
    prompt_ids: list[str]
    prompt_tokens: list[int]
    new_tokens: int
    row_new_tokens: list[int]
    seconds: float
    tokens_per_second: float
    rows_equal: int
    lossless: bool | None
    drafted_tokens: int
    accepted_tokens: int
    prefill_seconds: float | None = None

    def to_json(self, extra: dict[str, Any]) -> str:
        """One JSON line; ``extra`` (run name, environment) is merged in."""
        import json

        return json.dumps({**attrs.asdict(self), **extra})


def scenario_methods(scenario: Scenario, methods: Sequence[MethodSpec]) -> list[MethodSpec]:
    """The run's methods that ``scenario`` runs: those it names (all when it names none),
    less ``model.generate`` variants with extra arguments (transformers' prompt lookup and
    assisted generation refuse a batch)."""
    chosen = [
        method
        for method in methods
        if scenario.methods is None or method.name in scenario.methods or method.name == REFERENCE
    ]
    if scenario.batch_sizes:
        chosen = [m for m in chosen if not (m.kind == "generate" and m.generate_kwargs)]
    return chosen


def throughput_units(scenario: Scenario, methods: int, pairs: int, warmup_tokens: int) -> int:
    """Progress units (generated tokens) of the scenario at one length."""
    per_row = (pairs * scenario.new_tokens + warmup_tokens) * methods
    return sum(batch_size * per_row for batch_size in scenario.batch_sizes)


def _pad_id(tokenizer: Any, eos: Sequence[int] | None) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    return int(eos[0]) if eos else 0


def run_throughput(harness: ThroughputHarness, scenario: Scenario, context: int) -> None:
    """The throughput scenario at one length: every batch size, written to
    ``throughput.jsonl`` (module docstring)."""
    options, bar = harness.options, harness.bar
    methods = scenario_methods(scenario, options.methods)
    pad_id = _pad_id(harness.tokenizer, harness.eos)

    def call(method: MethodSpec, prompts: list[torch.Tensor], new_tokens: int) -> BatchCall:
        if method.kind == "generate":
            return hf_generate_batch(harness.model, prompts, new_tokens, harness.eos, pad_id)
        decoder = harness.decoders[method.name]
        return engine_generate_batch(decoder, prompts, new_tokens, harness.eos)  # type: ignore[arg-type]

    for batch_size in scenario.batch_sizes:
        prompts: list[BenchPrompt] = scenario.prompts(harness.tokenizer, context, batch_size)
        ids = [prompt.input_ids for prompt in prompts]
        bar.set_description(f"{scenario.name} N={context} B={batch_size} warm-up")
        for method in methods:
            call(method, ids, options.warmup_tokens)
            bar.update(batch_size * options.warmup_tokens)
        for pair in range(options.pairs):
            bar.set_description(
                f"{scenario.name} N={context} B={batch_size} pair {pair + 1}/{options.pairs}"
            )
            order = methods if pair % 2 == 0 else methods[::-1]
            calls = {}
            for method in order:
                calls[method.name] = call(method, ids, scenario.new_tokens)
                bar.update(batch_size * scenario.new_tokens)
            reference = calls[REFERENCE].rows
            for position, method in enumerate(order):
                result = calls[method.name]
                pairs_of_rows = zip(result.rows, reference, strict=True)
                equal = [mine == theirs for mine, theirs in pairs_of_rows]
                lossless: bool | None = all(equal)
                if method.kind == "generate":
                    lossless = None
                elif not lossless:
                    row = equal.index(False)
                    raise LosslessnessError(
                        f"LOSSLESSNESS FAILURE: method {method.name!r} in the batch of "
                        f"{batch_size} at N={context} (row {row}, prompt "
                        f"{prompts[row].prompt_id}) produced {result.rows[row][:8]}... where "
                        f"plain decoding produced {reference[row][:8]}...; a greedy method "
                        "must reproduce plain decoding row for row"
                    )
                record = ThroughputRecord(
                    scenario=scenario.name,
                    method=method.name,
                    pair=pair,
                    position=position,
                    batch_size=batch_size,
                    context=context,
                    prompt_ids=[prompt.prompt_id for prompt in prompts],
                    prompt_tokens=[prompt.context_length for prompt in prompts],
                    new_tokens=result.new_tokens,
                    row_new_tokens=[len(row) for row in result.rows],
                    seconds=result.seconds,
                    tokens_per_second=result.tokens_per_second,
                    rows_equal=sum(equal),
                    lossless=lossless,
                    drafted_tokens=result.drafted_tokens,
                    accepted_tokens=result.accepted_tokens,
                    prefill_seconds=result.prefill_seconds,
                )
                append_jsonl(harness.run_dir / THROUGHPUT, record.to_json(harness.record_extra()))


__all__ = [
    "BatchCall",
    "ThroughputHarness",
    "ThroughputOptions",
    "ThroughputRecord",
    "engine_generate_batch",
    "hf_generate_batch",
    "left_padded",
    "run_throughput",
    "scenario_methods",
    "throughput_units",
    "until_eos",
]
