"""What pipeline layers cost, the input of ``layout="auto"`` (:mod:`lightning_pp.schedules.auto_layout`):
:class:`LayerCost` per layer and :class:`LayerCosts`, which is also the cost file the schedule CLI
reads (``--costs``): per-layer costs (what the runtime measures), or per-stage costs with their layer
counts (what ``PipelineMonitor(write_costs=True)`` writes), spread evenly over each stage's layers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, Union

from lightning_pp.schedules.costs import StageCost

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


__all__ = ["COST_FILE_FORMAT", "LayerCost", "LayerCosts"]
