"""Parameters that stack many experts along dim 0 (Hugging Face's fused ``gate_up_proj``
``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``), kept row-sharded over the expert-parallel group
under their own names.

After :func:`shard_rows_of` each such parameter holds only its rank's rows ``[start, start + rows)``
(its experts), as a plain tensor: compute, gradients, the expert-data-parallel reduction, the
gradient norm and the optimizer all see an ordinary parameter, of the local shape. The parameter
object stays the same (its ``.data`` is narrowed), so every index of the cut keeps following it.
Where the global tensor is what counts, in checkpoints, it appears as a ``DTensor`` sharded along
dim 0 over the expert-parallel group, a view of the local rows (no copy):

* ``state_dict()`` gives those views, so ``torch.distributed.checkpoint`` writes each rank's rows at
  their offset in the global tensor, and loads into them (in place) at any expert-parallel size;
  :func:`torch.distributed.tensor.DTensor.full_tensor` consolidates one;
* ``load_state_dict`` takes a whole tensor (a one-device state dict: each rank keeps its rows) or
  such a DTensor;
* the optimizer's state tensors go into checkpoints the same way (:func:`as_global`), and a
  whole one read back is cut to the rows (:func:`local_rows`);
* built on the meta device, the whole tensor is initialised and then cut
  (:func:`lightning_pp.runtime.cut.meta.materialize`), so the weights equal a one-device run's.

A parameter's shard is recorded as ``param._lpp_stacked`` (:class:`StackedRows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_pp.runtime.process import STACKED_HOOKS, fact, facts


@dataclass
class StackedRows:
    """Where a row-sharded stacked parameter's rows lie in the global tensor."""

    start: int  # first global row held here
    rows: int  # rows held here
    total: int  # rows of the global tensor (the number of experts)
    group: Any  # the process group the rows are sharded over (the expert-parallel group)
    device_type: str
    _mesh: Any = field(default=None, repr=False)
    #: Set when FSDP2 shards the rows again over the expert-data-parallel group: the 2-D
    #: ("ep", "edp") mesh of the stage, over which the global tensor is sharded twice along dim 0.
    nested: Any = field(default=None, repr=False)

    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.group, self.device_type)
        return self._mesh


def stacked_rows(t: Any) -> Optional[StackedRows]:
    return getattr(t, "_lpp_stacked", None)


def global_shape(param: torch.Tensor) -> torch.Size:
    """The shape of ``param`` in the unsharded model."""
    shard = stacked_rows(param)
    return torch.Size((shard.total, *param.shape[1:])) if shard is not None else param.shape


def _is_dtensor(t: Any) -> bool:
    from lightning_pp.runtime.dtensors import is_dtensor

    return is_dtensor(t)


def as_global(param: torch.Tensor, value: Any) -> Any:
    """``value`` (a tensor of ``param``'s local shape: the parameter itself or a state of it; with
    FSDP2, its DTensor over the expert-data-parallel group) as a DTensor view over the global
    tensor, for a checkpoint; anything else unchanged."""
    shard = stacked_rows(param)
    if shard is None or not isinstance(value, torch.Tensor) or value.is_meta or value.shape != param.shape:
        return value
    from torch.distributed.tensor import DTensor, Shard

    shape = global_shape(param)
    stride = torch.empty(shape, device="meta").stride()
    if _is_dtensor(value):  # FSDP2's shard of the rows: the rows split over ep, each again over edp
        if shard.nested is None:
            return value
        return DTensor.from_local(value.to_local(), shard.nested, [Shard(0), Shard(0)], shape=shape, stride=stride,
                                  run_check=False)
    return DTensor.from_local(value, shard.mesh(), [Shard(0)], shape=shape, stride=stride, run_check=False)


def local_rows(param: torch.Tensor, value: Any) -> Any:
    """``value`` (a whole tensor of ``param``'s global shape, or a DTensor of it) cut to the rows
    this rank holds; anything else unchanged. A DTensor laid out as :func:`as_global` makes it is
    returned as this rank's part: the plain rows, or (FSDP2) the DTensor of ``param``'s layout."""
    shard = stacked_rows(param)
    if shard is None or not isinstance(value, torch.Tensor):
        return value
    if _is_dtensor(value):
        if value.shape[0] == shard.total and value.device_mesh == shard.mesh():
            return value.to_local()
        if value.shape[0] == shard.total and shard.nested is not None and value.device_mesh == shard.nested \
                and _is_dtensor(param):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(value.to_local(), param.device_mesh, param.placements, shape=param.shape,
                                      stride=param.stride(), run_check=False)
        value = value.full_tensor()
    if value.dim() and value.shape[0] == shard.total and value.shape[1:] == param.shape[1:]:
        value = value.narrow(0, shard.start, shard.rows)
        if _is_dtensor(param):  # FSDP2 shards the rows again: this rank's part of them
            from lightning_pp.runtime.dtensors import shard_like

            value = shard_like(param, value)
    return value


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    for name, p in module._parameters.items():
        key = prefix + name
        if p is not None and stacked_rows(p) is not None and key in state_dict and state_dict[key] is not p:
            state_dict[key] = as_global(p, state_dict[key])


def _load_hook(module, state_dict, prefix, *args):
    for name, p in module._parameters.items():
        key = prefix + name
        if p is not None and stacked_rows(p) is not None and key in state_dict:
            state_dict[key] = local_rows(p, state_dict[key])


def shard_rows_of(module: nn.Module, total: int, rank: int, size: int, group: Any, device_type: str) -> list[str]:
    """Keep rank ``rank``'s ``total / size`` rows of every parameter of ``module`` (its own, not
    its children's) whose dim 0 has ``total`` rows; returns their names. A meta parameter stays on
    the meta device with the local shape."""
    rows = total // size
    start = rank * rows
    names = []
    for name, p in module._parameters.items():
        if p is None or p.dim() == 0 or p.shape[0] != total or stacked_rows(p) is not None:
            continue
        with torch.no_grad():
            p.data = torch.empty((rows, *p.shape[1:]), device="meta", dtype=p.dtype) if p.is_meta \
                else p.data.narrow(0, start, rows).clone()
        p._lpp_stacked = StackedRows(start, rows, total, group, device_type)
        names.append(name)
    if names and not fact(module, STACKED_HOOKS, False):
        module.register_state_dict_post_hook(_state_dict_hook)
        module.register_load_state_dict_pre_hook(_load_hook)
        facts(module)[STACKED_HOOKS] = True
    return names


__all__ = ["StackedRows", "as_global", "global_shape", "local_rows", "shard_rows_of", "stacked_rows"]
