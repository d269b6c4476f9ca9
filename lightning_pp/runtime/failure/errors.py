"""The exceptions a pipelined step raises, and two helpers for building them.

:class:`PipelineError` (a step failed; names the rank that failed first), :class:`PipelineCommError`
(a transfer or in-step collective failed or timed out), :class:`BatchMismatchError` and
:class:`NonFiniteError` (raised on every rank at the same step); :func:`classify` tells a timeout
from a closed connection in a backend's error text, :func:`add_note` adds a note where Python
supports notes (3.11+).
"""

from __future__ import annotations

from typing import Optional


class PipelineError(RuntimeError):
    """A pipelined step failed; the message names the rank that failed first."""


class PipelineCommError(RuntimeError):
    """A stage-boundary transfer or an in-step collective failed or timed out.

    ``peer`` is the global rank on the other end (``None`` for a collective); ``reason`` is
    ``"timeout"``, ``"closed"`` (the connection went away: the peer's process ended) or ``"error"``.
    """

    def __init__(self, message: str, peer: Optional[int] = None, reason: str = "error") -> None:
        super().__init__(message)
        self.peer = peer
        self.reason = reason


class BatchMismatchError(ValueError):
    """The stages of one pipeline were given different batches (``check_batches="raise"``).
    Raised on every rank at the same step (the comparison rides on the step's loss all-reduce)."""


class NonFiniteError(FloatingPointError):
    """The loss or the gradients of a step were not finite, and ``nonfinite="raise"``. Raised on
    every rank at the same step (the decision is collective)."""


def classify(exc: BaseException) -> str:
    """``"timeout"`` or ``"closed"`` from a backend's exception text."""
    text = str(exc).lower()
    return "timeout" if "timed out" in text or "timeout" in text else "closed"


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11+); nothing on 3.10."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
