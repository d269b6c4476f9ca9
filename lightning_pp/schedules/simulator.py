"""Replay per-rank action tables against a cost model: timeline, makespan, bubble, memory.

The simulator answers "what would this schedule cost?" without any process group. Every rank
runs its actions strictly in list order (exactly what the runtime does), and an action starts as
soon as the rank is free *and* its inputs have arrived (stages are the configuration's virtual
stages, ``cfg.stage_of(rank, chunk)``, so the loop and the V placement both work):

* ``F(mb, s)`` needs ``F(mb, s - 1)`` finished, plus the stage-boundary transfer time when stage
  ``s - 1`` lives on another rank (a hand-off between two chunks of one rank is free).
* ``B(mb, s)`` needs this rank's own ``F(mb, s)`` and the gradient from ``B(mb, s + 1)`` plus the
  transfer time; the last stage only needs its own forward (the loss is computed locally).
* ``FB`` (combined 1F1B) needs both its forward input and its backward gradient; both outputs are
  available when the combined action ends.
* ``W(mb, s)`` (deferred weight gradient) needs this rank's ``B(mb, s)``.

A ``B`` whose (microbatch, chunk) has a ``W`` on its rank is an input-gradient backward (see
:mod:`lightning_pp.schedules.actions`): it costs ``backward`` and its ``W`` costs
``weight_grad``; every other ``B`` is a full backward and costs ``backward + weight_grad``.
In-flight activations (``peak_inflight``) count a (microbatch, chunk) from its forward until its
last backward action: the ``W`` if it has one, else the ``B``.

Because there is no contention other than "one action at a time per rank", the schedule is a DAG
and every start time is a longest path. The simulator therefore does not need a time-ordered event
queue: it advances each rank as far as its inputs allow, parks a rank on the one input it is
missing, and wakes it when the producer of exactly that input is placed. Each action is placed
once, so the cost is O(total actions). If every rank is parked while some still have work, the
tables deadlock and :func:`simulate` raises ``RuntimeError`` naming the stuck ranks.

Costs (:class:`~lightning_pp.schedules.costs.CostModel`, re-exported here) are per (microbatch,
chunk) action and unit-free, one price per kind or (``CostModel.stages``) per virtual stage.
:class:`SimulationResult` holds what was found.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from lightning_pp.schedules.actions import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    WEIGHT_GRAD,
    Action,
    check_actions,
)
from lightning_pp.schedules.costs import CostModel, StageCost, allreduce_time
from lightning_pp.schedules.tables import ScheduleConfig, all_rank_actions

class Event(NamedTuple):
    """One placed action."""

    rank: int  # pipeline rank
    action: Action
    start: float
    end: float


@dataclass
class SimulationResult:
    """What :func:`simulate` found. Times are in the cost model's unit.

    ``events`` is ordered by rank, then by each rank's execution order (which is also start time).
    """

    pp: int
    events: list[Event]
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
            check_actions(cfg, actions)
        replay = _Replay(cfg, costs, actions)
        replay.run()
        return replay.result(costs)
    finally:
        if gc_was_enabled:
            gc.enable()


class _Replay:
    """One simulation in progress: per-stage input times, per-rank progress, and the placement rules.

    Times of F / B of (microbatch, stage) live at index ``stage * m + microbatch``; -1 = not placed
    yet. A parked rank waits for exactly one input: key ``idx >= 0`` is "F(idx) done", ``~idx`` is
    "B(idx) done", and ``size`` is no key at all (an int sentinel: int == int compares faster than
    int == None).
    """

    def __init__(self, cfg: ScheduleConfig, costs: CostModel, actions: Sequence[Sequence[Action]]) -> None:
        pp, m = cfg.pp, cfg.num_microbatches
        self.cfg, self.actions, self.m = cfg, actions, m
        self.last_stage = cfg.num_stages - 1
        self._layout(cfg, costs.p2p_time())
        self._durations(costs)
        size = cfg.num_stages * m
        self.f_end = [-1.0] * size
        self.b_end = [-1.0] * size
        # 1 where the backward of (microbatch, stage) is split (its rank has a W for it), else 0.
        self.split = bytearray(size)
        for r, rank_list in enumerate(actions):
            for action in rank_list:
                if action[0] == WEIGHT_GRAD:
                    self.split[self.stage_of[r][action[2]] * m + action[1]] = 1
        self.not_waiting = size
        self.waiting = [size] * pp
        self.next_index = [0] * pp
        self.clock = [0.0] * pp
        self.inflight = [0] * pp
        self.peak = [0] * pp
        self.busy = [0.0] * pp
        self.exposed = [0.0] * pp
        self.events: list = [[] for _ in range(pp)]
        self.ready = list(range(pp - 1, -1, -1))

    def _layout(self, cfg: ScheduleConfig, hop: float) -> None:
        """Where every stage lives, who consumes its outputs, and what each hand-off costs: a
        transfer between two ranks costs ``hop``, a hand-off between two chunks of one rank (the
        turn of a V, or any pp == 1 table) nothing."""
        owner = [cfg.owner_of(stage)[0] for stage in range(cfg.num_stages)]
        self.stage_of = [[cfg.stage_of(r, c) for c in range(cfg.vp)] for r in range(cfg.pp)]
        self.f_consumer = owner[1:] + [-1]  # the rank that waits for stage s's forward output
        self.b_consumer = [-1] + owner[:-1]  # the rank that waits for stage s's input gradient
        # f_hop[s]: activation from stage s - 1 into s; b_hop[s]: gradient from stage s + 1 into s.
        self.f_hop = [0.0] + [hop if owner[s - 1] != owner[s] else 0.0 for s in range(1, len(owner))]
        self.b_hop = [hop if owner[s + 1] != owner[s] else 0.0 for s in range(len(owner) - 1)] + [0.0]

    def _durations(self, costs: CostModel) -> None:
        """Compute time per virtual stage and kind (``CostModel.stage_costs``; B indexed by the split
        flag: 0 = full backward, weight gradient included; 1 = input gradient only, its W priced
        separately) and the exposed all-to-all per kind. An FB's duration depends on both its
        stages, so it is formed where it is placed."""
        stages = costs.stage_costs(self.cfg.num_stages)
        self.comp_f = [stage.forward for stage in stages]
        self.comp_b = [(stage.backward + stage.weight_grad, stage.backward) for stage in stages]
        self.dur_w = [stage.weight_grad for stage in stages]
        self.exp_f, self.exp_b = costs.a2a_forward, costs.a2a_backward
        self.fb_comm = costs.a2a_forward + costs.a2a_backward

    # -- inputs: each returns the earliest start >= ``start``, or -1.0 after parking rank r --------
    def _forward_input(self, r: int, stage: int, idx: int, start: float) -> float:
        if stage:
            arrival = self.f_end[idx - self.m]
            if arrival < 0:
                self.waiting[r] = idx - self.m
                return -1.0
            arrival += self.f_hop[stage]
            if arrival > start:
                return arrival
        return start

    def _backward_input(self, r: int, stage: int, idx: int, start: float) -> float:
        own = self.f_end[idx]
        if own < 0:  # own forward not run yet: it is later in this list, so never
            self.waiting[r] = idx
            return -1.0
        if own > start:
            start = own
        if stage != self.last_stage:  # the last stage computes its loss locally
            arrival = self.b_end[idx + self.m]
            if arrival < 0:
                self.waiting[r] = ~(idx + self.m)
                return -1.0
            arrival += self.b_hop[stage]
            if arrival > start:
                return arrival
        return start

    def _wake(self, rank: int, key: int) -> None:
        if self.waiting[rank] == key:
            self.waiting[rank] = self.not_waiting
            self.ready.append(rank)

    def _done(self, r: int, action: Action, start: float, end: float, exposed: float, held: int) -> float:
        """Record a placed action; ``held`` is the change of (microbatch, chunk)s in flight."""
        self.events[r].append(Event(r, action, start, end))
        self.busy[r] += end - start
        self.exposed[r] += exposed
        if held:
            held += self.inflight[r]
            self.inflight[r] = held
            if held > self.peak[r]:
                self.peak[r] = held
        return end

    # -- one handler per kind: the action's end time, or -1.0 if rank r had to park ---------------
    def _forward(self, r: int, action: Action, t: float) -> float:
        stage = self.stage_of[r][action[2]]
        idx = stage * self.m + action[1]
        start = self._forward_input(r, stage, idx, t)
        if start < 0:
            return start
        end = start + self.comp_f[stage] + self.exp_f
        self.f_end[idx] = end
        if stage != self.last_stage:
            self._wake(self.f_consumer[stage], idx)
        return self._done(r, action, start, end, self.exp_f, 1)

    def _backward(self, r: int, action: Action, t: float) -> float:
        stage = self.stage_of[r][action[2]]
        idx = stage * self.m + action[1]
        start = self._backward_input(r, stage, idx, t)
        if start < 0:
            return start
        split = self.split[idx]
        end = start + self.comp_b[stage][split] + self.exp_b
        self.b_end[idx] = end
        if stage:
            self._wake(self.b_consumer[stage], ~idx)
        # A split backward keeps the activations until its W.
        return self._done(r, action, start, end, self.exp_b, split - 1)

    def _forward_backward(self, r: int, action: Action, t: float) -> float:
        f_stage = self.stage_of[r][action[2]]
        f_idx = f_stage * self.m + action[1]
        b_stage = self.stage_of[r][action[4]]
        b_idx = b_stage * self.m + action[3]
        start = self._forward_input(r, f_stage, f_idx, t)
        if start >= 0:
            start = self._backward_input(r, b_stage, b_idx, start)
        if start < 0:
            return start
        split = self.split[b_idx]
        compute = self.comp_f[f_stage] + self.comp_b[b_stage][split]
        end = start + (compute if compute > self.fb_comm else self.fb_comm)
        self.f_end[f_idx] = end
        self.b_end[b_idx] = end
        if f_stage != self.last_stage:
            self._wake(self.f_consumer[f_stage], f_idx)
        if b_stage:
            self._wake(self.b_consumer[b_stage], ~b_idx)
        # The forward half allocates before the backward half frees (if it frees at all).
        if self.inflight[r] + 1 > self.peak[r]:
            self.peak[r] = self.inflight[r] + 1
        return self._done(r, action, start, end, max(0.0, self.fb_comm - compute), split)

    def _weight(self, r: int, action: Action, t: float) -> float:
        stage = self.stage_of[r][action[2]]
        idx = stage * self.m + action[1]
        start = self.b_end[idx]
        if start < 0:  # own backward is later in this list: never
            self.waiting[r] = ~idx
            return start
        if start < t:
            start = t
        return self._done(r, action, start, start + self.dur_w[stage], 0.0, -1)

    def run(self) -> None:
        """Advance ranks until every rank is done or parked; raise if some are stuck."""
        # Local, not an attribute: bound methods in an attribute would make a reference cycle.
        handlers = {FORWARD: self._forward, BACKWARD: self._backward,
                    FORWARD_BACKWARD: self._forward_backward, WEIGHT_GRAD: self._weight}
        ready = self.ready
        while ready:
            r = ready.pop()
            rank_list = self.actions[r]
            i, t = self.next_index[r], self.clock[r]
            while i < len(rank_list):
                action = rank_list[i]
                handler = handlers.get(action[0])
                if handler is None:
                    raise ValueError(f"rank {r}: unknown action kind {action[0]!r} in {action!r}.")
                end = handler(r, action, t)
                if end < 0:
                    break
                t = end
                i += 1
            self.next_index[r], self.clock[r] = i, t
        self._raise_if_stuck()

    def _raise_if_stuck(self) -> None:
        cfg = self.cfg
        stuck = [r for r in range(cfg.pp) if self.next_index[r] < len(self.actions[r])]
        if stuck:
            detail = "; ".join(
                f"rank {r} waits at action #{self.next_index[r]} {self.actions[r][self.next_index[r]].describe()}"
                f" (for {_describe_key(cfg, self.waiting[r])})"
                for r in stuck
            )
            raise RuntimeError(
                f"schedule deadlocks ({cfg.schedule}, pp={cfg.pp}, vp={cfg.vp}, num_microbatches="
                f"{cfg.num_microbatches}): ranks {stuck} cannot progress: {detail}"
            )

    def result(self, costs: CostModel) -> SimulationResult:
        pp, clock, busy = self.cfg.pp, self.clock, self.busy
        pipeline_makespan = max(clock) if clock else 0.0
        ar_time, algorithm = costs.allreduce()
        makespan = max(c + ar_time for c in clock) if clock else 0.0
        if pipeline_makespan > 0:
            rank_bubble = [1.0 - b / pipeline_makespan for b in busy]
            bubble = 1.0 - sum(busy) / (pp * pipeline_makespan)
        else:
            rank_bubble = [0.0] * pp
            bubble = 0.0
        return SimulationResult(
            pp=pp,
            events=[event for rank_events in self.events for event in rank_events],
            makespan=makespan,
            pipeline_makespan=pipeline_makespan,
            busy=busy,
            bubble_fraction=bubble,
            rank_bubble=rank_bubble,
            peak_inflight=self.peak,
            exposed_a2a=self.exposed,
            allreduce_algorithm=algorithm,
            allreduce_time=ar_time,
            rank_end=list(clock),
        )


def _describe_key(cfg: ScheduleConfig, key: int) -> str:
    """Human form of the input a parked rank waits for."""
    kind, idx = ("forward output", key) if key >= 0 else ("backward gradient", ~key)
    stage, microbatch = divmod(idx, cfg.num_microbatches)
    rank, chunk = cfg.owner_of(stage)
    return f"{kind} of microbatch {microbatch} at stage {stage} (rank {rank}, chunk {chunk})"


__all__ = ["CostModel", "SimulationResult", "StageCost", "allreduce_time", "simulate", "Event"]
