"""The vocabulary every schedule is written in.

An ``Action`` is one compute step of one rank: a forward (``F``) or backward (``B``) of one
microbatch through one of the rank's model chunks, a combined forward-and-backward (``FB``) in
which the forward of one microbatch is overlapped with the backward of another, or a deferred
weight gradient (``W``). Its kind is an :class:`ActionKind`.

Chunks are *local* ids ``0..vp-1``. Local chunk ``c`` on pipeline rank ``r`` is virtual stage
``c * pp + r`` (Megatron's interleaved placement), so with ``vp == 1`` the virtual stage is the
rank itself.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Optional


class ActionKind(str, Enum):
    """What an action computes. A ``str`` enum: each member equals (and hashes like) its value,
    so code, traces and JSON that use the plain strings ``"F"``, ``"B"``, ``"FB"`` and ``"W"``
    keep working, and a hand-made ``Action("F", 0, 0)`` is the same action as ``forward(0, 0)``."""

    FORWARD = "F"
    BACKWARD = "B"
    FORWARD_BACKWARD = "FB"  # combined 1F1B: one microbatch's forward overlapped with another's backward
    WEIGHT_GRAD = "W"  # deferred weight gradient (zero-bubble schedules)

    def __str__(self) -> str:
        # The value, as the plain strings printed: str() and f-strings show "F", not Enum's
        # "ActionKind.FORWARD" (which f-strings also show since Python 3.11).
        return self.value


FORWARD = ActionKind.FORWARD
BACKWARD = ActionKind.BACKWARD
FORWARD_BACKWARD = ActionKind.FORWARD_BACKWARD
WEIGHT_GRAD = ActionKind.WEIGHT_GRAD

KINDS = tuple(ActionKind)


class Action(NamedTuple):
    """One step of a rank's schedule.

    For ``F``, ``B`` and ``W`` only ``microbatch`` and ``chunk`` are set. For ``FB`` they are the
    forward half, and ``b_microbatch`` / ``b_chunk`` the backward half.
    """

    kind: ActionKind  # or its plain string value, in a hand-made table
    microbatch: int
    chunk: int
    b_microbatch: Optional[int] = None
    b_chunk: Optional[int] = None

    def forward_part(self) -> Optional[tuple[int, int]]:
        """(microbatch, chunk) this action runs forward, or None."""
        if self.kind in (FORWARD, FORWARD_BACKWARD):
            return self.microbatch, self.chunk
        return None

    def backward_part(self) -> Optional[tuple[int, int]]:
        """(microbatch, chunk) this action runs backward, or None."""
        if self.kind == BACKWARD:
            return self.microbatch, self.chunk
        if self.kind == FORWARD_BACKWARD:
            return self.b_microbatch, self.b_chunk
        return None

    def describe(self) -> str:
        """Short human form used in error messages and ASCII timelines: ``F3.0``, ``B3.1``,
        ``F4.0+B1.1``."""
        if self.kind == FORWARD_BACKWARD:
            return f"F{self.microbatch}.{self.chunk}+B{self.b_microbatch}.{self.b_chunk}"
        return f"{self.kind}{self.microbatch}.{self.chunk}"

    def to_dict(self) -> dict:
        """JSON-ready form; ``kind`` is the plain string (``"F"``, ...)."""
        if self.kind == FORWARD_BACKWARD:
            return {
                "kind": str(self.kind),
                "f_microbatch": self.microbatch,
                "f_chunk": self.chunk,
                "b_microbatch": self.b_microbatch,
                "b_chunk": self.b_chunk,
            }
        return {"kind": str(self.kind), "microbatch": self.microbatch, "chunk": self.chunk}


def forward(microbatch: int, chunk: int) -> Action:
    return Action(FORWARD, microbatch, chunk)


def backward(microbatch: int, chunk: int) -> Action:
    return Action(BACKWARD, microbatch, chunk)


def forward_backward(f: tuple[int, int], b: tuple[int, int]) -> Action:
    return Action(FORWARD_BACKWARD, f[0], f[1], b[0], b[1])


PLACEMENTS = ("loop", "v")


def virtual_stage(rank: int, chunk: int, pp: int, placement: str = "loop") -> int:
    """Global virtual stage of local ``chunk`` on pipeline ``rank``. ``placement`` is ``"loop"``
    (stage ``chunk * pp + rank``) or ``"v"`` (two chunks: stage ``rank``, then ``2 * pp - 1 - rank``);
    a schedule's own is :attr:`ScheduleConfig.placement`."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def stage_owner(stage: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(pipeline rank, local chunk) that holds virtual ``stage``: the inverse of
    :func:`virtual_stage`."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp
