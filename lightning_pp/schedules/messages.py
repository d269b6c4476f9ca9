"""Which stage-boundary messages each rank sends, and in which order.

A message is identified by ``(direction, microbatch, stage)``: ``("F", mb, s)`` carries the
activations *into* virtual stage ``s``, ``("B", mb, s)`` carries the gradient *into* the output of
virtual stage ``s``. The runtime posts its receives in the order the peer sends, which this module
derives from the peer's action list, so every backend (including ones that match point-to-point
messages in FIFO order and ignore tags) pairs each message with the right receive.

Stages follow the schedule's placement (``cfg.stage_of`` / ``cfg.owner_of``). Where two adjacent
stages live on the same rank (any table with ``pp == 1``, and the turn of a V: stage ``pp - 1`` to
``pp`` on the last rank), the "message" is a local hand-off: its destination is the sending rank
itself, and :func:`send_order` towards another rank never lists it. A split backward (``B``
followed by a ``W``) sends its input gradient when the ``B`` runs; a ``W`` sends nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

from lightning_pp.schedules.actions import Action

if TYPE_CHECKING:  # tables.py imports this module to make a rank's plan
    from lightning_pp.schedules.tables import ScheduleConfig


class Message(NamedTuple):
    direction: str  # "F" (activation) or "B" (gradient)
    microbatch: int
    stage: int  # the virtual stage that consumes it

    def describe(self) -> str:
        what = "activation into" if self.direction == "F" else "gradient into the output of"
        return f"{what} stage {self.stage} for microbatch {self.microbatch}"


def forward_message(cfg: ScheduleConfig, rank: int, microbatch: int, chunk: int) -> Optional[tuple[int, Message]]:
    """(destination rank, message) produced by a forward of ``chunk``, or None on the last stage.
    The destination is ``rank`` itself for a local hand-off."""
    stage = cfg.stage_of(rank, chunk)
    if stage + 1 >= cfg.num_stages:
        return None
    return cfg.owner_of(stage + 1)[0], Message("F", microbatch, stage + 1)


def backward_message(cfg: ScheduleConfig, rank: int, microbatch: int, chunk: int) -> Optional[tuple[int, Message]]:
    """(destination rank, message) produced by a backward (the input gradient) of ``chunk``, or
    None on the first stage. The destination is ``rank`` itself for a local hand-off."""
    stage = cfg.stage_of(rank, chunk)
    if stage == 0:
        return None
    return cfg.owner_of(stage - 1)[0], Message("B", microbatch, stage - 1)


def action_sends(cfg: ScheduleConfig, rank: int, action: Action) -> list[tuple[int, Message]]:
    """Messages ``action`` sends, in send order: the forward output first, then the input grad."""
    sends = []
    fwd = action.forward_part()
    if fwd is not None:
        msg = forward_message(cfg, rank, *fwd)
        if msg is not None:
            sends.append(msg)
    bwd = action.backward_part()
    if bwd is not None:
        msg = backward_message(cfg, rank, *bwd)
        if msg is not None:
            sends.append(msg)
    return sends


def send_order(cfg: ScheduleConfig, rank: int, actions: list[Action], dst: int) -> list[Message]:
    """Every message ``rank`` sends to ``dst`` (a different rank) in one step, in order. With
    ``dst == rank`` it lists the local hand-offs instead."""
    return [msg for action in actions for to, msg in action_sends(cfg, rank, action) if to == dst]


def action_receives(cfg: ScheduleConfig, rank: int, action: Action) -> list[tuple[int, Message]]:
    """(source rank, message) of every message ``action`` consumes from another rank: the input
    of its forward, the output gradient of its backward."""
    received = []
    fwd = action.forward_part()
    if fwd is not None:
        stage = cfg.stage_of(rank, fwd[1])
        if stage > 0:
            received.append((cfg.owner_of(stage - 1)[0], Message("F", fwd[0], stage)))
    bwd = action.backward_part()
    if bwd is not None:
        stage = cfg.stage_of(rank, bwd[1])
        if stage < cfg.num_stages - 1:
            received.append((cfg.owner_of(stage + 1)[0], Message("B", bwd[0], stage)))
    return [(src, msg) for src, msg in received if src != rank]


def delivery_marks(cfg: ScheduleConfig, rank: int, tables: list[list[Action]]) -> tuple[dict, dict]:
    """When a message ``rank`` sent is known to be delivered, from the per-rank ``tables``.

    Returns ``(consumed_at, sent_at)``: ``consumed_at[(peer, message)]`` is the index of the
    peer's action that consumes a message ``rank`` sends it, ``sent_at[(peer, message)]`` the
    index of the peer's action that sends a message ``rank`` receives. Once ``rank`` holds a
    message the peer sent at index ``k``, the peer has finished every action before ``k``, so
    every message ``rank`` sent it that is consumed at an index below ``k`` has arrived: its send
    buffer can be released (a backend such as gloo does not report that by itself)."""
    consumed_at, sent_at = {}, {}
    for peer, actions in enumerate(tables):
        if peer == rank:
            continue
        for index, action in enumerate(actions):
            for dst, msg in action_sends(cfg, peer, action):
                if dst == rank:
                    sent_at[(peer, msg)] = index
            for src, msg in action_receives(cfg, peer, action):
                if src == rank:
                    consumed_at[(peer, msg)] = index
    return consumed_at, sent_at
