"""What pipeline layers cost, the input of ``layout="auto"`` (:mod:`lightning_pp.schedules.auto_layout`):
:class:`LayerCost` per layer and :class:`LayerCosts`, which is also the cost file the schedule CLI
reads (``--costs``): per-layer costs (what the runtime measures), or per-stage costs with their layer
counts (what ``PipelineMonitor(write_costs=True)`` writes), spread evenly over each stage's layers;
with what the runtime adds around the layers (:attr:`LayerCosts.overhead` per action, and the
stage-boundary link: :attr:`~LayerCosts.p2p_latency`, :attr:`~LayerCosts.p2p_bandwidth`,
:attr:`~LayerCosts.boundary_bytes`), which the runtime measures in the same phase."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, Union

from lightning_pp.schedules.costs import CostModel, StageCost

COST_FILE_FORMAT = "lightning_pp.layer_costs"


class LayerCost(NamedTuple):
    """One pipeline layer, one microbatch: ``forward``, ``backward`` (the input gradient) and
    ``weight_grad`` times, ``static_bytes`` held for the whole step (parameters, gradients,
    optimizer state) and ``activation_bytes`` kept per microbatch in flight.

    ``full_backward``: the time of the whole backward in one pass (input and weight gradients
    together, as a schedule that does not split its backward runs it), when measured apart; by
    default ``backward + weight_grad``. It is usually less than that sum: one pass walks the graph
    once."""

    forward: float
    backward: float
    weight_grad: float = 0.0
    static_bytes: float = 0.0
    activation_bytes: float = 0.0
    full_backward: Optional[float] = None

    @property
    def whole_backward(self) -> float:
        """The unsplit backward's time: ``full_backward``, else ``backward + weight_grad``."""
        return self.backward + self.weight_grad if self.full_backward is None else self.full_backward


def _check_layer_costs(layers: Sequence[Any], where: str) -> tuple[LayerCost, ...]:
    out = []
    for index, layer in enumerate(layers):
        cost = LayerCost(*layer) if not isinstance(layer, dict) else LayerCost(**layer)
        for name, value in cost._asdict().items():
            if name == "full_backward" and value is None:
                continue
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
    each stage's layers (:meth:`from_stages`), the layout they were measured at.

    What the runtime adds around the layers' compute (all zero unless measured, as ``layout="auto"``
    does): ``overhead``, a :class:`StageCost` added to every F, B and W action of every virtual
    stage (the runtime's own work per action: entering the autograd engine, posting the
    point-to-point messages, the microbatch's bookkeeping); ``p2p_latency`` (seconds) and
    ``p2p_bandwidth`` (bytes/s) of one stage-boundary message of ``boundary_bytes`` (the
    simulator's :class:`CostModel` fields of the same names, :meth:`cost_model`)."""

    layers: tuple[LayerCost, ...]
    unit: str = "s"
    note: str = ""
    stage_layout: Optional[tuple[int, ...]] = None
    overhead: StageCost = StageCost(0.0, 0.0, 0.0)
    p2p_latency: float = 0.0
    p2p_bandwidth: float = math.inf
    boundary_bytes: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", _check_layer_costs(self.layers, "LayerCosts"))
        if self.stage_layout is not None:
            object.__setattr__(self, "stage_layout", tuple(int(c) for c in self.stage_layout))
        object.__setattr__(self, "overhead", StageCost(*self.overhead))
        # the simulator's own checks, with its messages
        CostModel(stages=(self.overhead,), p2p_latency=self.p2p_latency, p2p_bandwidth=self.p2p_bandwidth,
                  activation_bytes=self.boundary_bytes)

    def cost_model(self, base: CostModel = CostModel()) -> CostModel:
        """``base`` (the simulator's communication prices) with this file's measured link in place
        of a free one: a ``base`` that prices its messages (``p2p_time() > 0``) is kept as it is."""
        if base.p2p_time() > 0:
            return base
        fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
        return CostModel(**{**fields, "p2p_latency": self.p2p_latency, "p2p_bandwidth": self.p2p_bandwidth,
                            "activation_bytes": self.boundary_bytes})

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
                     "layers": [{k: v for k, v in layer._asdict().items() if v is not None} for layer in self.layers]}
        if self.stage_layout is not None:
            out["stage_layout"] = list(self.stage_layout)
        if any(self.overhead):
            out["overhead"] = self.overhead._asdict()
        if self.p2p_latency or self.boundary_bytes:
            # a free link (inf bandwidth) is written as 0 seconds per byte: JSON has no infinity
            out["link"] = {"p2p_latency": self.p2p_latency, "seconds_per_byte": 1.0 / self.p2p_bandwidth,
                           "boundary_bytes": self.boundary_bytes}
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
        try:
            overhead = StageCost(**data.get("overhead", {"forward": 0.0, "backward": 0.0}))
            link = data.get("link", {})
            per_byte = float(link.get("seconds_per_byte", 0.0))
            around = dict(overhead=overhead, p2p_latency=float(link.get("p2p_latency", 0.0)),
                          p2p_bandwidth=1.0 / per_byte if per_byte > 0 else math.inf,
                          boundary_bytes=float(link.get("boundary_bytes", 0.0)))
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{where}: 'overhead' needs 'forward', 'backward' (and 'weight_grad') seconds, 'link' "
                             f"'p2p_latency', 'seconds_per_byte' and 'boundary_bytes' numbers ({err}).") from None
        if "layers" in data:
            return cls(_check_layer_costs(data["layers"], where), unit, note, data.get("stage_layout"), **around)
        try:
            stages = [StageCost(s["forward"], s["backward"], s.get("weight_grad", 0.0)) for s in data["stages"]]
            layout = [int(s["layers"]) for s in data["stages"]]
            static = [float(s.get("static_bytes", 0.0)) for s in data["stages"]]
            activation = [float(s.get("activation_bytes", 0.0)) for s in data["stages"]]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where}: every entry of 'stages' needs 'layers', 'forward' and 'backward' "
                             f"(missing {err}).") from None
        spread = cls.from_stages(stages, layout, static, activation, unit, note)
        return cls(spread.layers, unit, note, spread.stage_layout, **around)

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


__all__ = ["COST_FILE_FORMAT", "LayerCost", "LayerCosts"]
