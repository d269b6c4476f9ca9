"""Where a pipelined step's time went, from the spans every rank's :class:`Timeline` recorded.

No Lightning here: the Trainer callback (``monitor.py``), the exporters (``export.py``) and Fabric
users all call these functions. The records of every rank's step (:class:`RankTimeline`,
:func:`gather_spans`, :func:`clock_offsets`) are in :mod:`lightning_pp.callbacks.records`,
re-exported here.

Definitions (one training step, ``n`` ranks):

* **Compute actions** are the spans of kind ``F``, ``B``, ``FB`` and ``W``. The executor records
  a stage-boundary receive inside the action that needs it, so an action's span contains the time
  it spent blocked on a ``recv_wait``. An action's **busy time** is its span minus the
  ``recv_wait`` time inside it: waiting for a neighbour is pipeline bubble, not work. Waits on
  expert all-to-all (``a2a_wait``) stay in the busy time, as in the simulator, where exposed
  all-to-all is part of an action's duration; they are reported separately.
* **Common window**: all ranks' spans are put on one time axis (see "Aligning ranks" in
  :mod:`lightning_pp.callbacks.records`); the window runs from the earliest start of any compute
  action on any rank to the latest end of one. The optimizer step comes after the window (like
  the simulator's DP all-reduce after its ``pipeline_makespan``) and is reported separately.
* **Measured bubble of a rank** = ``1 - busy(rank) / window``; **overall** =
  ``1 - sum(busy) / (n * window)``. These are the simulator's ``rank_bubble`` and
  ``bubble_fraction`` formulas with ``busy`` and ``pipeline_makespan`` measured.
* **Per-action cost**: the mean busy time of each compute kind over all ranks.
* **Ideal**: :func:`~lightning_pp.schedules.simulate` of the same :class:`ScheduleConfig` with a
  :class:`CostModel` whose ``forward`` / ``backward`` are the measured mean ``F`` / ``B`` busy
  times less their all-to-all waits, whose ``a2a_forward`` / ``a2a_backward`` are those waits
  (in a plain ``F`` / ``B`` nothing hides them), and with free point-to-point: the bubble this
  schedule would have with these costs, balanced stages, no overheads and, for ``FB`` actions,
  perfect overlap. With several data-parallel pipelines every pipeline rank ``p`` is compared
  with the simulator's rank ``p``.
* **Hidden all-to-all** = ``1 - exposed / total``: ``exposed`` is the ``a2a_wait`` time, ``total``
  the time of ``a2a`` spans (each all-to-all from launch until it is known complete). ``None``
  until a runtime records ``a2a`` spans.

On CUDA the compute spans are GPU times (CUDA events) while receive waits are host times, and a
GPU-side wait for an incoming activation shows up inside the action rather than as a
``recv_wait``; the busy times there are an upper bound, and the bubble a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_pp.callbacks.records import (
    ALIGNMENTS,
    RankTimeline,
    as_records,
    as_span,
    clock_offsets,
    gather_spans,
    host_id,
)
from lightning_pp.runtime.timeline import COMPUTE_SPAN_KINDS, Span, SpanKind
from lightning_pp.schedules import (
    Action,
    ActionKind,
    CostModel,
    ScheduleConfig,
    SimulationResult,
    StageCost,
    rank_actions,
    simulate,
    split_backwards,
)

RECV_WAIT = SpanKind.RECV_WAIT
A2A = SpanKind.A2A
A2A_WAIT = SpanKind.A2A_WAIT
OPTIMIZER = SpanKind.OPTIMIZER


@dataclass
class PipelineStats:
    """What :func:`analyze` found for one step. Times are in seconds; lists follow ``ranks``."""

    config: ScheduleConfig
    ranks: list[int]
    pp_ranks: list[int]
    alignment: str
    offsets: list[float]  # seconds added to each rank's span times to reach the common axis
    window: tuple[float, float]  # (start, end) of the compute window on the common axis
    busy: list[float]
    recv_wait: list[float]  # exposed stage-boundary waits inside compute actions, per rank
    rank_bubble: list[float]
    bubble_fraction: float
    costs: dict[str, float]  # compute kind -> mean busy seconds of one action
    counts: dict[str, int]  # compute kind -> number of actions (all ranks)
    optimizer: list[float]  # optimizer-step seconds per rank (0 when not recorded)
    a2a_exposed: float
    a2a_total: float
    a2a_hidden: Optional[float]
    ideal: SimulationResult
    compute_costs: dict[str, float] = field(default_factory=dict)  # kind -> mean busy seconds less all-to-all waits
    a2a_costs: dict[str, float] = field(default_factory=dict)  # kind -> mean all-to-all wait seconds inside one action
    stage_costs: tuple[StageCost, ...] = ()  # StageCost per virtual stage: mean F / B / W compute seconds
    ideal_per_stage: Optional[SimulationResult] = None  # the ideal with each stage's own prices
    extra: list[dict] = field(default_factory=list)  # each record's ``extra``

    @property
    def step_time(self) -> float:
        """Length of the compute window (first action start to last action end, all ranks)."""
        return self.window[1] - self.window[0]

    @property
    def ideal_bubble(self) -> float:
        return self.ideal.bubble_fraction

    @property
    def ideal_bubble_per_stage(self) -> Optional[float]:
        """The simulator's bubble with each virtual stage's own measured prices (``stage_costs``)."""
        return self.ideal_per_stage.bubble_fraction if self.ideal_per_stage is not None else None

    @property
    def ideal_rank_bubble(self) -> list:
        """The simulator's bubble of each rank's pipeline position, following ``ranks``."""
        return [self.ideal.rank_bubble[p] for p in self.pp_ranks]

    def metrics(self, prefix: str = "pipeline/") -> dict:
        """Flat ``name -> float`` for loggers (times in milliseconds)."""
        out = {
            f"{prefix}bubble": self.bubble_fraction,
            f"{prefix}ideal_bubble": self.ideal_bubble,
            f"{prefix}step_ms": self.step_time * 1e3,
            f"{prefix}recv_wait_ms": _mean(self.recv_wait) * 1e3,
            f"{prefix}optimizer_ms": max(self.optimizer, default=0.0) * 1e3,
        }
        if self.ideal_per_stage is not None:
            out[f"{prefix}ideal_bubble_per_stage"] = self.ideal_bubble_per_stage
        for kind, name in (("F", "forward"), ("B", "backward"), ("FB", "forward_backward"), ("W", "weight_grad")):
            if kind in self.costs:
                out[f"{prefix}{name}_ms"] = self.costs[kind] * 1e3
        for rank, bubble, ideal in zip(self.ranks, self.rank_bubble, self.ideal_rank_bubble):
            out[f"{prefix}bubble_rank{rank}"] = bubble
            out[f"{prefix}ideal_bubble_rank{rank}"] = ideal
        if self.a2a_total > 0 or self.a2a_exposed > 0:
            out[f"{prefix}a2a_exposed_ms"] = self.a2a_exposed / max(len(self.ranks), 1) * 1e3
        if self.a2a_hidden is not None:
            out[f"{prefix}a2a_hidden"] = self.a2a_hidden
        return out

    def summary(self) -> str:
        """One line: measured vs ideal bubble, step time and per-action costs."""
        costs = " ".join(f"{kind} {self.costs[kind] * 1e3:.2f}ms" for kind in COMPUTE_SPAN_KINDS if kind in self.costs)
        text = (
            f"{self.config.schedule} pp={self.config.pp} vp={self.config.vp} m={self.config.num_microbatches}: "
            f"bubble {self.bubble_fraction:.1%} (ideal {self.ideal_bubble:.1%}"
            + (f"; {self.ideal_bubble_per_stage:.1%} at each stage's own costs" if self.ideal_per_stage is not None else "")
            + f"), step {self.step_time * 1e3:.1f}ms, {costs}"
        )
        if self.a2a_hidden is not None:
            text += f", a2a hidden {self.a2a_hidden:.0%}"
        return text



def merge_intervals(intervals: list, gap: float = 0.0) -> list:
    """Sorted, non-overlapping union of ``(start, end)`` intervals, as ``[start, end]`` lists;
    intervals less than ``gap`` apart are joined too."""
    out: list = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1] + gap:
            if end > out[-1][1]:
                out[-1][1] = end
        else:
            out.append([start, end])
    return out


def _compute_spans(spans: Sequence[Span]) -> list[Span]:
    return sorted((s for s in spans if s.kind in COMPUTE_SPAN_KINDS), key=lambda s: (s.start, s.end))


def _covered(compute: list[Span], spans: Sequence[Span], kind: str) -> list[float]:
    """For each compute span (in start order), the time inside it covered by spans of ``kind``."""
    intervals = merge_intervals([(s.start, s.end) for s in spans if s.kind == kind and s.end > s.start])
    out = []
    first = 0  # intervals before this index end before the current action starts (actions are ordered)
    for span in compute:
        while first < len(intervals) and intervals[first][1] <= span.start:
            first += 1
        covered = 0.0
        k = first
        while k < len(intervals) and intervals[k][0] < span.end:
            covered += max(0.0, min(span.end, intervals[k][1]) - max(span.start, intervals[k][0]))
            k += 1
        out.append(covered)
    return out


def compute_busy(spans: Sequence[Span]) -> list[tuple[Span, float, float]]:
    """``(span, busy seconds, recv wait seconds)`` of each compute action, in start order. The
    wait is the part of the action covered by ``recv_wait`` spans."""
    compute = _compute_spans(spans)
    waits = _covered(compute, spans, RECV_WAIT)
    return [(span, max(0.0, span.end - span.start) - waited, waited) for span, waited in zip(compute, waits)]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _coordinates(records: list[RankTimeline], config: ScheduleConfig) -> list[tuple[int, int]]:
    """(pp_rank, dp_rank) of each record: its own, else from the order (rank = pp_rank * dp + dp_rank)."""
    n = len(records)
    if n % config.pp:
        raise ValueError(
            f"spans of {n} ranks cannot form pipelines of pp={config.pp}: pass the spans of every rank "
            f"(a multiple of pp), in global rank order."
        )
    dp = n // config.pp
    out = []
    for index, record in enumerate(records):
        derived = divmod(record.rank if record.rank < n else index, dp)
        pp_rank = record.pp_rank if record.pp_rank is not None else derived[0]
        dp_rank = record.dp_rank if record.dp_rank is not None else derived[1]
        if not 0 <= pp_rank < config.pp:
            raise ValueError(f"rank {record.rank} says pp_rank={pp_rank}, outside 0..{config.pp - 1}.")
        out.append((pp_rank, dp_rank))
    return out


def ideal_costs(costs: dict, a2a: Optional[dict] = None, stages: Sequence[StageCost] = ()) -> CostModel:
    """The simulator's cost model for measured mean action costs (seconds): ``costs`` the compute
    time of ``F`` / ``B`` (and ``FB``, ``W``) actions, ``a2a`` the all-to-all wait of plain ``F`` / ``B``
    actions (exposed there: nothing overlaps it), which the simulator adds to those actions and
    overlaps with compute in ``FB`` ones. Point-to-point is free. Without plain ``F`` / ``B``
    actions a combined ``FB`` is split 1:2, the usual ratio. ``stages``: per-stage compute prices
    (``CostModel.stages``), if the ideal is to see the stages' differences."""
    forward, backward = costs.get("F"), costs.get("B")
    if "FB" in costs and (forward is None or backward is None):
        if forward is None and backward is None:
            forward, backward = costs["FB"] / 3, 2 * costs["FB"] / 3
        elif forward is None:
            forward = max(0.0, costs["FB"] - backward)
        else:
            backward = max(0.0, costs["FB"] - forward)
    a2a = a2a or {}
    # A W action (zero-bubble schedules) is priced on its own; a B of those tables is then the
    # input gradient only, as measured.
    return CostModel(forward=float(forward or 0.0), backward=float(backward or 0.0),
                     weight_grad=float(costs.get("W", 0.0)),
                     a2a_forward=float(a2a.get("F", 0.0)), a2a_backward=float(a2a.get("B", 0.0)), stages=tuple(stages))


