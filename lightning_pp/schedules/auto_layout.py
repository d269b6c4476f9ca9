"""Choosing the layout (pipeline layers per virtual stage) from per-layer costs: ``layout="auto"``.

Pure Python, like the rest of :mod:`lightning_pp.schedules`: the runtime measures each pipeline
layer (:mod:`lightning_pp.runtime.measure`) and hands the numbers here; the CLI
(``python -m lightning_pp.schedules --layout auto --costs FILE``) reads the same numbers from a
cost file and answers the same question.

What a layer costs (:class:`LayerCost`, one microbatch): the compute time of its forward, its
input gradient and its weight gradient, the bytes it holds for the whole step (parameters,
gradients, optimizer state) and the bytes it keeps per microbatch in flight (the activations its
backward needs, from its forward until its last backward action).

How a layout is judged (:func:`evaluate_layout`): each virtual stage's prices are the sums over its
layers (a :class:`~lightning_pp.schedules.costs.StageCost` per stage; the layers' split ``B`` and
``W`` under a schedule that splits its backwards, else their whole backward) plus what the runtime
adds per action (:attr:`LayerCosts.overhead`), every hand-off between two ranks costs one
stage-boundary message (:meth:`LayerCosts.cost_model`), and the schedule's tables are replayed by
the simulator (:func:`~lightning_pp.schedules.simulate`): the predicted step is its makespan.
Each rank's peak memory is the static bytes of its stages plus the largest sum, over the replayed
order of its actions, of the activation bytes of the (microbatch, stage)s it holds in
flight (the schedule's in-flight count per rank, the V placement's two stages on one rank, a split
backward's activations kept until its ``W``).

How one is chosen (:func:`choose_layout`): among the layouts whose peak fits ``memory_budget``
(every one, when no budget is given), the one with the smallest predicted step; ties (within
``1e-9`` relative) go to the layout closest to the even split, so a model of identical layers keeps
the even split. Every layout is tried when there are at most :data:`EXHAUSTIVE_LIMIT`; otherwise a
local search (moving one layer across one stage boundary at a time, best move first, until no move
helps) starts from the even split and from the split that balances each stage's total compute
(and, for a V, each rank's), and keeps the best it finds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Optional, Sequence, Union

from lightning_pp.schedules.actions import BACKWARD, FORWARD, FORWARD_BACKWARD, WEIGHT_GRAD
from lightning_pp.schedules.costs import CostModel, StageCost
from lightning_pp.schedules.layer_costs import LayerCost, LayerCosts
from lightning_pp.schedules.simulator import SimulationResult, simulate
from lightning_pp.schedules.tables import ScheduleConfig

#: Layouts tried one by one when there are at most this many; a local search beyond.
EXHAUSTIVE_LIMIT = 3000
#: No time added per action (costs measured without the runtime's own work around the layers).
NO_OVERHEAD = StageCost(0.0, 0.0, 0.0)
#: Two predicted steps this close (relative) are a tie, decided by closeness to the even split.
TIE = 1e-9


def even_layout(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per virtual stage, as even as possible; earlier stages take the remainder."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


@dataclass
class LayoutEstimate:
    """One layout under the simulator: the predicted ``step`` (makespan), each virtual stage's
    summed prices, each rank's predicted peak bytes."""

    layout: list[int]
    step: float
    stage_costs: tuple[StageCost, ...]
    rank_memory: list[float]
    result: SimulationResult = field(repr=False)

    @property
    def peak_memory(self) -> float:
        return max(self.rank_memory)


