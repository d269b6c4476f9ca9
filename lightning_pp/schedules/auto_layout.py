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
layers (a :class:`~lightning_pp.schedules.costs.StageCost` per stage) and the schedule's tables are
replayed by the simulator (:func:`~lightning_pp.schedules.simulate`): the predicted step is its
makespan. Each rank's peak memory is the static bytes of its stages plus the largest sum, over the
replayed order of its actions, of the activation bytes of the (microbatch, stage)s it holds in
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

import json
import math
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, Union

from lightning_pp.schedules.actions import BACKWARD, FORWARD, FORWARD_BACKWARD, WEIGHT_GRAD
from lightning_pp.schedules.costs import CostModel, StageCost
from lightning_pp.schedules.simulator import SimulationResult, simulate
from lightning_pp.schedules.tables import ScheduleConfig

#: Layouts tried one by one when there are at most this many; a local search beyond.
EXHAUSTIVE_LIMIT = 3000
#: Two predicted steps this close (relative) are a tie, decided by closeness to the even split.
TIE = 1e-9
COST_FILE_FORMAT = "lightning_pp.layer_costs"


class LayerCost(NamedTuple):
    """One pipeline layer, one microbatch: ``forward``, ``backward`` (the input gradient) and
    ``weight_grad`` times, ``static_bytes`` held for the whole step (parameters, gradients,
    optimizer state) and ``activation_bytes`` kept per microbatch in flight."""

    forward: float
    backward: float
    weight_grad: float = 0.0
    static_bytes: float = 0.0
    activation_bytes: float = 0.0