def _action_costs(records: list[RankTimeline], per_rank: list, coordinates: list, config: ScheduleConfig) -> tuple:
    """``(costs, counts, compute_costs, a2a_costs, stage_costs)`` of the step's compute actions:
    mean busy time and number per kind, mean busy time less all-to-all waits per kind (a full
    backward in a table that splits others is priced as B + W, so it is kept apart), mean
    all-to-all wait per kind, and the compute prices of each virtual stage (``StageCost``)."""
    by_kind: dict = {}
    compute_by_kind: dict = {}
    a2a_by_kind: dict = {}
    by_stage: dict = {}  # (stage, kind) -> compute seconds; kind "B+W" for an unsplit backward of a split table
    unsplit: list = []
    for record, items, (pp_rank, _) in zip(records, per_rank, coordinates):
        a2a_waits = _covered([span for span, _, _ in items], record.spans, A2A_WAIT)
        split = split_backwards(rank_actions(config, pp_rank))
        for (span, b, _), a2a_wait in zip(items, a2a_waits):
            by_kind.setdefault(span.kind, []).append(b)
            a2a_by_kind.setdefault(span.kind, []).append(a2a_wait)
            kind = span.kind
            if split and span.kind == ActionKind.BACKWARD and (span.microbatch, span.chunk) not in split:
                unsplit.append(b - a2a_wait)  # the simulator prices it as B + W
                kind = "B+W"
            else:
                compute_by_kind.setdefault(span.kind, []).append(b - a2a_wait)
            by_stage.setdefault((config.stage_of(pp_rank, span.chunk), kind), []).append(b - a2a_wait)
    if unsplit and ActionKind.BACKWARD not in compute_by_kind:  # no split B measured: full minus W
        weight = _mean(compute_by_kind.get(ActionKind.WEIGHT_GRAD, [0.0]))
        compute_by_kind[ActionKind.BACKWARD] = [max(0.0, u - weight) for u in unsplit]
    compute_costs = {kind: _mean(values) for kind, values in compute_by_kind.items()}
    return ({kind: _mean(values) for kind, values in by_kind.items()},
            {kind: len(values) for kind, values in by_kind.items()},
            compute_costs,
            {kind: _mean(values) for kind, values in a2a_by_kind.items()},
            _stage_costs(by_stage, ideal_costs(compute_costs), config.num_stages))


