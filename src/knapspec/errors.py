"""Errors that several layers raise, defined below all of them.

An error raised by the engine's callers (a drafter's pass, the decoder's verify pass, the
batch loop) and caught by the caller of :class:`~knapspec.SpeculativeDecoder` belongs to
none of those layers: it lives here, so a drafter need not import the decoding package to
raise it. The modules that raised it first re-export it, so the old import paths still
work.
"""

from __future__ import annotations


class NonFiniteLogitsError(FloatingPointError):
    """The model produced NaN or infinite logits; no token was committed.

    Raised through :func:`knapspec.validators.check_finite` with ``error=during``."""

    @classmethod
    def during(cls, where: str) -> NonFiniteLogitsError:
        """The error for non-finite logits in pass ``where`` (``"prefill"``, ...)."""
        return cls(
            f"the model produced NaN/inf logits during {where}; check the weights and dtype "
            f"(fp16 overflow is a common cause). Nothing was committed for this step."
        )


__all__ = ["NonFiniteLogitsError"]
