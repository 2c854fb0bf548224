"""The reference window: the full model's residual stream for recently committed tokens.

The decoder fills it from its own verify passes (no extra forward): for each round it keeps
the hidden states at all ``2L + 1`` item points of the tokens whose K/V were committed.
Planners and proxies compare drafts against it.
"""

from __future__ import annotations

from collections import deque

import attrs
import torch


@attrs.frozen
class ReferenceWindow:
    """The last ``r`` committed tokens as the full model saw them.

    Attributes:
        points: ``(2L + 1, r, d_model)`` residual stream at every item point.
        token_ids: ``(r,)`` the window's input tokens.
        target_tokens: ``(r,)`` the full model's greedy next token after each window token.
        start: position of the first window token. The window is the *end* of the cache:
            ``start + r`` equals the committed cache length when the window was taken, and
            positions ``< start`` are the context the window attends to.
    """

    points: torch.Tensor
    token_ids: torch.Tensor
    target_tokens: torch.Tensor
    start: int

    @property
    def size(self) -> int:
        """Number of tokens ``r``."""
        return int(self.points.shape[1])

    @property
    def positions(self) -> torch.Tensor:
        """``(r,)`` true positions of the window tokens."""
        return torch.arange(self.start, self.start + self.size, device=self.points.device)

    @property
    def final_hidden(self) -> torch.Tensor:
        """``(r, d_model)`` the full model's last residual state (before the final norm)."""
        return self.points[-1]


class WindowBuffer:
    """Keeps the hidden states of the tokens committed in the last ``rounds`` rounds.

    Memory is bounded by ``rounds * (max_draft_length + 1)`` tokens (plus the prefill seed).
    """

    def __init__(self, rounds: int, max_tokens: int = 256) -> None:
        if rounds < 1:
            raise ValueError(f"window rounds must be >= 1, got {rounds}")
        self.rounds = rounds
        self.max_tokens = max_tokens
        self._chunks: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = deque()
        self._assembled: ReferenceWindow | None = None  # window() since the last change

    def clear(self) -> None:
        self._chunks.clear()
        self._assembled = None

    def push(
        self, points: torch.Tensor, token_ids: torch.Tensor, target_tokens: torch.Tensor, start: int
    ) -> None:
        """Add one round's committed tokens.

        Args:
            points: ``(2L + 1, t, d)``; token_ids, target_tokens: ``(t,)``; start: position
                of the first of them. Rounds must be contiguous: a round starts where the
                previous one ended.
        """
        if self._chunks:
            last_points, _, _, last_start = self._chunks[-1]
            if last_start + last_points.shape[1] != start:
                self._chunks.clear()  # not contiguous (e.g. a new prompt): start over
        self._chunks.append((points, token_ids, target_tokens, start))
        while len(self._chunks) > self.rounds:
            self._chunks.popleft()
        self._assembled = None

    def __len__(self) -> int:
        return sum(int(c[0].shape[1]) for c in self._chunks)

    @property
    def end(self) -> int | None:
        """Position after the last buffered token (None when empty)."""
        if not self._chunks:
            return None
        points, _, _, start = self._chunks[-1]
        return start + int(points.shape[1])

    def window(self) -> ReferenceWindow | None:
        """The current window, or None before anything was committed.

        Assembled (one concatenation) on the first call after a change and reused until
        the next :meth:`push` or :meth:`clear`.
        """
        if not self._chunks:
            return None
        if self._assembled is None:
            self._assembled = self._assemble()
        return self._assembled

    def _assemble(self) -> ReferenceWindow:
        points = torch.cat([c[0] for c in self._chunks], dim=1)
        token_ids = torch.cat([c[1] for c in self._chunks])
        target = torch.cat([c[2] for c in self._chunks])
        start = self._chunks[0][3]
        if points.shape[1] > self.max_tokens:
            cut = points.shape[1] - self.max_tokens
            points, token_ids, target, start = (
                points[:, cut:],
                token_ids[cut:],
                target[cut:],
                start + cut,
            )
        return ReferenceWindow(
            points=points, token_ids=token_ids, target_tokens=target, start=start
        )


__all__ = ["ReferenceWindow", "WindowBuffer"]
