"""Tables of the zero-bubble schedules: ``zb1p``, ``zbv`` and ``dualpipev``.

All three split the backward of a (microbatch, chunk) into an input-gradient ``B`` (what the
previous stage waits for) and a weight-gradient ``W`` (which nobody waits for), and move the ``W``
into places where the rank would otherwise idle. The rules of a split backward are in
:mod:`lightning_pp.schedules.actions`. Bubbles below are per rank, in the cost of one chunk's
actions (``F``, input-gradient ``B``, ``W``), with free transfers, ``p = pp`` ranks and ``m``
microbatches; 1F1B's is ``(p - 1)(F + B + W)``. Memory is counted in chunk activations held from
the forward until the ``W`` (or the full ``B``).

``zb1p`` -- ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3)
    1F1B with the backward split. Rank ``r`` warms up like 1F1B (``p - r - 1`` forwards) and then
    alternates ``F`` and ``B``; its ``W``\\ s lag ``r`` backwards behind (rank 0 runs each ``W`` right
    after its ``B``, the last rank holds ``p - 1`` of them back) and the held-back ones fill the
    cool-down, where the rank would wait for gradients. Bubble ``(p - 1)(F + B - W)`` (the
    paper's, for ``W <= F`` and ``W <= B`` and ``m >= p``); every rank holds at most ``p``
    microbatches until their ``W``, the peak of 1F1B (on its rank 0). Any ``m >= 1``.
    With ``vp >= 2`` it is the interleaved variant (torch's ``ScheduleInterleavedZeroBubble``):
    Megatron's grouped interleaved order, a warm-up of ``(vp - 1) * group + p - r - 1`` forwards
    (one hop per rank, not Megatron's two: the input-gradient backward is shorter than a full
    one) and the same ``W`` lag of ``r``. Same bubble ``(p - 1)(F + B - W)`` over ``vp`` times the
    work (interleaved 1F1B: ``(p - 1)(F + B + W)``); peak at most ``(vp - 1) * group + p``
    chunks, no more than interleaved 1F1B's on its rank 0. The microbatch rules are the interleaved ones. Torch's
    order is ours when our group size equals its ``microbatches_per_round``
    (``m // max(1, m // pp)``: the default group ``pp`` when ``pp`` divides ``m``). Supporting
    ``vp >= 2`` was a choice: it is the same construction, and torch ships it.

``zbv`` -- ZB-V (same paper, section 6; torch's ``ScheduleZBVZeroBubble``)
    Two chunks per rank in a V (rank ``r`` holds stages ``r`` and ``2p - 1 - r``, so the turn of
    the V, stage ``p - 1`` to ``p``, is a local hand-off on the last rank). Rank ``r`` runs
    ``2(p - r) - 1`` chunk-0 forwards, ``r`` pairs (chunk-1 forward, chunk-0 forward), ``p - r``
    triples (chunk-1 ``F``, ``B``, ``W``), then the steady state (chunk-0 ``F B W``, chunk-1
    ``F B W``), and cools down with ``r`` pairs of backwards whose ``W``\\ s are deferred, ``p - r``
    chunk-0 ``B W`` pairs, and the deferred ``W``\\ s (chunk 1's, then chunk 0's). Any ``m >= 1``:
    below ``2p - 1`` microbatches the table is the one for ``2p - 1`` with the missing
    microbatches' actions dropped, as torch does (dropping whole microbatches keeps a
    deadlock-free order deadlock-free). With ``F = B = W`` and ``m >= 2p - 1`` its makespan is the
    last rank's lower bound ``(p - 1) F + 2m (F + B + W)``. Peak: ``2p`` chunk activations (half a
    model each), the memory of 1F1B's ``p`` microbatches.
    The order is torch's, action for action; there is no deliberate difference.

``dualpipev`` -- DualPipeV (DeepSeek-V3's DualPipe folded into a V; torch's ``ScheduleDualPipeV``
    and deepseek-ai/DualPipe's ``DualPipeV``)
    The V placement of ``zbv``; in the steady state every step is one ``FB``: the forward of one
    microbatch on one chunk fused with the (full) backward of an older microbatch on the other
    chunk, so that one half's expert all-to-all hides under the other half's compute. Warm-up:
    ``2(p - r - 1)`` chunk-0 forwards, ``r + 1`` (chunk-0, chunk-1) forward pairs, ``p - r - 1``
    chunk-1 (``B``, oldest ``W``, ``F``) triples; main loop ``m - 2p + r + 1`` times (``FB``
    chunk 0 forward / chunk 1 backward, ``FB`` chunk 1 forward / chunk 0 backward); then
    ``p - r - 1`` (chunk-1 ``B``, ``FB``), ``r + 1`` backward pairs that switch to split
    backwards half-way, ``p - r - 1`` (oldest ``W``, chunk-0 ``B``) and the remaining ``W``\\ s. Needs
    ``m >= 2p``. The backward half of an ``FB`` is always a full backward (no ``W``), as in torch.
    Bubble ``(p - 1)(F&B + B - 3W)`` with ``B`` the full backward and ``F&B`` one fused step
    (DualPipe's README; it holds for balanced ``F = B``); peak ``2p + 1`` chunks, one more than
    ZB-V because an ``FB``'s forward half allocates before its backward half frees.
    The order is torch's, action for action, including its one unfused step (the last rank's
    first main-loop step runs its chunk-0 ``F`` and chunk-1 ``B`` as two actions -- DeepSeek's
    "to further reduce bubble size": each half starts as soon as its own input is there); there
    is no deliberate difference.
"""

from __future__ import annotations

from collections import defaultdict

