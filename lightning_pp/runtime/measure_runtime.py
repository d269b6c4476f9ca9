"""What the runtime adds around the layers' compute, measured for ``layout="auto"``
(:mod:`lightning_pp.runtime.measure`): the fixed cost of entering autograd the runtime's ways
(:func:`backward_entries`), and the stage-boundary link between ranks (:func:`measure_link`);
with the clock and the robust mean every measurement here uses (:func:`clock`, :func:`typical`)."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from lightning_pp.runtime.plans.weight_grad import DeferredWeights, engine_backward


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """The time now, after the device finished what was queued (CUDA kernels run asynchronously)."""
    _synchronize(device)
    return time.perf_counter()


def typical(values: Sequence[float]) -> float:
    """The mean of the middle half of ``values`` (the interquartile mean): the time a run usually
    takes with the machine as busy as it is, without the rare run that lost its core for a while."""
    if not values:
        return 0.0
    ordered = sorted(values)
    quarter = len(ordered) // 4
    middle = ordered[quarter:len(ordered) - quarter]
    return sum(middle) / len(middle)


def backward_entries(device: torch.device, repeats: int = 20) -> tuple[float, float, float]:
    """Seconds the runtime's ways into autograd cost on a graph of one tiny node (``x * w``), the
    :func:`typical` of ``repeats`` runs each: ``(whole backward, split B, split W)``. Each
    layer's measured backward pays its entry once, a pipeline action once for all its layers."""
    x = torch.ones(1, device=device, requires_grad=True)
    w = torch.ones(1, device=device, requires_grad=True)
    grad = torch.ones(1, device=device)
    times: dict[str, list[float]] = {"BW": [], "B": [], "W": []}
    for run in range(repeats + 2):
        start = clock(device)
        engine_backward([x * w], [grad])
        whole = clock(device) - start
        weights, y = DeferredWeights([w]), x * w
        start = clock(device)
        weights.input_grads([y], [grad], [x])
        split_b = clock(device) - start
        start = clock(device)
        weights.run()
        split_w = clock(device) - start
        if run >= 2:
            times["BW"].append(whole)
            times["B"].append(split_b)
            times["W"].append(split_w)
    return typical(times["BW"]), typical(times["B"]), typical(times["W"])


def _ping_pong(peer: int, first: bool, num_bytes: float, device: torch.device, reps: int) -> float:
    """Seconds of one message of ``num_bytes`` to ``peer``: half the fastest round trip. The link's
    own cost; a slower round trip waited for a peer the machine had descheduled, which is load,
    not link (and varied from 0.1 to 3 ms per message on a busy 2-core machine)."""
    import torch.distributed as dist

    buf = torch.zeros(max(1, int(num_bytes) // 4), dtype=torch.float32, device=device)
    times = []
    for run in range(reps + 2):
        start = clock(device)
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if run >= 2:
            times.append((clock(device) - start) / 2)
    return min(times)


def measure_link(boundary_bytes: float, device: torch.device, reps: int = 10) -> tuple[float, float]:
    """``(seconds of one stage-boundary message of boundary_bytes, seconds per byte)`` over this
    world's links, measured while every rank works: ranks 2i and 2i + 1 exchange ``reps`` round
    trips of the boundary message and of one a quarter its size at the same time (an odd last rank
    sits out; half the fastest round trip each); the per-byte slope between the two sizes.
    Collective; ``(0, 0)`` without a peer."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= world or boundary_bytes <= 0:
        return 0.0, 0.0
    small = max(4.0, boundary_bytes / 4)
    hop_small = _ping_pong(peer, rank % 2 == 0, small, device, reps)
    hop = _ping_pong(peer, rank % 2 == 0, boundary_bytes, device, reps)
    per_byte = (hop - hop_small) / (boundary_bytes - small) if boundary_bytes > small else 0.0
    return hop, max(0.0, per_byte)


__all__ = ["backward_entries", "clock", "measure_link", "typical"]
