"""DTensor helpers that the cut (stacked experts), the data-parallel machinery, the checkpoints and
the integrations share: whether a tensor is a DTensor, this rank's part of it, and a whole tensor
laid out like a sharded one."""

from __future__ import annotations

import math

import torch


def is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard, a plain tensor itself)."""
    return t.to_local() if is_dtensor(t) else t


def shard_rows(full_rows: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, rows)`` of ``rank``'s shard of a dim-0 length ``full_rows`` sharded over ``world``
    (``torch.chunk``'s split, which FSDP2 uses: ``ceil(n / world)`` rows each, the last ones short
    or empty)."""
    per = math.ceil(full_rows / world) if full_rows else 0
    start = min(full_rows, per * rank)
    return start, min(per, full_rows - start)


def shard_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (a whole tensor of ``param``'s global shape, the same on every rank) as a DTensor
    laid out like the sharded ``param``: this rank's rows (FSDP2's split) or, for another layout
    (a tensor-parallel column split, a replicated bias), its part under DTensor's own split; no
    communication."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = param.device_mesh
    if tuple(param.placements) != (Shard(0),):
        return distribute_tensor(full.detach().to(device=param.to_local().device), mesh, param.placements,
                                 src_data_rank=None)
    start, rows = shard_rows(full.shape[0], mesh.size(), mesh.get_local_rank())
    piece = full.detach().narrow(0, start, rows).to(device=param.to_local().device, dtype=full.dtype).clone()
    return DTensor.from_local(piece, mesh, param.placements, shape=param.shape, stride=param.stride(),
                              run_check=False)


def laid_out_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local tensor shaped like ``param``'s local part) as ``param`` is laid out: a
    DTensor over its mesh with its placements, or ``value`` itself for a plain parameter."""
    if not is_dtensor(param):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
                              run_check=False)
