"""Generation statistics under the field's names (Spec-Bench / vLLM conventions)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from knapspec.types import DraftTree


@attrs.frozen
class PlanRecord:
    """A plan as it was used: recorded each time the planner changes its proposal (its
    drafter, γ or mask). ``drafter`` is ``"subnetwork"``, ``"lookup"`` or ``"none"`` (γ = 0)."""

    round_index: int
    context_length: int
    draft_length: int
    skipped_attention: int
    skipped_mlp: int
    skipped_items: tuple[int, ...]
    source: str
    predicted_acceptance: float | None
    drafter: str = "subnetwork"


@attrs.define
class DrafterCounts:
    """Rounds, drafted and accepted tokens of one drafter (``"none"``: plain steps).

    ``rejections`` counts rounds that rejected a draft token; ``predicted_acceptance_sum``
    sums the planner's per-token acceptance predictions over ``predicted_rounds`` rounds.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    predicted_acceptance_sum: float = 0.0
    predicted_rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def conditional_acceptance(self) -> float:
        """Per-token acceptance given the previous token was accepted (accepted over
        accepted + rejected tokens; tokens after a rejection were never tried): the
        quantity the planner predicts."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else 0.0

    @property
    def mean_predicted_acceptance(self) -> float | None:
        if not self.predicted_rounds:
            return None
        return self.predicted_acceptance_sum / self.predicted_rounds

    @property
    def mean_draft_length(self) -> float:
        return self.drafted / self.rounds if self.rounds else 0.0


@attrs.define
class GenerationStats:
    """Counters and timers of one ``generate`` call.

    Acceptance rate is accepted draft tokens over drafted tokens; the mean accepted length
    counts the bonus token (tokens committed per verify round), as vLLM and Spec-Bench do.
    ``accept_lengths`` holds the tokens committed in every round (Spec-Bench field).
    ``drafters`` counts rounds, drafted and accepted tokens per drafter (``"subnetwork"``,
    ``"lookup"``, ``"none"`` for plain steps); ``lookup_time_s`` is the time spent proposing
    lookup drafts (every round, drafted or not). ``best_rejected_draft_speedup`` is the
    highest predicted speed, relative to a plain step, of a draft the planner priced and
    rejected in favour of γ = 0 (None when it priced none): why a run did not speculate.
    ``cached_prompt_tokens`` counts the prompt's first tokens whose K/V came from a cache
    (a conversation's earlier turns, a cached prefix) instead of being prefilled;
    ``prefill_time_s`` is the time to the first token. ``tree_rounds`` counts the rounds
    that verified a token tree (their drafted tokens are the tree's nodes, so a tree's
    acceptance rate is lower than a chain's for the same accepted length);
    ``tree_nodes[(depth, rank)]`` is ``[verified, accepted]`` over those rounds' nodes by
    depth (1: the first draft position) and sibling rank (0: the heaviest branch).
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    plan_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    lookup_time_s: float = 0.0
    rounds: int = 0
    tree_rounds: int = 0
    tree_nodes: dict[tuple[int, int], list[int]] = attrs.field(factory=dict)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accept_lengths: list[int] = attrs.field(factory=list)
    drafted_at_position: list[int] = attrs.field(factory=list)
    accepted_at_position: list[int] = attrs.field(factory=list)
    plans: list[PlanRecord] = attrs.field(factory=list)
    drafters: dict[str, DrafterCounts] = attrs.field(factory=dict)
    best_rejected_draft_speedup: float | None = None
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

    def record_round(
        self,
        drafted: int,
        accepted: int,
        committed: int,
        drafter: str | None = None,
        predicted_acceptance: float | None = None,
        depth: int | None = None,
    ) -> None:
        """Count one verify round (``committed`` may be cut short by EOS / the token limit);
        ``drafter`` names who drafted (default: ``"none"`` without drafts, else
        ``"subnetwork"``), ``predicted_acceptance`` the plan's per-token prediction.
        ``drafted`` counts every verified draft token (a tree's nodes); ``depth`` is the
        deepest draft position (default ``drafted``: a chain), what the per-position
        counts follow."""
        name = drafter if drafter is not None else ("subnetwork" if drafted else "none")
        counts = self.drafters.setdefault(name, DrafterCounts())
        counts.rounds += 1
        counts.drafted += drafted
        counts.accepted += accepted
        counts.rejections += int(accepted < (drafted if depth is None else depth))
        if drafted and predicted_acceptance is not None:
            counts.predicted_acceptance_sum += predicted_acceptance
            counts.predicted_rounds += 1
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.accept_lengths.append(committed)
        positions = drafted if depth is None else depth
        while len(self.drafted_at_position) < positions:
            self.drafted_at_position.append(0)
            self.accepted_at_position.append(0)
        for position in range(positions):
            self.drafted_at_position[position] += 1
            if position < accepted:
                self.accepted_at_position[position] += 1

    def record_tree(self, tree: DraftTree, path: Sequence[int]) -> None:
        """Count a tree round's nodes by depth and sibling rank, and which were accepted
        (``path``); :meth:`record_round` counts the round itself."""
        self.tree_rounds += 1
        on_path = set(path)
        for node, (depth, rank) in enumerate(zip(tree.depths, tree.rank, strict=True)):
            counts = self.tree_nodes.setdefault((depth, rank), [0, 0])
            counts[0] += 1
            counts[1] += node in on_path

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form, derived metrics included."""
        data = attrs.asdict(self)
        data["tree_nodes"] = [  # JSON has no tuple keys: [depth, rank, verified, accepted]
            [depth, rank, *counts] for (depth, rank), counts in sorted(self.tree_nodes.items())
        ]
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

    def no_draft_reason(self) -> str:
        """Why nothing was drafted ("" when something was)."""
        if self.drafted_tokens:
            return ""
        if self.best_rejected_draft_speedup is None:
            return "γ = 0 every round: no draft was available to price"
        return (
            f"γ = 0 every round: the best draft priced was predicted at "
            f"{self.best_rejected_draft_speedup:.2f}x a plain step"
        )

    def drafter_summary(self) -> str:
        """Per drafter: rounds, mean γ, predicted vs measured per-token acceptance."""
        if not self.drafters:
            return "no rounds (generation ended with the prefill's token)"
        parts = []
        for name, counts in sorted(self.drafters.items()):
            if name == "none":
                parts.append(f"plain steps (γ = 0) in {counts.rounds} rounds")
                continue
            part = (
                f"{name} drafts in {counts.rounds} rounds (mean γ {counts.mean_draft_length:.1f}, "
                f"per-token acceptance {counts.conditional_acceptance:.2f}"
            )
            predicted = counts.mean_predicted_acceptance
            if predicted is not None:
                part += f", predicted {predicted:.2f}"
            parts.append(part + ")")
        return "; ".join(parts)

    def summary(self) -> str:
        """One line for humans."""
        reason = self.no_draft_reason()
        acceptance = f"acceptance {self.acceptance_rate:.2f}" + (f" ({reason})" if reason else "")
        return (
            f"{self.new_tokens} tokens in {self.wall_time_s:.2f} s "
            f"({self.tokens_per_second:.1f} tok/s), "
            f"{acceptance}, mean accepted length "
            f"{self.mean_accepted_length:.2f}, {self.rounds} rounds "
            f"(plan {self.plan_time_s:.2f} s / draft {self.draft_time_s:.2f} s / "
            f"verify {self.verify_time_s:.2f} s)"
        )