@dataclass
class LayoutChoice:
    """What :func:`choose_layout` chose and why: the ``chosen`` layout's estimate, the ``even``
    split's (``None`` if the even split exceeds the budget), how many layouts were simulated and
    whether that was all of them."""

    config: ScheduleConfig
    chosen: LayoutEstimate
    even: LayoutEstimate
    candidates: int
    exhaustive: bool
    memory_budget: Optional[float] = None
    unit: str = "s"
    costs: Optional[LayerCosts] = None  # the per-layer costs it was chosen from (``costs.save(path)``: a cost file)

    @property
    def layout(self) -> list[int]:
        return list(self.chosen.layout)

    @property
    def ratio_vs_even(self) -> float:
        """Predicted step of the chosen layout over the even split's."""
        return self.chosen.step / self.even.step if self.even.step > 0 else 1.0

    def describe(self) -> str:
        """Several lines: the layout, each stage's predicted time and memory, the step against the even split."""
        cfg, unit = self.config, self.unit
        scale, shown = (1e3, "ms") if unit == "s" else (1.0, unit)
        budget = f", memory budget {_bytes(self.memory_budget)} per rank" if self.memory_budget is not None else ""
        fits = "" if self.memory_budget is None or self.even.peak_memory <= self.memory_budget else " (over the budget)"
        lines = [
            f"layout='auto' for {cfg.schedule} pp={cfg.pp} vp={cfg.vp} microbatches={cfg.num_microbatches}: "
            f"layers per virtual stage {self.chosen.layout}, chosen from {self.candidates} simulated layouts "
            f"({'all of them' if self.exhaustive else 'local search'}{budget})",
            f"  predicted step {self.chosen.step * scale:.4g} {shown} against {self.even.step * scale:.4g} {shown} "
            f"for the even split {self.even.layout}{fits} ({self.ratio_vs_even:.3f}x)",
        ]
        first = 0
        for stage, (count, cost) in enumerate(zip(self.chosen.layout, self.chosen.stage_costs)):
            rank, chunk = cfg.owner_of(stage)
            lines.append(
                f"  stage {stage} (rank {rank}, chunk {chunk}): layers {first}..{first + count - 1}, per microbatch "
                f"F {cost.forward * scale:.4g} B {cost.backward * scale:.4g} W {cost.weight_grad * scale:.4g} {shown}")
            first += count
        costs = self.costs
        if costs is not None and (any(costs.overhead) or costs.boundary_bytes):
            o = costs.overhead
            lines.append(f"  added per action: F {o.forward * scale:.4g} B {o.backward * scale:.4g} "
                         f"W {o.weight_grad * scale:.4g} {shown}; one stage-boundary message ({_bytes(costs.boundary_bytes)}) "
                         f"{costs.cost_model().p2p_time() * scale:.4g} {shown}")
        lines.append("  peak memory per rank: " + ", ".join(
            f"rank {r} {_bytes(m)}" for r, m in enumerate(self.chosen.rank_memory)))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        def estimate(e: LayoutEstimate) -> dict:
            return {"layout": list(e.layout), "step": e.step, "rank_memory": list(e.rank_memory),
                    "stage_costs": [s._asdict() for s in e.stage_costs]}

        return {"schedule": self.config.schedule, "pp": self.config.pp, "vp": self.config.vp,
                "microbatches": self.config.num_microbatches, "unit": self.unit, "layout": self.layout,
                "chosen": estimate(self.chosen), "even": estimate(self.even), "ratio_vs_even": self.ratio_vs_even,
                "candidates": self.candidates, "exhaustive": self.exhaustive, "memory_budget": self.memory_budget}


def _bytes(value: Optional[float]) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def stage_costs_of(layers: Sequence[LayerCost], layout: Sequence[int], split: bool = True,
                   overhead: StageCost = NO_OVERHEAD) -> tuple[tuple[StageCost, ...], list, list]:
    """``(StageCost per stage, static bytes per stage, activation bytes per stage)`` of ``layout``.

    A stage's prices are its layers' sums plus ``overhead`` per action. ``split``: the schedule
    splits its backwards into B and W (the layers' ``backward`` and ``weight_grad``); else its
    backward is one pass (the layers' :attr:`~LayerCost.whole_backward`, priced as B with no W).
    A split stage whose input is data (it begins with the first layer, whose ``backward`` is 0)
    has no input gradient to compute: the runtime's ``B`` does nothing there and its ``W`` is the
    whole backward (:mod:`lightning_pp.runtime.plans.weight_grad`)."""
    stages, static, activation = [], [], []
    first = 0
    for count in layout:
        part = layers[first:first + count]
        data_input = first == 0 and part[0].backward == 0
        first += count
        forward = sum(c.forward for c in part) + overhead.forward
        if split and data_input:
            stages.append(StageCost(forward, overhead.backward,
                                    sum(c.whole_backward for c in part) + overhead.weight_grad))
        elif split:
            stages.append(StageCost(forward, sum(c.backward for c in part) + overhead.backward,
                                    sum(c.weight_grad for c in part) + overhead.weight_grad))
        else:
            stages.append(StageCost(forward, sum(c.whole_backward for c in part) + overhead.backward, 0.0))
        static.append(sum(c.static_bytes for c in part))
        activation.append(sum(c.activation_bytes for c in part))
    return tuple(stages), static, activation


