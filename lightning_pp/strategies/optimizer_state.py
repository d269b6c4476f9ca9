"""Optimizer state in the format of ``torch.optim.Optimizer.state_dict()`` on one device, for a
model cut into pipeline stages: numbering this rank's parameters as a one-device optimizer would,
producing this rank's part of that state dict, and loading one (from a single file, or from a
sharded checkpoint through :class:`OptimizerShard`).

The format: ``{"state": {index: {"step": ..., "exp_avg": ...}}, "param_groups": [{"lr": ...,
"params": [indices]}]}``, where a parameter's index is the one a one-device optimizer built by the
same ``configure_optimizers`` on the uncut model gives it. Each rank holds the state of its own
parameters; ``param_groups`` are the full model's groups, the same on every rank. In a sharded
checkpoint indices are decimal strings (DCP stores dict keys as strings), in ``state`` and in each
group's ``params`` alike: ``Optimizer.load_state_dict`` pairs them by equality.

How parameters are numbered: as on one device, through the optimizer's param groups in order,
each group listing its parameters in the model's order. So the parameter groups must follow the
model's parameter order, as ``self.parameters()`` or filters of ``self.named_parameters()`` do
(``[p for n, p in self.named_parameters() if p.dim() >= 2]``); under the pipeline
``configure_optimizers`` sees only a rank's parameters, and a group's full list is the union over
ranks in the uncut model's order. A saved state whose groups differ in number or size from this
optimizer's, or whose state tensors do not fit their parameters' shapes, is refused with an error
that names the group or parameter, on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_pp.runtime.build import find_executor
from lightning_pp.runtime.cut.stacked import as_global, global_shape, local_rows, stacked_rows
from lightning_pp.runtime.dtensors import is_dtensor, shard_like
from lightning_pp.runtime.process import OPTIMIZER_INDEX, fact, facts

PARAM_ORDER_RULE = (
    "A checkpoint's optimizer state is matched to parameters by position, as on one device: "
    "configure_optimizers must build the same parameter groups, each listing its parameters in the "
    "model's order (self.parameters(), or filters of self.named_parameters())."
)


def gather_from_every_rank(obj: Any) -> list:
    """``obj`` of every rank, in rank order (collective; a list of one where there is no process
    group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _agree(problems: list[str]) -> list[str]:
    """Every rank's problems, in the same order on every rank (collective)."""
    return list(dict.fromkeys(p for rank_problems in gather_from_every_rank(problems) for p in rank_problems))


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer / _FabricOptimizer


def _canonical_names(module: nn.Module) -> tuple[dict[int, str], list[str]]:
    """(id(param) -> canonical name for this rank's parameters of the uncut model, the canonical
    names of every parameter of the uncut model in ``module.parameters()`` order)."""
    executor = find_executor(module)
    if executor is None:  # not cut: the module is the whole model
        names: dict[int, str] = {}
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
        return names, list(names.values())
    partition = executor.partition
    canonical = partition.parameter_names
    # parameter_names holds the ids of the uncut model's parameters, some since freed, so a
    # parameter made after the cut (e.g. a placeholder on a rank whose layers are all frozen) could
    # reuse one: a parameter is the model's only if one of its names here is its canonical name,
    # or it is a tie shared with another stage (which it reaches under another name).
    local_names: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        local_names.setdefault(id(p), set()).add(name)
    shared = {t.name for t in partition.tied if executor.topology.pp_rank in t.pp_ranks}
    names = {pid: canonical[pid] for pid, here in local_names.items()
             if pid in canonical and (canonical[pid] in here or canonical[pid] in shared)}
    order = list(partition.parameter_order) or list(dict.fromkeys(canonical.values()))
    return names, order


@dataclass
class OptimizerIndex:
    """Where the parameters of this rank's optimizer sit in the one-device optimizer."""

    groups: list[list[str]]  # canonical names of each full (all-rank) group, in one-device order
    local: list[list[Optional[int]]]  # one-device index of each local parameter (None: not the model's)

    @property
    def sizes(self) -> list[int]:
        return [len(group) for group in self.groups]

    def offset(self, group: int) -> int:
        return sum(self.sizes[:group])


def optimizer_index(module: nn.Module, optimizer: Any) -> OptimizerIndex:
    """The one-device numbering of ``optimizer``'s parameters (collective on the first call for an
    optimizer, and again after its param groups change: call it on every rank)."""
    optimizer = _unwrap_optimizer(optimizer)
    signature = tuple(tuple(id(p) for p in group["params"]) for group in optimizer.param_groups)
    cached = fact(optimizer, OPTIMIZER_INDEX)
    if cached is not None and cached[0] == signature:
        return cached[1]
    names, order = _canonical_names(module)
    mine = [[names[id(p)] for p in group["params"] if id(p) in names] for group in optimizer.param_groups]
    everyone = gather_from_every_rank(mine)
    counts = [len(groups) for groups in everyone]
    if len(set(counts)) > 1:
        raise ValueError(
            f"the optimizer has {counts[0]} parameter group(s) on rank 0 but "
            f"{', '.join(f'{c} on rank {r}' for r, c in enumerate(counts) if c != counts[0])}: "
            f"configure_optimizers must build the same groups on every rank (under the pipeline it sees "
            f"only a rank's parameters; keep a group even where it holds none of them)."
        )
    position = {name: i for i, name in enumerate(order)}
    groups, group_of = [], {}
    for g in range(counts[0]):
        members = {name for groups_of_rank in everyone for name in groups_of_rank[g]}
        for name in members:
            if group_of.setdefault(name, g) != g:
                raise ValueError(
                    f"parameter {name} is in optimizer parameter group {group_of[name]} on one rank and in "
                    f"group {g} on another: configure_optimizers must put each parameter in the same group "
                    f"on every rank."
                )
        groups.append(sorted(members, key=lambda name: position.get(name, len(position))))
    index_of = {name: sum(map(len, groups[:g])) + i for g, group in enumerate(groups) for i, name in enumerate(group)}
    local = [[index_of[names[id(p)]] if id(p) in names else None for p in group["params"]]
             for group in optimizer.param_groups]
    index = OptimizerIndex(groups, local)
    facts(optimizer)[OPTIMIZER_INDEX] = (signature, index)  # ids and names: no reference to the optimizer
    return index


def optimizer_state(module: nn.Module, optimizer: Any) -> dict:
    """This rank's part of the one-device ``optimizer.state_dict()`` of the uncut model: the state
    of this rank's parameters and every group in full, indices as strings (collective)."""
    optimizer = _unwrap_optimizer(optimizer)
    index = optimizer_index(module, optimizer)
    packed = optimizer.state_dict()  # indices numbered through this rank's groups
    global_of = [g for group in index.local for g in group]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # A parameter holding its rows of stacked experts: its states go in as views of the global tensor.
    state = {str(global_of[k]): {key: as_global(params[k], value) for key, value in v.items()}
             for k, v in packed["state"].items() if isinstance(k, int) and global_of[k] is not None}
    param_groups = []
    for g, group in enumerate(packed["param_groups"]):
        full = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        full["params"] = [str(index.offset(g) + i) for i in range(index.sizes[g])]
        if "param_names" in group:
            full["param_names"] = list(index.groups[g])
        param_groups.append(full)
    return {"state": state, "param_groups": param_groups}


def _by_index(state: dict) -> dict[int, Any]:
    """A state dict's ``state`` by integer index (a one-device file has ints, a DCP one strings)."""
    return {int(k): v for k, v in state.items() if isinstance(k, int) or (isinstance(k, str) and k.isdigit())}


def _group_problem(index: OptimizerIndex, saved_groups: list, where: str) -> Optional[str]:
    saved_sizes = [len(group.get("params", ())) for group in saved_groups]
    if saved_sizes == index.sizes:
        return None
    if len(saved_sizes) != len(index.sizes):
        detail = f"it has {len(saved_sizes)} parameter group(s), this optimizer {len(index.sizes)}"
    else:
        g = next(g for g, (a, b) in enumerate(zip(saved_sizes, index.sizes)) if a != b)
        detail = f"parameter group {g} holds {saved_sizes[g]} parameters there but {index.sizes[g]} here"
    return (f"the optimizer state in {where} does not fit this optimizer: {detail} (group sizes "
            f"{saved_sizes} there, {index.sizes} here, counted over all pipeline stages). {PARAM_ORDER_RULE}")


def _shape_problem(name: str, index: int, key: str, shape: torch.Size, param: torch.Tensor,
                   where: str) -> Optional[str]:
    try:
        fits = torch.broadcast_shapes(tuple(shape), global_shape(param)) == global_shape(param)
    except RuntimeError:
        fits = False
    if fits:
        return None
    return (f"the optimizer state {key!r} of parameter {name} (index {index}) has shape {tuple(shape)} in {where} "
            f"but the parameter has shape {tuple(global_shape(param))}: the checkpoint belongs to a model with other "
            f"shapes, or its parameter groups list the parameters in another order. {PARAM_ORDER_RULE}")


def _local_params(index: OptimizerIndex, optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, torch.Tensor]]:
    """One-device index -> (canonical name, parameter) for this rank's parameters."""
    out = {}
    for g, (group, globals_) in enumerate(zip(optimizer.param_groups, index.local)):
        offset = index.offset(g)
        for p, i in zip(group["params"], globals_):
            if i is not None:
                out[i] = (index.groups[g][i - offset], p)
    return out


