"""Replay per-rank action tables against a cost model: timeline, makespan, bubble, memory.

The simulator answers "what would this schedule cost?" without any process group. Every rank
runs its actions strictly in list order (exactly what the runtime does), and an action starts as
soon as the rank is free *and* its inputs have arrived:

* ``F(mb, s)`` needs ``F(mb, s - 1)`` finished, plus the stage-boundary transfer time when the
  previous virtual stage lives on another rank (virtual stage ``s = chunk * pp + rank``).
* ``B(mb, s)`` needs this rank's own ``F(mb, s)`` and the gradient from ``B(mb, s + 1)`` plus the
  transfer time; the last stage only needs its own forward (the loss is computed locally).
* ``FB`` (combined 1F1B) needs both its forward input and its backward gradient; both outputs are
  available when the combined action ends.
* ``W(mb, s)`` (deferred weight gradient) needs this rank's ``B(mb, s)``.

Because there is no contention other than "one action at a time per rank", the schedule is a DAG
and every start time is a longest path. The simulator therefore does not need a time-ordered event
queue: it advances each rank as far as its inputs allow, parks a rank on the one input it is
missing, and wakes it when the producer of exactly that input is placed. Each action is placed
once, so the cost is O(total actions). If every rank is parked while some still have work, the
tables deadlock and :func:`simulate` raises ``RuntimeError`` naming the stuck ranks.

Costs (:class:`~lightning_pp.schedules.costs.CostModel`, re-exported here) are per (microbatch,
chunk) action and unit-free. :class:`SimulationResult` holds what was found.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Optional, Sequence

from lightning_pp.schedules.actions import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    KINDS,
    WEIGHT_GRAD,
    Action,
)
from lightning_pp.schedules.costs import CostModel, allreduce_time
from lightning_pp.schedules.tables import ScheduleConfig, all_rank_actions

#: One placed action: (pipeline rank, action, start time, end time).
Event = tuple  # (int, Action, float, float)


@dataclass
class SimulationResult:
    """What :func:`simulate` found. Times are in the cost model's unit.

    ``events`` is ordered by rank, then by each rank's execution order (which is also start time).
    """

    pp: int
    events: list
    makespan: float
    pipeline_makespan: float
    busy: list
    bubble_fraction: float
    rank_bubble: list
    peak_inflight: list
    exposed_a2a: list
    allreduce_algorithm: str
    allreduce_time: float = 0.0
    rank_end: list = field(default_factory=list)

    def rank_events(self, rank: int) -> list:
        """Events of one rank, in execution order."""
        return [event for event in self.events if event[0] == rank]

    def to_dict(self, events: bool = True) -> dict:
        """JSON-ready summary (and, unless ``events=False``, every placed action)."""
        out = {
            "pp": self.pp,
            "makespan": self.makespan,
            "pipeline_makespan": self.pipeline_makespan,
            "bubble_fraction": self.bubble_fraction,
            "busy": list(self.busy),
            "rank_bubble": list(self.rank_bubble),
            "peak_inflight": list(self.peak_inflight),
            "exposed_a2a": list(self.exposed_a2a),
            "allreduce_algorithm": self.allreduce_algorithm,
            "allreduce_time": self.allreduce_time,
            "rank_end": list(self.rank_end),
        }
        if events:
            out["events"] = [
                {"rank": rank, "action": action.to_dict(), "start": start, "end": end}
                for rank, action, start, end in self.events
            ]
        return out


def _check_actions(cfg: ScheduleConfig, actions: Sequence[Sequence[Action]]) -> None:
    """Reject hand-made tables the simulator could misread (wrong rank count, ids out of range)."""
    if len(actions) != cfg.pp:
        raise ValueError(f"actions holds {len(actions)} per-rank lists but pp={cfg.pp}: give one list per rank.")
    for rank, rank_list in enumerate(actions):
        for action in rank_list:
            kind = action[0]
            if kind not in KINDS:
                raise ValueError(f"rank {rank}: unknown action kind {kind!r} in {action!r}.")
            halves = [(action[1], action[2])]
            if kind == FORWARD_BACKWARD:
                halves.append((action[3], action[4]))
            for microbatch, chunk in halves:
                if not (isinstance(microbatch, int) and 0 <= microbatch < cfg.microbatches):
                    raise ValueError(
                        f"rank {rank}: microbatch={microbatch!r} in {action!r} is out of range "
                        f"for num_microbatches={cfg.microbatches}."
                    )
                if not (isinstance(chunk, int) and 0 <= chunk < cfg.vp):
                    raise ValueError(f"rank {rank}: chunk={chunk!r} in {action!r} is out of range for vp={cfg.vp}.")


def simulate(
    cfg: ScheduleConfig,
    costs: CostModel = CostModel(),
    actions: Optional[Sequence[Sequence[Action]]] = None,
) -> SimulationResult:
    """Simulate ``cfg``'s tables (or the given per-rank ``actions``) under ``costs``.

    Raises ``RuntimeError`` naming the stuck ranks and their next actions if the tables deadlock,
    and ``ValueError`` if hand-made ``actions`` do not fit ``cfg``.
    """
    # Generating and placing hundreds of thousands of small tuples makes the cyclic garbage
    # collector rescan the growing heap again and again (it was ~40% of the run time); nothing
    # built here forms a cycle, so collection is paused for the duration.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if actions is None:
            actions = all_rank_actions(cfg)
        else:
            _check_actions(cfg, actions)
        return _simulate(cfg, costs, actions)
    finally:
        if gc_was_enabled:
            gc.enable()


def _simulate(cfg: ScheduleConfig, costs: CostModel, actions: Sequence[Sequence[Action]]) -> SimulationResult:
    pp, vp, m = cfg.pp, cfg.vp, cfg.microbatches
    num_stages = pp * vp
    last_stage = num_stages - 1

    kind_of = itemgetter(0)
    has_w = any(WEIGHT_GRAD in map(kind_of, rank_list) for rank_list in actions)
    backward_compute = costs.backward + (0.0 if has_w else costs.weight_grad)
    dur_f = costs.forward + costs.a2a_forward
    dur_b = backward_compute + costs.a2a_backward
    fb_compute = costs.forward + backward_compute
    fb_comm = costs.a2a_forward + costs.a2a_backward
    dur_fb = max(fb_compute, fb_comm)
    dur_w = costs.weight_grad
    exp_f, exp_b, exp_fb = costs.a2a_forward, costs.a2a_backward, max(0.0, fb_comm - fb_compute)
    # Adjacent virtual stages live on adjacent ranks, so every hand-off crosses ranks unless pp == 1.
    hop = costs.p2p_time() if pp > 1 else 0.0

    # End time of F / B of (microbatch, stage) at index stage * m + microbatch; -1 = not placed yet.
    size = num_stages * m
    f_end = [-1.0] * size
    b_end = [-1.0] * size
    # A parked rank waits for exactly one input: key idx >= 0 is "F(idx) done", ~idx is "B(idx) done".
    # ``size`` is no key at all (int sentinel: int == int compares faster than int == None).
    not_waiting = size
    waiting = [not_waiting] * pp
    next_index = [0] * pp
    clock = [0.0] * pp
    inflight = [0] * pp
    peak = [0] * pp
    per_rank_events: list = [[] for _ in range(pp)]
    ready = list(range(pp - 1, -1, -1))
    F, B, FB, W = FORWARD, BACKWARD, FORWARD_BACKWARD, WEIGHT_GRAD  # locals: faster than globals

    while ready:
        r = ready.pop()
        rank_list = actions[r]
        n = len(rank_list)
        i = next_index[r]
        t = clock[r]
        cur, pk = inflight[r], peak[r]
        emit = per_rank_events[r].append
        next_rank = r + 1 if r + 1 < pp else 0
        prev_rank = r - 1 if r > 0 else pp - 1
        while i < n:
            action = rank_list[i]
            kind = action[0]
            if kind == F:
                stage = action[2] * pp + r
                idx = stage * m + action[1]
                start = t
                if stage:
                    arrival = f_end[idx - m]
                    if arrival < 0:
                        waiting[r] = idx - m
                        break
                    arrival += hop
                    if arrival > start:
                        start = arrival
                t = start + dur_f
                f_end[idx] = t
                if stage != last_stage and waiting[next_rank] == idx:
                    waiting[next_rank] = not_waiting
                    ready.append(next_rank)
                cur += 1
                if cur > pk:
                    pk = cur
            elif kind == B:
                stage = action[2] * pp + r
                idx = stage * m + action[1]
                start = f_end[idx]
                if start < 0:  # own forward not run yet: it is later in this list, so never
                    waiting[r] = idx
                    break
                if start < t:
                    start = t
                if stage != last_stage:
                    arrival = b_end[idx + m]
                    if arrival < 0:
                        waiting[r] = ~(idx + m)
                        break
                    arrival += hop
                    if arrival > start:
                        start = arrival
                t = start + dur_b
                b_end[idx] = t
                if stage and waiting[prev_rank] == ~idx:
                    waiting[prev_rank] = not_waiting
                    ready.append(prev_rank)
                cur -= 1
            elif kind == FB:
                f_stage = action[2] * pp + r
                f_idx = f_stage * m + action[1]
                b_stage = action[4] * pp + r
                b_idx = b_stage * m + action[3]
                start = t
                if f_stage:
                    arrival = f_end[f_idx - m]
                    if arrival < 0:
                        waiting[r] = f_idx - m
                        break
                    arrival += hop
                    if arrival > start:
                        start = arrival
                own = f_end[b_idx]
                if own < 0:
                    waiting[r] = b_idx
                    break
                if own > start:
                    start = own
                if b_stage != last_stage:
                    arrival = b_end[b_idx + m]
                    if arrival < 0:
                        waiting[r] = ~(b_idx + m)
                        break
                    arrival += hop
                    if arrival > start:
                        start = arrival
                t = start + dur_fb
                f_end[f_idx] = t
                b_end[b_idx] = t
                if f_stage != last_stage and waiting[next_rank] == f_idx:
                    waiting[next_rank] = not_waiting
                    ready.append(next_rank)
                if b_stage and waiting[prev_rank] == ~b_idx:
                    waiting[prev_rank] = not_waiting
                    ready.append(prev_rank)
                # The forward half allocates before the backward half frees.
                if cur + 1 > pk:
                    pk = cur + 1
            elif kind == W:
                idx = (action[2] * pp + r) * m + action[1]
                start = b_end[idx]
                if start < 0:  # own backward is later in this list: never
                    waiting[r] = ~idx
                    break
                if start < t:
                    start = t
                t = start + dur_w
            else:
                raise ValueError(f"rank {r}: unknown action kind {kind!r} in {action!r}.")
            emit((r, action, start, t))
            i += 1
        next_index[r] = i
        clock[r] = t
        inflight[r], peak[r] = cur, pk

    stuck = [r for r in range(pp) if next_index[r] < len(actions[r])]
    if stuck:
        detail = "; ".join(
            f"rank {r} waits at action #{next_index[r]} {actions[r][next_index[r]].describe()}"
            f" (for {_describe_key(waiting[r], m, pp)})"
            for r in stuck
        )
        raise RuntimeError(
            f"schedule deadlocks ({cfg.schedule}, pp={pp}, vp={vp}, num_microbatches={m}): "
            f"ranks {stuck} cannot progress: {detail}"
        )

    # Busy time and exposed all-to-all depend only on how many actions of each kind a rank runs,
    # so they are counted here (in C, via Counter) rather than summed in the placement loop.
    busy = []
    exposed = []
    for rank_list in actions:
        counts = Counter(map(kind_of, rank_list))
        n_f, n_b, n_fb, n_w = counts[F], counts[B], counts[FB], counts[W]
        busy.append(n_f * dur_f + n_b * dur_b + n_fb * dur_fb + n_w * dur_w)
        exposed.append(n_f * exp_f + n_b * exp_b + n_fb * exp_fb)

    pipeline_makespan = max(clock) if clock else 0.0
    ar_time, algorithm = costs.allreduce()
    makespan = max(c + ar_time for c in clock) if clock else 0.0
    if pipeline_makespan > 0:
        rank_bubble = [1.0 - b / pipeline_makespan for b in busy]
        bubble = 1.0 - sum(busy) / (pp * pipeline_makespan)
    else:
        rank_bubble = [0.0] * pp
        bubble = 0.0
    events = [event for rank_events in per_rank_events for event in rank_events]
    return SimulationResult(
        pp=pp,
        events=events,
        makespan=makespan,
        pipeline_makespan=pipeline_makespan,
        busy=busy,
        bubble_fraction=bubble,
        rank_bubble=rank_bubble,
        peak_inflight=peak,
        exposed_a2a=exposed,
        allreduce_algorithm=algorithm,
        allreduce_time=ar_time,
        rank_end=list(clock),
    )


def _describe_key(key: int, m: int, pp: int) -> str:
    """Human form of the input a parked rank waits for."""
    kind, idx = ("forward output", key) if key >= 0 else ("backward gradient", ~key)
    stage, microbatch = divmod(idx, m)
    rank, chunk = stage % pp, stage // pp
    return f"{kind} of microbatch {microbatch} at stage {stage} (rank {rank}, chunk {chunk})"


__all__ = ["CostModel", "SimulationResult", "allreduce_time", "simulate", "Event"]