def rank_peak_memory(cfg: ScheduleConfig, result: SimulationResult, static: Sequence[float],
                     activation: Sequence[float]) -> list[float]:
    """Each rank's predicted peak bytes: its stages' static bytes plus the peak, over its replayed
    actions, of the activation bytes of the (microbatch, stage)s in flight (from the forward until
    the ``W`` of a split backward, else the ``B``)."""
    out = []
    for rank in range(cfg.pp):
        events = result.rank_events(rank)
        split = {(a.microbatch, a.chunk) for _, a, _, _ in events if a.kind == WEIGHT_GRAD}
        held = peak = 0.0
        for _, action, _, _ in events:
            kind = action.kind
            if kind in (FORWARD, FORWARD_BACKWARD):
                held += activation[cfg.stage_of(rank, action.chunk)]
                peak = max(peak, held)
            if kind == BACKWARD and (action.microbatch, action.chunk) not in split:
                held -= activation[cfg.stage_of(rank, action.chunk)]
            elif kind == FORWARD_BACKWARD and (action.b_microbatch, action.b_chunk) not in split:
                held -= activation[cfg.stage_of(rank, action.b_chunk)]
            elif kind == WEIGHT_GRAD:
                held -= activation[cfg.stage_of(rank, action.chunk)]
        mine = sum(static[cfg.stage_of(rank, chunk)] for chunk in range(cfg.vp))
        out.append(mine + peak)
    return out


def evaluate_layout(cfg: ScheduleConfig, layers: Union[LayerCosts, Sequence[LayerCost]], layout: Sequence[int],
                    base: CostModel = CostModel()) -> LayoutEstimate:
    """The simulator's step and each rank's peak memory for ``layout``: compute from the layers
    (and, given :class:`LayerCosts`, its per-action ``overhead``), communication from ``base``
    (or, where ``base`` prices none, the measured link of the :class:`LayerCosts`:
    :meth:`LayerCosts.cost_model`)."""
    overhead = NO_OVERHEAD
    if isinstance(layers, LayerCosts):
        base, overhead, layers = layers.cost_model(base), layers.overhead, layers.layers
    stages, static, activation = stage_costs_of(layers, layout, cfg.spec.splits_backward, overhead)
    costs = CostModel(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "stages": stages})
    result = simulate(cfg, costs)
    return LayoutEstimate(list(layout), result.makespan, stages, rank_peak_memory(cfg, result, static, activation),
                          result)


def every_layout(num_layers: int, num_stages: int):
    """Every layout of ``num_layers`` layers over ``num_stages`` stages (each at least one), in order."""
    for cuts in combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        yield [bounds[i + 1] - bounds[i] for i in range(num_stages)]


def _count(num_layers: int, num_stages: int) -> int:
    return math.comb(num_layers - 1, num_stages - 1)


