"""Benchmark scenarios: what is asked of the model, at which lengths (the protocol is in
:mod:`knapspec.bench.runner`).

A :class:`Scenario` is a prompt family (summarise, copy, quote a document to answer a
question, edit a passage, long generation), the prompt
lengths it is run at, the number of new tokens and the sampling parameters. Prompts are
built from real text by :mod:`knapspec.bench.prompts`, deterministically from a seed, so
every method sees exactly the same token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import attrs
import torch

from knapspec.bench.prompts import (
    copy_prompt,
    edit_prompt,
    long_generation_prompt,
    long_input_prompt,
    quote_prompt,
)
from knapspec.sampling import SamplingParams

PromptKind = Literal["summarise", "copy", "quote", "edit", "long-generation"]
PROMPT_KINDS: tuple[str, ...] = ("summarise", "copy", "quote", "edit", "long-generation")

#: Seeds of benchmark prompts start here; the warm-up / set-up prompt uses another range so
#: that a plan frozen on it (the static baseline) was not fitted to the measured prompts.
PROMPT_SEED_BASE = 1000
SETUP_SEED_BASE = 9000


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _positive_ints(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not value or any(int(v) < 0 for v in value):
        raise ValueError(f"{attribute.name} must be a non-empty tuple of lengths >= 0, got {value}")


def _batch_sizes(instance: Scenario, attribute: attrs.Attribute[Any], value: Any) -> None:
    if any(int(v) < 1 for v in value):
        raise ValueError(f"batch_sizes must be >= 1, got {value}")
    if value and instance.sampling.do_sample:
        raise ValueError(
            f"scenario {instance.name!r}: a throughput scenario (batch_sizes) is greedy: its "
            "rows are checked against plain decoding's"
        )


def _names(values: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if values is None else tuple(str(v) for v in values)


@attrs.frozen
class BenchPrompt:
    """One prompt of a scenario at one nominal length.

    Attributes:
        prompt_id: stable name, ``<scenario>/<context>/<index>``.
        scenario: the scenario's name.
        context: nominal prompt length N (0 for the short long-generation prompts).
        index: position among the prompts of this scenario and length.
        input_ids: ``(n,)`` token ids (chat template applied); ``n`` is near ``context``.
    """

    prompt_id: str
    scenario: str
    context: int
    index: int
    input_ids: torch.Tensor = attrs.field(eq=False, repr=False)

    @property
    def context_length(self) -> int:
        """Actual prompt tokens ``n``."""
        return int(self.input_ids.numel())


@attrs.frozen
class Scenario:
    """A benchmark scenario.

    Attributes:
        name: short identifier used on the command line and in results.
        kind: the prompt family.
        contexts: nominal prompt lengths N (ignored by ``long-generation``, which uses a
            short instruction; give ``(0,)``).
        new_tokens: tokens to generate per call.
        sampling: greedy (the default; outputs are checked token for token against AR) or
            sampled decoding.
        description: one line for the report.
        batch_sizes: non-empty for a throughput scenario: its prompts are decoded as
            batches of these sizes (:mod:`knapspec.bench.throughput`); greedy only.
        methods: the names of the run's methods this scenario runs (the plain reference
            always runs); None: all of them.
    """

    name: str
    kind: PromptKind = attrs.field(validator=attrs.validators.in_(PROMPT_KINDS))
    contexts: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_positive_ints)
    new_tokens: int = attrs.field(validator=attrs.validators.ge(1))
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    description: str = ""
    batch_sizes: tuple[int, ...] = attrs.field(
        default=(), converter=_int_tuple, validator=_batch_sizes
    )
    methods: tuple[str, ...] | None = attrs.field(default=None, converter=_names)

    @property
    def greedy(self) -> bool:
        return not self.sampling.do_sample

    @property
    def throughput(self) -> bool:
        """A throughput scenario: batches, not one prompt per call."""
        return bool(self.batch_sizes)

    def prompts(self, tokenizer: Any, context: int, count: int) -> list[BenchPrompt]:
        """``count`` prompts at nominal length ``context`` (deterministic)."""
        return [
            BenchPrompt(
                prompt_id=f"{self.name}/{context}/{index}",
                scenario=self.name,
                context=context,
                index=index,
                input_ids=self._build(tokenizer, context, PROMPT_SEED_BASE + 97 * context + index),
            )
            for index in range(count)
        ]

    def setup_prompt(self, tokenizer: Any, context: int) -> BenchPrompt:
        """A prompt outside the measured set, for warm-up and one-time set-up."""
        ids = self._build(tokenizer, context, SETUP_SEED_BASE + context)
        return BenchPrompt(f"{self.name}/{context}/setup", self.name, context, -1, ids)

    def _build(self, tokenizer: Any, context: int, seed: int) -> torch.Tensor:
        builders: dict[str, Callable[[], torch.Tensor]] = {
            "summarise": lambda: long_input_prompt(tokenizer, context, seed=seed),
            "copy": lambda: copy_prompt(tokenizer, context, seed=seed),
            "quote": lambda: quote_prompt(tokenizer, context, seed=seed),
            "edit": lambda: edit_prompt(tokenizer, context, seed=seed),
            "long-generation": lambda: long_generation_prompt(tokenizer, seed=seed),
        }
        return builders[self.kind]()


SAMPLING = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9)
#: What the throughput scenario runs: transformers' batched ``model.generate`` (the
#: baseline), our batched plain decoding (``ar``) and our batched speculation.
THROUGHPUT_METHODS = ("generate", "ar", "knapspec")


def default_scenarios(*, quick: bool = False) -> tuple[Scenario, ...]:
    """The protocol's scenarios; ``quick`` shrinks lengths and generations for smoke runs."""
    if quick:
        return (
            Scenario("long-input", "summarise", (128, 256), 16, description="summarise N tokens"),
            Scenario("copy-heavy", "copy", (256,), 16, description="copy a passage verbatim"),
            Scenario("qa-quote", "quote", (256,), 16, description="answer by quoting"),
            Scenario("edit", "edit", (256,), 16, description="rewrite with one change"),
            Scenario("long-generation", "long-generation", (0,), 32, description="short prompt"),
            Scenario("sampling", "summarise", (128,), 16, SAMPLING, "T = 0.7, top-p 0.9"),
            Scenario(
                "throughput",
                "summarise",
                (128,),
                16,
                description="batches of B summarise prompts",
                batch_sizes=(1, 4),
                methods=THROUGHPUT_METHODS,
            ),
        )
    return (
        Scenario(
            "long-input",
            "summarise",
            (512, 2048, 4096),
            128,
            description="summarise N tokens of a novel, 128 new tokens, greedy",
        ),
        Scenario(
            "copy-heavy",
            "copy",
            (2048, 4096),
            128,
            description="copy an N/2-token passage a second time, verbatim, 128 new tokens, greedy",
        ),
        Scenario(
            "qa-quote",
            "quote",
            (2048,),
            128,
            description="a question about an N-token passage answered by quoting it (the "
            "assistant's turn opened with the quote's first words), 128 new tokens, greedy",
        ),
        Scenario(
            "edit",
            "edit",
            (2048,),
            128,
            description="rewrite N tokens of Python's documentation replacing one word, "
            "otherwise unchanged (opened with the edited text's first words), 128 new tokens, "
            "greedy",
        ),
        Scenario(
            "long-generation",
            "long-generation",
            (0,),
            512,
            description="short instruction, 512 new tokens, greedy",
        ),
        Scenario(
            "sampling",
            "summarise",
            (512, 2048, 4096),
            128,
            SAMPLING,
            description="the long-input prompts sampled at T = 0.7, top-p 0.9",
        ),
        Scenario(
            "throughput",
            "summarise",
            (2048,),
            128,
            description="the long-input prompts decoded B at a time (B = 1, 4, 8), 128 new "
            "tokens per row, greedy; new tokens over all rows per second",
            batch_sizes=(1, 4, 8),
            methods=THROUGHPUT_METHODS,
        ),
    )


def select_scenarios(
    available: Sequence[Scenario], names: Sequence[str] | None
) -> tuple[Scenario, ...]:
    """The scenarios named in ``names`` (all when None), in the given order.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    if not names:
        return tuple(available)
    by_name = {scenario.name: scenario for scenario in available}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; valid: {', '.join(by_name)}")
    return tuple(by_name[name] for name in names)


__all__ = [
    "PROMPT_KINDS",
    "SAMPLING",
    "THROUGHPUT_METHODS",
    "BenchPrompt",
    "PromptKind",
    "Scenario",
    "default_scenarios",
    "select_scenarios",
]