def _stage_costs(by_stage: dict, uniform: CostModel, num_stages: int) -> tuple[StageCost, ...]:
    """Each virtual stage's mean ``F`` / ``B`` / ``W`` compute time; a kind a stage did not run as a
    plain action (a combined ``FB`` table's steady state) takes the uniform price."""
    def mean(stage: int, kind: str, default: float) -> float:
        values = by_stage.get((stage, kind))
        return _mean(values) if values else default

    out = []
    for stage in range(num_stages):
        weight = mean(stage, ActionKind.WEIGHT_GRAD, uniform.weight_grad)
        backward = mean(stage, ActionKind.BACKWARD, max(0.0, mean(stage, "B+W", uniform.backward + weight) - weight))
        out.append(StageCost(mean(stage, ActionKind.FORWARD, uniform.forward), backward, weight))
    return tuple(out)


def analyze(spans_per_rank: Sequence[Any], config: ScheduleConfig, alignment: str = "auto") -> PipelineStats:
    """Measured bubble per rank and overall, per-action costs, the simulator's ideal for those
    costs, hidden all-to-all and optimizer time of one step (definitions in the module docstring).

    ``spans_per_rank``: what :func:`gather_spans` returns, or anything :func:`as_records` takes, in
    global rank order."""
    records = as_records(spans_per_rank)
    if not records:
        raise ValueError("no spans to analyse: pass the spans of every rank of the step.")
    coordinates = _coordinates(records, config)
    offsets, method = clock_offsets(records, alignment)

    per_rank = [compute_busy(r.spans) for r in records]
    starts = [span.start + off for items, off in zip(per_rank, offsets) for span, _, _ in items]
    ends = [span.end + off for items, off in zip(per_rank, offsets) for span, _, _ in items]
    window = (min(starts), max(ends)) if starts else (0.0, 0.0)
    length = window[1] - window[0]

    busy = [sum(b for _, b, _ in items) for items in per_rank]
    waited = [sum(w for _, _, w in items) for items in per_rank]
    costs, counts, compute_costs, a2a_costs, stage_costs = _action_costs(records, per_rank, coordinates, config)

    if length > 0:
        rank_bubble = [1.0 - b / length for b in busy]
        bubble = 1.0 - sum(busy) / (len(records) * length)
    else:
        rank_bubble, bubble = [0.0] * len(records), 0.0

    a2a_total = sum(s.end - s.start for r in records for s in r.spans if s.kind == A2A)
    a2a_exposed = sum(s.end - s.start for r in records for s in r.spans if s.kind == A2A_WAIT)
    a2a_hidden = max(0.0, 1.0 - a2a_exposed / a2a_total) if a2a_total > 0 else None
    optimizer = [sum(s.end - s.start for s in r.spans if s.kind == OPTIMIZER) for r in records]

    return PipelineStats(
        config=config,
        ranks=[r.rank for r in records],
        pp_ranks=[c[0] for c in coordinates],
        alignment=method,
        offsets=offsets,
        window=window,
        busy=busy,
        recv_wait=waited,
        rank_bubble=rank_bubble,
        bubble_fraction=bubble,
        costs=costs,
        counts=counts,
        optimizer=optimizer,
        a2a_exposed=a2a_exposed,
        a2a_total=a2a_total,
        a2a_hidden=a2a_hidden,
        ideal=simulate(config, ideal_costs(compute_costs, a2a_costs)),
        compute_costs=compute_costs,
        a2a_costs=a2a_costs,
        stage_costs=stage_costs,
        ideal_per_stage=simulate(config, ideal_costs(compute_costs, a2a_costs, stage_costs)),
        extra=[r.extra for r in records],
    )