def balanced_by_weight(weights: Sequence[float], num_stages: int) -> list[int]:
    """The contiguous split of ``weights`` into ``num_stages`` parts (each at least one) whose
    heaviest part is lightest (dynamic programming; ties to the earlier cut)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def _local_search(seeds: list, estimate, better) -> "LayoutEstimate":
    """From each seed, move one layer across one stage boundary at a time (the best move first)
    until no move is better; the best end point."""
    best = None
    for seed in seeds:
        current = estimate(seed)
        while True:
            step_best = current
            for i in range(len(seed) - 1):
                for delta in (-1, 1):
                    layout = list(current.layout)
                    layout[i] += delta
                    layout[i + 1] -= delta
                    if min(layout[i], layout[i + 1]) >= 1:
                        e = estimate(layout)
                        if better(e, step_best):
                            step_best = e
            if step_best is current:
                break
            current = step_best
        if better(current, best):
            best = current
    return best


def _over_budget(cfg: ScheduleConfig, best: "LayoutEstimate", memory_budget: float, num_layers: int) -> str:
    rank = best.rank_memory.index(best.peak_memory)
    return (f"layout='auto' cannot meet memory_budget={memory_budget!r} bytes ({_bytes(memory_budget)}) per rank: "
            f"the smallest peak any layout of {num_layers} layers over {cfg.num_stages} virtual stages reaches is "
            f"{best.peak_memory:.0f} bytes ({_bytes(best.peak_memory)}, rank {rank}, layout {best.layout}, "
            f"{cfg.schedule} with {cfg.num_microbatches} microbatches). Raise the budget to at least that, or hold "
            f"less: more pipeline stages, activation checkpointing, sharding, or a schedule with fewer microbatches "
            f"in flight.")


def choose_layout(cfg: ScheduleConfig, costs: Union[LayerCosts, Sequence[LayerCost]],
                  memory_budget: Optional[float] = None, base: CostModel = CostModel(),
                  exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> LayoutChoice:
    """The layout of ``cfg``'s virtual stages with the smallest predicted step whose every rank's
    predicted peak fits ``memory_budget`` bytes (module docstring). Raises ``ValueError`` when the
    model has fewer layers than stages, or when no layout fits the budget (naming the smallest peak
    a layout reaches)."""
    layer_costs = costs if isinstance(costs, LayerCosts) else LayerCosts(tuple(costs))
    layers, unit = layer_costs.layers, layer_costs.unit
    num_layers, num_stages = len(layers), cfg.num_stages
    if num_layers < num_stages:
        raise ValueError(f"layout='auto': the model has {num_layers} pipeline layers, too few for {num_stages} virtual "
                         f"stages (pipeline_parallel_size * virtual_pipeline_size): every stage needs at least one "
                         f"layer. Use pipeline_parallel_size * virtual_pipeline_size <= {num_layers}.")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not memory_budget > 0):
        raise ValueError(f"memory_budget={memory_budget!r} is invalid: give the bytes each rank may hold (> 0), or None.")
    even = even_layout(num_layers, num_stages)
    seen: dict[tuple, LayoutEstimate] = {}

    def estimate(layout) -> LayoutEstimate:
        key = tuple(layout)
        if key not in seen:
            seen[key] = evaluate_layout(cfg, layer_costs, layout, base)
        return seen[key]

    def distance(layout) -> int:
        return sum(abs(a - b) for a, b in zip(layout, even))

    def fits(e: LayoutEstimate) -> bool:
        return memory_budget is None or e.peak_memory <= memory_budget

    def better(a: LayoutEstimate, b: Optional[LayoutEstimate]) -> bool:
        """``a`` is preferred to ``b``: it fits where ``b`` does not, else a shorter step, else
        (a tie) closer to the even split, else less memory."""
        if b is None:
            return True
        if fits(a) != fits(b):
            return fits(a)
        if not fits(a):  # neither fits: the smaller peak (what the error reports)
            return a.peak_memory < b.peak_memory
        if abs(a.step - b.step) > TIE * max(abs(a.step), abs(b.step)):
            return a.step < b.step
        return (distance(a.layout), a.peak_memory) < (distance(b.layout), b.peak_memory)

    exhaustive = _count(num_layers, num_stages) <= exhaustive_limit
    if exhaustive:
        best = None
        for layout in every_layout(num_layers, num_stages):
            e = estimate(layout)
            if better(e, best):
                best = e
    else:
        seeds = [even, balanced_by_weight([c.forward + c.backward + c.weight_grad for c in layers], num_stages)]
        if memory_budget is not None:
            seeds.append(balanced_by_weight([c.static_bytes + c.activation_bytes for c in layers], num_stages))
        best = _local_search(seeds, estimate, better)
    if not fits(best):
        raise ValueError(_over_budget(cfg, best, memory_budget, num_layers))
    return LayoutChoice(cfg, best, estimate(even), len(seen), exhaustive, memory_budget, unit, layer_costs)


__all__ = ["EXHAUSTIVE_LIMIT", "LayerCost", "LayerCosts", "LayoutChoice", "LayoutEstimate", "balanced_by_weight",
           "choose_layout", "evaluate_layout", "even_layout", "every_layout", "rank_peak_memory", "stage_costs_of"]
