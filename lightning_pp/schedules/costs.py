"""What an action costs: :class:`CostModel` (compute, exposed expert all-to-all, stage-boundary
point-to-point and the data-parallel gradient all-reduce, per (microbatch, chunk) action) and
:func:`allreduce_time`, the all-reduce price it uses. Read by the simulator
(:mod:`lightning_pp.schedules.simulator`).

Costs are unit-free; the defaults (forward 1, backward 2) are the usual "backward is twice the
forward" rule of thumb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


class StageCost(NamedTuple):
    """Compute time of one action of one virtual stage: ``forward`` (F), ``backward`` (B: the input
    gradient when its W is split off, else the whole backward less ``weight_grad``) and
    ``weight_grad`` (W), with the meanings of the :class:`CostModel` fields of the same names."""

    forward: float
    backward: float
    weight_grad: float = 0.0


def _check_cost(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == math.inf:
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number >= 0.")


@dataclass(frozen=True)
class CostModel:
    """Durations of one (microbatch, chunk) action, and the communication around them.

    Compute:

    * ``forward`` / ``backward``: compute time of one F / one B.
    * ``weight_grad``: weight-gradient time. Part of every full backward; a split backward (one
      whose (microbatch, chunk) has a ``W`` on its rank) computes only the input gradient and
      costs ``backward``, and its ``W`` costs ``weight_grad``.
    * ``stages``: optional, one :class:`StageCost` per virtual stage, replacing the three uniform
      prices above for that stage. Real stages differ (the first has no input gradient to compute,
      the last computes the loss, an embedding or head is heavier than a block); with one price per
      kind the simulator cannot see that. Its length must equal the simulated table's number of
      virtual stages (``pp * vp``).

    Expert-parallel all-to-all (MoE dispatch + combine), exposed inside each action:

    * ``a2a_forward`` is added to every F, ``a2a_backward`` to every B.
    * A combined ``FB`` action overlaps the communication of one half with the computation of the
      other, so it lasts ``max(forward + backward (+ weight_grad), a2a_forward + a2a_backward)``.
      This is the *ideal* overlap (a lower bound): it assumes the two streams never wait on each
      other inside the action.

    Pipeline point-to-point, per stage-boundary message (activation forward, gradient backward):

    * ``p2p_latency`` (alpha, seconds) + ``activation_bytes / p2p_bandwidth``. Hand-offs between
      two chunks on the same rank (any table with ``pp == 1``, and the turn of a V on the last
      rank) cost nothing.

    Data-parallel gradient all-reduce, run by each rank after its last action:

    * ``dp_size`` replicas, ``grad_bytes`` per rank, priced by :func:`allreduce_time` with
      ``dp_latency`` / ``dp_bandwidth`` (cheaper of ring and tree).
    """

    forward: float = 1.0
    backward: float = 2.0
    weight_grad: float = 0.0
    a2a_forward: float = 0.0
    a2a_backward: float = 0.0
    p2p_latency: float = 0.0
    p2p_bandwidth: float = math.inf
    activation_bytes: float = 0
    dp_size: int = 1
    grad_bytes: float = 0
    dp_latency: float = 0.0
    dp_bandwidth: float = math.inf
    stages: tuple[StageCost, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(StageCost(*stage) for stage in self.stages))
        for index, stage in enumerate(self.stages):
            for name, value in stage._asdict().items():
                _check_cost(f"stages[{index}].{name}", value)
        for name in (
            "forward",
            "backward",
            "weight_grad",
            "a2a_forward",
            "a2a_backward",
            "p2p_latency",
            "activation_bytes",
            "grad_bytes",
            "dp_latency",
        ):
            _check_cost(name, getattr(self, name))
        for name in ("p2p_bandwidth", "dp_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    f"{name}={value!r} is invalid: it must be > 0 bytes/s (use inf for free transfers)."
                )
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"dp_size={self.dp_size!r} is invalid: it must be a positive integer (>= 1).")

    def stage_costs(self, num_stages: int) -> tuple[StageCost, ...]:
        """The compute prices of each of ``num_stages`` virtual stages: ``stages``, or the uniform
        prices for every stage. Raises ``ValueError`` if ``stages`` has another length."""
        if not self.stages:
            return (StageCost(self.forward, self.backward, self.weight_grad),) * num_stages
        if len(self.stages) != num_stages:
            raise ValueError(
                f"CostModel.stages has {len(self.stages)} entries but the table has {num_stages} virtual stages "
                f"(pp * vp): give one StageCost per virtual stage, in stage order, or none for uniform costs."
            )
        return self.stages

    def p2p_time(self) -> float:
        """Time of one stage-boundary message between two ranks."""
        return self.p2p_latency + self.activation_bytes / self.p2p_bandwidth

    def allreduce(self) -> tuple[float, str]:
        """(seconds, algorithm) of this model's DP gradient all-reduce."""
        return allreduce_time(self.grad_bytes, self.dp_size, self.dp_latency, self.dp_bandwidth)


def allreduce_time(num_bytes: float, num_ranks: int, latency: float, bandwidth: float) -> tuple[float, str]:
    """Time of an all-reduce of ``num_bytes`` over ``num_ranks`` ranks, and the cheaper algorithm.

    * ring: ``2 (n - 1) alpha + 2 (n - 1) / n * bytes / bw`` -- bandwidth-optimal, latency grows
      linearly with ``n``.
    * tree (reduce then broadcast down a binary tree): ``2 ceil(log2 n) (alpha + bytes / bw)`` --
      logarithmic latency, but every level moves the whole buffer.

    Ties go to ring. With one rank there is nothing to reduce: ``(0.0, "none")``.
    """
    if num_ranks <= 1:
        return 0.0, "none"
    transfer = num_bytes / bandwidth
    ring = 2 * (num_ranks - 1) * latency + 2 * (num_ranks - 1) / num_ranks * transfer
    tree = 2 * math.ceil(math.log2(num_ranks)) * (latency + transfer)
    if tree < ring:
        return tree, "tree"
    return ring, "ring"


__all__ = ["CostModel", "StageCost", "allreduce_time"]