def _assign(index: OptimizerIndex, optimizer: torch.optim.Optimizer, state: dict, param_groups: list) -> None:
    """Load this rank's part of a one-device state dict (``state`` by index, ``param_groups`` in full)
    into ``optimizer``, through ``Optimizer.load_state_dict`` (its casting and hooks)."""
    local_state, local_groups, k = {}, [], 0
    for group, saved, globals_ in zip(optimizer.param_groups, param_groups, index.local):
        packed = {key: value for key, value in saved.items() if key not in ("params", "param_names")}
        packed["params"] = list(range(k, k + len(globals_)))
        for p, i in zip(group["params"], globals_):
            if i is None:
                if p in optimizer.state:  # not the model's (a placeholder): keep what it has
                    local_state[k] = optimizer.state[p]
            elif i in state:
                local_state[k] = {key: sharded_as(p, value) for key, value in state[i].items()}
            k += 1
        local_groups.append(packed)
    optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


def sharded_as(param: torch.Tensor, value: Any) -> Any:
    """A whole state tensor of a sharded parameter (read from a checkpoint saved without sharding,
    or at another data-parallel size) laid out as the parameter is: this rank's shard (or its rows
    of stacked experts)."""
    if stacked_rows(param) is not None:
        return local_rows(param, value)  # (FSDP2 over the rows: their shard)
    if (is_dtensor(param) and param.device_mesh.ndim == 1 and isinstance(value, torch.Tensor) and not is_dtensor(value)
            and value.shape == param.shape):
        return shard_like(param, value)
    return value


