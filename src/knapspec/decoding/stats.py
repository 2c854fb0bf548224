"""Generation statistics under the field's names (Spec-Bench / vLLM conventions)."""

from __future__ import annotations

import json
from typing import Any

import attrs


@attrs.frozen
class PlanRecord:
    """A plan as it was used: recorded each time the planner changes its proposal."""

    round_index: int
    context_length: int
    draft_length: int
    skipped_attention: int
    skipped_mlp: int
    skipped_items: tuple[int, ...]
    source: str
    predicted_acceptance: float | None


@attrs.define
class GenerationStats:
    """Counters and timers of one ``generate`` call.

    Acceptance rate is accepted draft tokens over drafted tokens; the mean accepted length
    counts the bonus token (tokens committed per verify round), as vLLM and Spec-Bench do.
    ``accept_lengths`` holds the tokens committed in every round (Spec-Bench field).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    plan_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accept_lengths: list[int] = attrs.field(factory=list)
    drafted_at_position: list[int] = attrs.field(factory=list)
    accepted_at_position: list[int] = attrs.field(factory=list)
    plans: list[PlanRecord] = attrs.field(factory=list)
    stop_reason: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify round, bonus token included."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def decoding_steps(self) -> int:
        """Spec-Bench's name for the number of verify rounds."""
        return self.rounds

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft position i accepted | drafted), i = 0, 1, ..."""
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(
                self.accepted_at_position, self.drafted_at_position, strict=True
            )
        ]

    def record_round(self, drafted: int, accepted: int, committed: int) -> None:
        """Count one verify round (``committed`` may be cut short by EOS / the token limit)."""
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.accept_lengths.append(committed)
        while len(self.drafted_at_position) < drafted:
            self.drafted_at_position.append(0)
            self.accepted_at_position.append(0)
        for position in range(drafted):
            self.drafted_at_position[position] += 1
            if position < accepted:
                self.accepted_at_position[position] += 1

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form, derived metrics included."""
        data = attrs.asdict(self)
        data.update(
            tokens_per_second=self.tokens_per_second,
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            decoding_steps=self.decoding_steps,
            per_position_acceptance=self.per_position_acceptance,
        )
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        """One line for humans."""
        return (
            f"{self.new_tokens} tokens in {self.wall_time_s:.2f} s "
            f"({self.tokens_per_second:.1f} tok/s), "
            f"acceptance {self.acceptance_rate:.2f}, mean accepted length "
            f"{self.mean_accepted_length:.2f}, {self.rounds} rounds "
            f"(plan {self.plan_time_s:.2f} s / draft {self.draft_time_s:.2f} s / "
            f"verify {self.verify_time_s:.2f} s)"
        )
