"""The vocabulary every schedule is written in.

An ``Action`` is one compute step of one rank: a forward (``F``) or backward (``B``) of one
microbatch through one of the rank's model chunks, or a combined forward-and-backward (``FB``)
in which the forward of one microbatch is overlapped with the backward of another.

Chunks are *local* ids ``0..vp-1``. Local chunk ``c`` on pipeline rank ``r`` is virtual stage
``c * pp + r`` (Megatron's interleaved placement), so with ``vp == 1`` the virtual stage is the
rank itself.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

FORWARD = "F"
BACKWARD = "B"
FORWARD_BACKWARD = "FB"
WEIGHT_GRAD = "W"

KINDS = (FORWARD, BACKWARD, FORWARD_BACKWARD, WEIGHT_GRAD)


class Action(NamedTuple):
    """One step of a rank's schedule.

    For ``F``, ``B`` and ``W`` only ``microbatch`` and ``chunk`` are set. For ``FB`` they are the
    forward half, and ``b_microbatch`` / ``b_chunk`` the backward half.
    """

    kind: str
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
        if self.kind == FORWARD_BACKWARD:
            return {
                "kind": self.kind,
                "f_microbatch": self.microbatch,
                "f_chunk": self.chunk,
                "b_microbatch": self.b_microbatch,
                "b_chunk": self.b_chunk,
            }
        return {"kind": self.kind, "microbatch": self.microbatch, "chunk": self.chunk}


def forward(microbatch: int, chunk: int) -> Action:
    return Action(FORWARD, microbatch, chunk)


def backward(microbatch: int, chunk: int) -> Action:
    return Action(BACKWARD, microbatch, chunk)


def forward_backward(f: tuple[int, int], b: tuple[int, int]) -> Action:
    return Action(FORWARD_BACKWARD, f[0], f[1], b[0], b[1])


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    """Global virtual stage of local ``chunk`` on pipeline ``rank``."""
    return chunk * pp + rank


def stage_owner(stage: int, pp: int) -> tuple[int, int]:
    """(pipeline rank, local chunk) that holds virtual ``stage``."""
    return stage % pp, stage // pp