from lightning_pp.schedules.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT_GRAD,
    Action,
    backward,
    forward,
    forward_backward,
)


class _Builder:
    """Appends one rank's actions, numbering microbatches in order per (kind, chunk) (every chunk
    runs its forwards, and its backwards, in microbatch order) and remembering which split
    backwards still owe their ``W``."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: dict = defaultdict(int)
        self._owed: list[tuple[int, int]] = []  # (microbatch, chunk) of split B's without W yet

    def _take(self, kind, chunk: int) -> int:
        microbatch = self._next[kind, chunk]
        self._next[kind, chunk] = microbatch + 1
        return microbatch

    def count(self, kind, chunk: int) -> int:
        """How many ``kind`` actions of ``chunk`` were appended so far."""
        return self._next[kind, chunk]

    def f(self, chunk: int) -> None:
        self.actions.append(forward(self._take(FORWARD, chunk), chunk))

    def b(self, chunk: int, split: bool = True) -> None:
        """The next backward of ``chunk``: input gradient only (``split``; its ``W`` is owed) or
        the full backward."""
        microbatch = self._take(BACKWARD, chunk)
        self.actions.append(backward(microbatch, chunk))
        if split:
            self._owed.append((microbatch, chunk))

    def fb(self, f_chunk: int, b_chunk: int) -> None:
        """Forward of ``f_chunk`` fused with the full backward of ``b_chunk``."""
        f = (self._take(FORWARD, f_chunk), f_chunk)
        self.actions.append(forward_backward(f, (self._take(BACKWARD, b_chunk), b_chunk)))

    def w(self, chunk=None) -> None:
        """The oldest owed ``W`` (of ``chunk``, if given); nothing if none is owed."""
        for position, owed in enumerate(self._owed):
            if chunk is None or owed[1] == chunk:
                del self._owed[position]
                self.actions.append(Action(WEIGHT_GRAD, *owed))
                return

    def owes(self, chunk=None) -> bool:
        return any(chunk is None or owed[1] == chunk for owed in self._owed)


def zb1p_actions(order: list, warmup: int, lag: int) -> list[Action]:
    """ZB-H1 on one rank. ``order`` is the rank's forward order of (microbatch, chunk); backwards
    follow it with the chunk order reversed (``vp`` from the largest chunk id in ``order``),
    ``warmup`` forwards run first, and each ``W`` runs ``lag`` backwards after its ``B``."""
    vp = 1 + max((chunk for _, chunk in order), default=0)
    backwards = [(mb, vp - 1 - chunk) for mb, chunk in order]
    total = len(order)
    actions = [forward(*order[k]) for k in range(warmup)]
    for k in range(total):
        if warmup + k < total:
            actions.append(forward(*order[warmup + k]))
        actions.append(backward(*backwards[k]))
        if k >= lag:
            actions.append(Action(WEIGHT_GRAD, *backwards[k - lag]))
    actions.extend(Action(WEIGHT_GRAD, *backwards[k]) for k in range(max(total - lag, 0), total))
    return actions


def zbv_actions(pp: int, rank: int, microbatches: int) -> list[Action]:
    """ZB-V on one rank (chunk 0 = stage ``rank``, chunk 1 = stage ``2 * pp - 1 - rank``)."""
    padded = max(2 * pp - 1, microbatches)
    t = _Builder()
    for _ in range(2 * (pp - rank) - 1):
        t.f(0)
    for _ in range(rank):
        t.f(1)
        t.f(0)
    for _ in range(pp - rank):
        t.f(1)
        t.b(1)
        t.w(1)
    # Steady state: until every chunk-0 forward has run and chunk 1 has caught up with chunk 0.
    while t.count(FORWARD, 1) < t.count(FORWARD, 0) or t.count(FORWARD, 0) < padded:
        if t.count(FORWARD, 0) < padded:
            t.f(0)
        t.b(0)
        t.w(0)
        t.f(1)
        t.b(1)
        t.w(1)
    for _ in range(rank):
        t.b(0)
        t.b(1)
    for _ in range(pp - rank):
        t.b(0)
        t.w(0)
    while t.owes(1):
        t.w(1)
    while t.owes(0):
        t.w(0)
    return [a for a in t.actions if a.microbatch < microbatches]


def dualpipev_actions(pp: int, rank: int, microbatches: int) -> list[Action]:
    """DualPipeV on one rank (chunk 0 = stage ``rank``, chunk 1 = stage ``2 * pp - 1 - rank``)."""
    t = _Builder()
    for _ in range(2 * (pp - rank - 1)):
        t.f(0)
    for _ in range(rank + 1):
        t.f(0)
        t.f(1)
    for _ in range(pp - rank - 1):
        t.b(1)
        t.w()
        t.f(1)
    for step in range(microbatches - 2 * pp + rank + 1):
        if step == 0 and rank == pp - 1:
            t.f(0)
            t.b(1, split=False)
        else:
            t.fb(0, 1)
        t.fb(1, 0)
    for _ in range(pp - rank - 1):
        t.b(1, split=False)
        t.fb(1, 0)
    # The last backward pairs: the second half of them split off their W's (odd ranks switch one
    # backward earlier, between chunk 1 and chunk 0 of the middle pair).
    split = False
    pairs = rank + 1
    for i in range(pairs):
        split = split or (i == pairs // 2 and rank % 2 == 1)
        t.b(1, split)
        split = split or i == pairs // 2
        t.b(0, split)
    for _ in range(pp - rank - 1):
        t.w()
        t.b(0)
    while t.owes():
        t.w()
    return t.actions


__all__ = ["dualpipev_actions", "zb1p_actions", "zbv_actions"]
