"""A worked example: write a planner, register it, and use it by name from a config.

``HeuristicEarlyExitPlanner`` drafts with the model's first ``exit_layer`` layers (a
LayerSkip-style mask) and adapts the draft length γ from the verifier's feedback with the
schedule transformers uses for assistant models: +2 after a round whose drafts were all
accepted, -1 (down to 1) otherwise. It shows the whole planner contract:

* an attrs frozen ``config_class`` whose fields have defaults and validators;
* ``from_config(config, engine)``, the constructor the registry calls, inherited from
  :class:`~knapspec.components.Component`: it type-checks the config, calls the
  ``_construct(config, engine)`` hook this class overrides (it needs the model's depth),
  and keeps the config as ``self.config``;
* ``plan(context)`` before every round, ``update(outcome)`` after it, ``reset()`` at the
  start of every ``generate`` call;
* ``uses_window = False``: it never reads the reference window, so the decoder builds no
  cost model and no value proxy for it and skips capturing hidden states.

Run it on the real model (SmolLM2-135M-Instruct, provisioned on first use)::

    python docs/examples/custom_planner.py

``tests/test_docs.py`` runs :func:`demo` on a tiny random Llama, so this file cannot rot.
"""

from __future__ import annotations

from typing import Any, Self

import attrs
import torch

from knapspec import (
    PLANNERS,
    DecoderConfig,
    DraftPlan,
    GenerationResult,
    Planner,
    PlanningContext,
    SpeculativeDecoder,
    StepOutcome,
    SublayerEngine,
    SublayerMask,
)


@attrs.frozen
class HeuristicEarlyExitConfig:
    """Hyper-parameters of :class:`HeuristicEarlyExitPlanner`.

    Attributes:
        exit_layer: the draft runs layers ``0 .. exit_layer - 1`` and skips the rest.
        initial_draft_length: γ of the first round of every ``generate`` call (>= 1).
    """

    exit_layer: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    initial_draft_length: int = attrs.field(default=4, validator=attrs.validators.ge(1))


@PLANNERS.register("heuristic-early-exit")
class HeuristicEarlyExitPlanner(Planner):
    """Early-exit draft with transformers' +2 / -1 draft-length schedule.

    Args:
        mask: the draft mask (from :meth:`SublayerMask.early_exit`).
        initial_draft_length: γ at the start of every generation.
    """

    config_class = HeuristicEarlyExitConfig
    uses_window = False  # no reference window -> no cost model, no proxy, no captured states

    def __init__(self, mask: SublayerMask, initial_draft_length: int) -> None:
        self.mask = mask
        self.initial_draft_length = initial_draft_length
        self.draft_length_ = initial_draft_length  # learned state ends in "_" (sklearn style)

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        # A setting that cannot fit this model is a ValueError; the config layer turns it
        # into a ConfigError that names the [planner] section.
        if config.exit_layer > engine.num_layers:
            raise ValueError(
                f"exit_layer={config.exit_layer} exceeds the model's {engine.num_layers} layers"
            )
        mask = SublayerMask.early_exit(engine.num_layers, config.exit_layer)
        return cls(mask, config.initial_draft_length)

    def plan(self, context: PlanningContext) -> DraftPlan:
        # Called before every round and timed as plan time: keep it cheap. Never exceed
        # the decoder's D, and never touch context.cache (planners only read).
        draft_length = min(self.draft_length_, context.max_draft_length)
        return DraftPlan(self.mask, draft_length, source=self.registered_name)

    def update(self, outcome: StepOutcome) -> None:
        if outcome.drafted > 0 and outcome.accepted == outcome.drafted:
            self.draft_length_ += 2
        else:
            self.draft_length_ = max(1, self.draft_length_ - 1)

    def reset(self) -> None:
        self.draft_length_ = self.initial_draft_length


def demo(
    model: Any,
    tokenizer: Any,
    *,
    prompt: str = "Summarize the plot of Pride and Prejudice in three sentences.",
    exit_layer: int = 8,
    max_new_tokens: int = 64,
) -> GenerationResult:
    """Generate with the new planner chosen by name, and check the output is lossless."""
    config = DecoderConfig.from_dict(
        {"planner": {"name": "heuristic-early-exit", "exit_layer": exit_layer}}
    )
    decoder = SpeculativeDecoder.from_config(model, config)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    result = decoder.generate(input_ids, max_new_tokens=max_new_tokens)

    # Greedy speculative decoding must reproduce plain greedy decoding token for token.
    plain = SpeculativeDecoder.from_config(model, {"planner": {"name": "autoregressive"}})
    reference = plain.generate(input_ids, max_new_tokens=max_new_tokens)
    if not torch.equal(result.tokens, reference.tokens):
        raise AssertionError("the speculative output differs from plain greedy decoding")
    return result


if __name__ == "__main__":
    from knapspec import load_model_and_tokenizer

    torch.set_num_threads(2)
    model, tokenizer = load_model_and_tokenizer()
    result = demo(model, tokenizer)
    print(tokenizer.decode(result.tokens, skip_special_tokens=True))
    print(result.stats.summary())
