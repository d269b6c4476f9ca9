"""The vocabulary every schedule is written in.

An ``Action`` is one compute step of one rank: a forward (``F``) or backward (``B``) of one
microbatch through one of the rank's model chunks, a combined forward-and-backward (``FB``) in
which the forward of one microbatch is overlapped with the backward of another, or a deferred
weight gradient (``W``). Its kind is an :class:`ActionKind`.

Chunks are *local* ids ``0..vp-1``. Which virtual stage local chunk ``c`` of pipeline rank ``r``
is depends on the schedule's placement (:func:`virtual_stage`): ``c * pp + r`` for the loop
placement of most schedules (Megatron's interleaved placement; with ``vp == 1`` the virtual stage
is the rank itself), a V for the two-chunk V schedules. Code that needs a stage asks the
configuration (``cfg.stage_of(rank, chunk)``, ``cfg.owner_of(stage)``) rather than computing it.

Split backwards (the zero-bubble schedules). A table may split the backward of a (microbatch,
chunk) into its input gradient and its weight gradient. The rule, per rank:

* If the rank's list holds a ``W`` for (microbatch, chunk), that rank's ``B`` for the same
  (microbatch, chunk) -- or the backward half of an ``FB`` -- computes **only the input gradient**
  (what the previous stage waits for), and it comes **before** the ``W``. The ``W`` computes the
  weight gradient from what the ``B`` left behind. Each such ``B`` has **exactly one** ``W``.
* If there is no ``W`` for (microbatch, chunk), its ``B`` is the **full** backward, as in every
  schedule without ``W`` actions.

The activations of a split (microbatch, chunk) stay alive until its ``W`` (the simulator counts
them in flight until then). :func:`split_backwards` lists a rank's split pairs and
:func:`check_actions` enforces the rule.
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


def weight_grad(microbatch: int, chunk: int) -> Action:
    """The deferred weight gradient of an earlier ``B`` of the same (microbatch, chunk)."""
    return Action(WEIGHT_GRAD, microbatch, chunk)


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


def split_backwards(actions) -> set:
    """The (microbatch, chunk) pairs whose backward is split in one rank's list ``actions``: those
    that have a ``W``. Their ``B`` (or ``FB`` backward half) computes only the input gradient."""
    return {(action[1], action[2]) for action in actions if action[0] == WEIGHT_GRAD}


def _check_ids(cfg, rank: int, action) -> None:
    kind = action[0]
    if kind not in KINDS:
        raise ValueError(f"rank {rank}: unknown action kind {kind!r} in {action!r}.")
    halves = [(action[1], action[2])]
    if kind == FORWARD_BACKWARD:
        halves.append((action[3], action[4]))
    for microbatch, chunk in halves:
        if not (isinstance(microbatch, int) and 0 <= microbatch < cfg.num_microbatches):
            raise ValueError(
                f"rank {rank}: microbatch={microbatch!r} in {action!r} is out of range "
                f"for num_microbatches={cfg.num_microbatches}."
            )
        if not (isinstance(chunk, int) and 0 <= chunk < cfg.vp):
            raise ValueError(f"rank {rank}: chunk={chunk!r} in {action!r} is out of range for vp={cfg.vp}.")


def check_actions(cfg, actions) -> None:
    """Reject per-rank tables that do not fit ``cfg`` (a :class:`~lightning_pp.schedules.tables.
    ScheduleConfig`): a wrong number of ranks, unknown kinds, ids out of range, or a ``W`` that
    breaks the split-backward rule (no earlier ``B`` of its (microbatch, chunk) on that rank, or a
    second ``W`` for it). Order across ranks is not checked here: the simulator finds deadlocks."""
    if len(actions) != cfg.pp:
        raise ValueError(f"actions holds {len(actions)} per-rank lists but pp={cfg.pp}: give one list per rank.")
    for rank, rank_list in enumerate(actions):
        backwarded = set()
        weighted = set()
        for position, action in enumerate(rank_list):
            _check_ids(cfg, rank, action)
            kind = action[0]
            if kind == BACKWARD:
                backwarded.add((action[1], action[2]))
            elif kind == FORWARD_BACKWARD:
                backwarded.add((action[3], action[4]))
            elif kind == WEIGHT_GRAD:
                pair = (action[1], action[2])
                where = f"rank {rank}, action #{position} W{pair[0]}.{pair[1]}"
                if pair in weighted:
                    raise ValueError(
                        f"{where}: a second W for microbatch {pair[0]}, chunk {pair[1]}. A split "
                        f"backward has exactly one W: remove the extra one."
                    )
                if pair not in backwarded:
                    raise ValueError(
                        f"{where}: no B for microbatch {pair[0]}, chunk {pair[1]} before it on this "
                        f"rank. A W computes the weight gradient its input-gradient B left behind: "
                        f"put it after that B."
                    )
                weighted.add(pair)


def check_complete(cfg, actions) -> None:
    """Reject training tables in which some (microbatch, chunk) of a rank does not run exactly one
    forward and exactly one backward (a ``B``, or the backward half of an ``FB``): a missing
    backward would silently drop that microbatch's gradient, a repeated one count it twice."""
    expected = [(mb, chunk) for mb in range(cfg.num_microbatches) for chunk in range(cfg.vp)]
    for rank, rank_list in enumerate(actions):
        forwards: dict = {}
        backwards: dict = {}
        for action in rank_list:
            f, b = action.forward_part(), action.backward_part()
            if f is not None:
                forwards[f] = forwards.get(f, 0) + 1
            if b is not None:
                backwards[b] = backwards.get(b, 0) + 1
        for pair in expected:
            counts = (forwards.get(pair, 0), backwards.get(pair, 0))
            if counts != (1, 1):
                raise ValueError(
                    f"rank {rank}: microbatch {pair[0]}, chunk {pair[1]} runs {counts[0]} forward(s) and {counts[1]} "
                    f"backward(s) in the table; a training table runs each (microbatch, chunk) of its rank exactly "
                    f"once forward and once backward (B, or the backward half of an FB).")