def load_optimizer_state(module: nn.Module, optimizer: Any, state_dict: dict, where: str = "the checkpoint") -> None:
    """Load a one-device ``optimizer.state_dict()`` (integer or string indices; a pipeline
    checkpoint's consolidated one, or a plain one-device Trainer's or Fabric's) into this rank's
    optimizer: the state of this rank's parameters, and every group's hyperparameters (collective:
    every rank checks, and all raise the same error if it does not fit)."""
    optimizer = _unwrap_optimizer(optimizer)
    index = optimizer_index(module, optimizer)
    groups = state_dict.get("param_groups")
    if groups is None or "state" not in state_dict:
        raise KeyError(f"the optimizer state in {where} is not an optimizer.state_dict(): it lacks "
                       f"{'param_groups' if groups is None else 'state'}")
    state = _by_index(state_dict["state"])
    problem = _group_problem(index, groups, where)
    problems = [problem] if problem else []
    if not problems:
        for i, (name, p) in _local_params(index, optimizer).items():
            for key, value in state.get(i, {}).items():
                if isinstance(value, torch.Tensor):
                    problems.append(_shape_problem(name, i, key, value.shape, p, where))
    problems = _agree([p for p in problems if p])
    if problems:
        raise ValueError(problems[0] + (f" ({len(problems) - 1} more such problem(s))" if len(problems) > 1 else ""))
    _assign(index, optimizer, state, groups)