def match_actions(record: RankTimeline, config: ScheduleConfig, pp_rank: int) -> list[tuple[Span, Optional[Action]]]:
    """Pair the rank's compute spans, in start order, with its schedule's actions (the executor runs
    them in exactly that order). Where the two disagree (an eval step, another schedule), spans
    are paired with ``None``."""
    compute = sorted((s for s in record.spans if s.kind in COMPUTE_SPAN_KINDS), key=lambda s: (s.start, s.end))
    planned = rank_actions(config, pp_rank)
    if len(planned) == len(compute) and all(
        a.kind == s.kind and a.microbatch == s.microbatch and a.chunk == s.chunk for a, s in zip(planned, compute)
    ):
        return list(zip(compute, planned))
    return [(s, None) for s in compute]


def span_action(span: Span, action: Optional[Action]) -> Action:
    """The schedule action a compute span ran (an ``FB`` span alone names only its forward half)."""
    if action is not None:
        return action
    return Action(ActionKind(span.kind), span.microbatch, span.chunk)


__all__ = [
    "A2A",
    "A2A_WAIT",
    "ALIGNMENTS",
    "OPTIMIZER",
    "RECV_WAIT",
    "PipelineStats",
    "RankTimeline",
    "analyze",
    "as_records",
    "as_span",
    "clock_offsets",
    "compute_busy",
    "gather_spans",
    "host_id",
    "ideal_costs",
    "match_actions",
    "merge_intervals",
    "span_action",
]