def even_layout(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per virtual stage, as even as possible; earlier stages take the remainder."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def _check_layer_costs(layers: Sequence[Any], where: str) -> tuple[LayerCost, ...]:
    out = []
    for index, layer in enumerate(layers):
        cost = LayerCost(*layer) if not isinstance(layer, dict) else LayerCost(**layer)
        for name, value in cost._asdict().items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{where}: layer {index} has {name}={value!r}: every cost must be a finite number >= 0.")
        out.append(cost)
    if not out:
        raise ValueError(f"{where}: no layers: give one cost per pipeline layer.")
    return tuple(out)


@dataclass(frozen=True)
class LayerCosts:
    """What every pipeline layer costs (:class:`LayerCost`, in order), the input of
    :func:`choose_layout`, and the content of a cost file (:meth:`save` / :meth:`load`).

    ``unit`` names the time unit (the runtime measures ``"s"``), ``note`` says where the numbers
    came from. ``stage_layout``: when the costs were measured per stage and spread evenly over
    each stage's layers (:meth:`from_stages`), the layout they were measured at."""

    layers: tuple[LayerCost, ...]
    unit: str = "s"
    note: str = ""
    stage_layout: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", _check_layer_costs(self.layers, "LayerCosts"))
        if self.stage_layout is not None:
            object.__setattr__(self, "stage_layout", tuple(int(c) for c in self.stage_layout))

    @classmethod
    def from_stages(cls, stages: Sequence[StageCost], layout: Sequence[int], static_bytes: Sequence[float] = (),
                    activation_bytes: Sequence[float] = (), unit: str = "s", note: str = "") -> "LayerCosts":
        """Per-layer costs from per-stage measurements (what ``PipelineMonitor`` sees): each
        stage's times and bytes spread evenly over its ``layout[s]`` layers. The best a per-stage
        measurement can say: a layout that moves a layer moves its stage's average."""
        if len(stages) != len(layout) or any(int(c) < 1 for c in layout):
            raise ValueError(f"per-stage costs of {len(stages)} stages need a layout of as many counts >= 1; "
                             f"got layout={list(layout)}.")
        static = list(static_bytes) or [0.0] * len(stages)
        activation = list(activation_bytes) or [0.0] * len(stages)
        layers = []
        for stage, count, held, kept in zip(stages, layout, static, activation):
            stage = StageCost(*stage)
            n = int(count)
            layers.extend([LayerCost(stage.forward / n, stage.backward / n, stage.weight_grad / n, held / n, kept / n)] * n)
        return cls(tuple(layers), unit, note, tuple(int(c) for c in layout))

    def to_dict(self) -> dict:
        out: dict = {"format": COST_FILE_FORMAT, "version": 1, "unit": self.unit, "note": self.note,
                     "layers": [layer._asdict() for layer in self.layers]}
        if self.stage_layout is not None:
            out["stage_layout"] = list(self.stage_layout)
        return out

    @classmethod
    def from_dict(cls, data: dict, where: str = "cost file") -> "LayerCosts":
        """Read :meth:`to_dict`'s form; ``"stages"`` (a list of ``{"layers": n, "forward": ...,
        "backward": ..., "weight_grad": ..., "static_bytes": ..., "activation_bytes": ...}``) in
        place of ``"layers"`` gives per-stage measurements (spread by :meth:`from_stages`)."""
        if not isinstance(data, dict) or ("layers" not in data and "stages" not in data):
            raise ValueError(f"{where} is not a lightning_pp cost file: expected a JSON object with 'layers' (one "
                             f"cost per pipeline layer) or 'stages' (per-stage costs with their layer counts).")
        unit, note = str(data.get("unit", "s")), str(data.get("note", ""))
        if "layers" in data:
            return cls(_check_layer_costs(data["layers"], where), unit, note, data.get("stage_layout"))
        try:
            stages = [StageCost(s["forward"], s["backward"], s.get("weight_grad", 0.0)) for s in data["stages"]]
            layout = [int(s["layers"]) for s in data["stages"]]
            static = [float(s.get("static_bytes", 0.0)) for s in data["stages"]]
            activation = [float(s.get("activation_bytes", 0.0)) for s in data["stages"]]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where}: every entry of 'stages' needs 'layers', 'forward' and 'backward' "
                             f"(missing {err}).") from None
        return cls.from_stages(stages, layout, static, activation, unit, note)

    def save(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "LayerCosts":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read the cost file {str(path)!r}: {err}") from None
        return cls.from_dict(data, f"cost file {str(path)!r}")


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


def stage_costs_of(layers: Sequence[LayerCost], layout: Sequence[int]) -> tuple[tuple[StageCost, ...], list, list]:
    """``(StageCost per stage, static bytes per stage, activation bytes per stage)`` of ``layout``."""
    stages, static, activation = [], [], []
    first = 0
    for count in layout:
        part = layers[first:first + count]
        first += count
        stages.append(StageCost(sum(c.forward for c in part), sum(c.backward for c in part),
                                sum(c.weight_grad for c in part)))
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


def evaluate_layout(cfg: ScheduleConfig, layers: Sequence[LayerCost], layout: Sequence[int],
                    base: CostModel = CostModel()) -> LayoutEstimate:
    """The simulator's step and each rank's peak memory for ``layout`` (communication prices from
    ``base``, compute from the layers)."""
    stages, static, activation = stage_costs_of(layers, layout)
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
            seen[key] = evaluate_layout(cfg, layers, layout, base)
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
    best: Optional[LayoutEstimate] = None
    if exhaustive:
        for layout in every_layout(num_layers, num_stages):
            e = estimate(layout)
            if better(e, best):
                best = e
    else:
        weights = [c.forward + c.backward + c.weight_grad for c in layers]
        seeds = [even, balanced_by_weight(weights, num_stages)]
        if memory_budget is not None:
            seeds.append(balanced_by_weight([c.static_bytes + c.activation_bytes for c in layers], num_stages))
        for seed in seeds:
            current = estimate(seed)
            while True:
                step_best = current
                for i in range(num_stages - 1):
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
    assert best is not None
    if not fits(best):
        rank = best.rank_memory.index(best.peak_memory)
        raise ValueError(
            f"layout='auto' cannot meet memory_budget={memory_budget!r} bytes ({_bytes(memory_budget)}) per rank: "
            f"the smallest peak any layout of {num_layers} layers over {num_stages} virtual stages reaches is "
            f"{best.peak_memory:.0f} bytes ({_bytes(best.peak_memory)}, rank {rank}, layout {best.layout}, "
            f"{cfg.schedule} with {cfg.num_microbatches} microbatches). Raise the budget to at least that, or hold "
            f"less: more pipeline stages, activation checkpointing, sharding, or a schedule with fewer microbatches "
            f"in flight.")
    return LayoutChoice(cfg, best, estimate(even), len(seen), exhaustive, memory_budget, unit, layer_costs)


__all__ = ["EXHAUSTIVE_LIMIT", "LayerCost", "LayerCosts", "LayoutChoice", "LayoutEstimate", "balanced_by_weight",
           "choose_layout", "evaluate_layout", "even_layout", "every_layout", "rank_peak_memory", "stage_costs_of"]