def _empty_like_stored(md: Any) -> Optional[torch.Tensor]:
    """Where DCP reads a stored entry: an empty tensor of its size and dtype (objects: None)."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


class OptimizerShard:
    """Put one in :func:`lightning_pp.strategies.checkpoint.load`'s ``shards`` to read an
    optimizer's state from a sharded checkpoint into ``optimizer`` (this rank's parameters only).
    Collective to make: call it on every rank."""

    def __init__(self, module: nn.Module, optimizer: Any) -> None:
        self.optimizer = _unwrap_optimizer(optimizer)
        self.index = optimizer_index(module, self.optimizer)
        self.param_groups: list = []

    def request(self, prefix: str, path: Path, metadata: Any) -> tuple[dict, list[str], list[str]]:
        """(what to read for this rank, missing entries, misfits), from the checkpoint's metadata and
        its param groups (read here, by this rank alone: a few bytes)."""
        paths = metadata.planner_data or {}
        stored = metadata.state_dict_metadata
        entries = [(fqn, p) for fqn, p in paths.items() if p[0] == prefix]
        if any(len(p) == 2 and str(p[1]).startswith(("state.", "param_groups.")) for _, p in entries):
            return {}, [], [
                f"{prefix} in the checkpoint {path} keys its optimizer state by parameter name, as lightning_pp "
                f"saved it before it used the one-device format: only its weights load (e.g. trainer.validate "
                f"with ckpt_path), not its optimizer state."
            ]
        group_keys = [(fqn, p) for fqn, p in entries
                      if len(p) >= 4 and p[1] == "param_groups" and isinstance(p[2], int)]
        if not group_keys:
            return {}, [f"{prefix} is missing from the checkpoint (it holds no optimizer state)"], []
        groups: dict = {}
        for fqn, p in group_keys:
            set_element(groups, p, _empty_like_stored(stored[fqn]))
        dcp.load(groups, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        self.param_groups = groups[prefix]["param_groups"]
        problem = _group_problem(self.index, self.param_groups, f"the checkpoint {path} ({prefix})")
        if problem:
            return {}, [], [problem]
        mine = {str(i): (name, p) for i, (name, p) in _local_params(self.index, self.optimizer).items()}
        request: dict = {}
        problems = []
        for fqn, p in entries:
            if len(p) < 4 or p[1] != "state" or p[2] not in mine:
                continue
            name, param = mine[p[2]]
            md = stored[fqn]
            if isinstance(md, TensorStorageMetadata):
                problems.append(_shape_problem(name, int(p[2]), ".".join(map(str, p[3:])), md.size, param,
                                               f"the checkpoint {path}"))
            set_element(request, p, _empty_like_stored(md))
        return request.get(prefix, {}), [], [p for p in problems if p]

    def apply(self, loaded: dict) -> None:
        state = _by_index(loaded.get("state", {}))
        _assign(self.index, self.optimizer, state, self.param_groups)


__all__ = [
    "PARAM_ORDER_RULE",
    "OptimizerIndex",
    "OptimizerShard",
    "gather_from_every_rank",
    "load_optimizer_state",
    "optimizer_index",
    "optimizer_state",
]
