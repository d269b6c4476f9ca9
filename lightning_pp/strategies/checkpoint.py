"""Sharded checkpoints with global names, so a checkpoint saved at one layout loads at another,
and single-file checkpoints of one device load both ways.

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP):

* ``model``: every rank's ``module.state_dict()``. Parameters keep the names they have in the
  unsharded model (a tied weight appears under each of its names, as in the full model's state
  dict), so the union over ranks is the full model and DCP can re-shard it to any pipeline size;
* ``optimizer_<i>``: the optimizer in the format of ``torch.optim.Optimizer.state_dict()`` on one
  device: ``{"state": {index: {"step": ..., "exp_avg": ...}}, "param_groups": [{"lr": ...,
  "params": [indices]}]}``, where a parameter's index is the one a one-device optimizer built by the
  same ``configure_optimizers`` on the uncut model gives it. Each rank writes the state of its own
  parameters; ``param_groups`` are the full model's groups, the same on every rank. DCP stores
  dict keys as strings, so indices are decimal strings (``"0"``, ``"1"``, ...) in ``state`` and in
  each group's ``params`` alike: ``Optimizer.load_state_dict`` pairs them by equality;
* ``meta.pt`` (rank 0): everything else Lightning or the user saved (loop state, epoch, ...).

This is the layout of Lightning's sharded FSDP checkpoints, so
``python -m lightning.pytorch.utilities.consolidate_checkpoint <dir>`` turns one into a
single-file checkpoint that ``LightningModule.load_from_checkpoint`` loads on one device and that a
plain one-device ``Trainer`` resumes from, optimizer included. The other way, a one-device ``.ckpt``
(or a one-device Fabric file) loads into the pipeline with its optimizer state, re-sharded.

How parameters are numbered: as on one device, through the optimizer's param groups in order,
each group listing its parameters in the model's order. So the parameter groups must follow the
model's parameter order, as ``self.parameters()`` or filters of ``self.named_parameters()`` do
(``[p for n, p in self.named_parameters() if p.dim() >= 2]``); under the pipeline
``configure_optimizers`` sees only a rank's parameters, and a group's full list is the union over
ranks in the uncut model's order. A checkpoint whose groups differ in number or size from this
optimizer's, or whose state tensors do not fit their parameters' shapes, is refused with an error
that names the group or parameter.

Saving is atomic: shards go to a temporary sibling directory (``.<name>.tmp-<id>``, which no
checkpoint lookup matches: Lightning's ``ckpt_path="last"`` wants ``last*.ckpt``) that rank 0
swaps into place after every rank has finished, with one ``renameat2(RENAME_EXCHANGE)`` on Linux.
A process killed at any moment of a save therefore leaves either the previous checkpoint or the
new one at the path, complete. Where the exchange is unsupported (not Linux, or e.g. NFS) two
renames are used, and a crash between them leaves the previous checkpoint as ``.<name>.old-<id>``,
which the next load or save of that path recovers. Leftovers of interrupted saves are removed by
the next save of the same path.

``meta.pt`` also records the layout the checkpoint was saved with (``lightning_pp_layout``). A
checkpoint loads at any pipeline, virtual or expert-parallel layout, but only into a model with
the same parameters: when it does not fit, every rank raises one error naming both layouts and
the first parameters that are missing or differ in shape.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

META_FILE = "meta.pt"
LAYOUT_KEY = "lightning_pp_layout"
PARAM_ORDER_RULE = (
    "A checkpoint's optimizer state is matched to parameters by position, as on one device: "
    "configure_optimizers must build the same parameter groups, each listing its parameters in the "
    "model's order (self.parameters(), or filters of self.named_parameters())."
)


def is_sharded_checkpoint(path: Any) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(obj: Any) -> list:
    """``obj`` of every rank (a list of one where there is no process group)."""
    if _world_size() == 1:
        return [obj]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _agree(problems: list[str]) -> list[str]:
    """Every rank's problems, in the same order on every rank (collective)."""
    return list(dict.fromkeys(p for rank_problems in _gather(problems) for p in rank_problems))


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer / _FabricOptimizer


# -- optimizer state in the one-device format -------------------------------------------------------

def _canonical_names(module: nn.Module) -> tuple[dict[int, str], list[str]]:
    """(id(param) -> canonical name for this rank's parameters of the uncut model, the canonical
    names of every parameter of the uncut model in ``module.parameters()`` order)."""
    executor = getattr(module, "_lpp_executor", None)
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
    cached = optimizer.__dict__.get("_lpp_optimizer_index")
    if cached is not None and cached[0] == signature:
        return cached[1]
    names, order = _canonical_names(module)
    mine = [[names[id(p)] for p in group["params"] if id(p) in names] for group in optimizer.param_groups]
    everyone = _gather(mine)
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
    optimizer.__dict__["_lpp_optimizer_index"] = (signature, index)
    return index


def optimizer_state(module: nn.Module, optimizer: Any) -> dict:
    """This rank's part of the one-device ``optimizer.state_dict()`` of the uncut model: the state
    of this rank's parameters and every group in full, indices as strings (collective)."""
    optimizer = _unwrap_optimizer(optimizer)
    index = optimizer_index(module, optimizer)
    packed = optimizer.state_dict()  # indices numbered through this rank's groups
    global_of = [g for group in index.local for g in group]
    state = {str(global_of[k]): v for k, v in packed["state"].items()
             if isinstance(k, int) and global_of[k] is not None}
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
        fits = torch.broadcast_shapes(tuple(shape), param.shape) == param.shape
    except RuntimeError:
        fits = False
    if fits:
        return None
    return (f"the optimizer state {key!r} of parameter {name} (index {index}) has shape {tuple(shape)} in {where} "
            f"but the parameter has shape {tuple(param.shape)}: the checkpoint belongs to a model with other "
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
                local_state[k] = state[i]
            k += 1
        local_groups.append(packed)
    optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


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
    """Put one in :func:`load`'s ``shards`` to read an optimizer's state from a checkpoint into
    ``optimizer`` (this rank's parameters only). Collective to make: call it on every rank."""

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


def _agree_on_path(path: Path) -> Path:
    if dist.is_initialized():
        box = [str(path)]
        dist.broadcast_object_list(box, src=0)
        return Path(box[0])
    return path


def layout_of(executor) -> dict:
    """The layout a checkpoint is saved with (recorded in its meta, quoted when it does not fit)."""
    topology, config = executor.topology, executor.config
    return {
        "world_size": topology.dims.world_size,
        "pipeline_parallel_size": config.pp,
        "virtual_pipeline_size": config.vp,
        "expert_parallel_size": topology.ep,
        "data_parallel_size": topology.dp,
        "layers_per_stage": list(executor.partition.layout),
        "schedule": config.schedule,
    }


def describe_layout(layout: Optional[dict]) -> str:
    if not layout:
        return "unknown (the checkpoint has no layout record)"
    layers = layout["layers_per_stage"]
    return (
        f"pp={layout['pipeline_parallel_size']} x vp={layout['virtual_pipeline_size']} "
        f"(layers per virtual stage {layers}, {sum(layers)} layers), ep={layout['expert_parallel_size']}, "
        f"dp={layout['data_parallel_size']}, world size {layout['world_size']}"
    )


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2``). False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot exchange
        return False
    raise OSError(errno, f"cannot swap {a} and {b} into place: {os.strerror(errno)}")


def _siblings(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.{kind}-*")) if path.parent.is_dir() else []


def _recoverable(path: Path) -> Optional[Path]:
    """The previous checkpoint left as ``.<name>.old-*`` by a save interrupted between its two
    renames (only where the atomic exchange is unavailable), if ``path`` itself is missing."""
    if is_sharded_checkpoint(path):
        return None
    complete = [old for old in _siblings(path, "old") if is_sharded_checkpoint(old)]
    return complete[-1] if complete else None


def find_checkpoint(path: Any) -> Optional[Path]:
    """The sharded checkpoint directory to read for ``path`` (``path`` itself, or the previous
    checkpoint an interrupted save left beside it), or None if there is none."""
    path = Path(path)
    if is_sharded_checkpoint(path):
        return path
    return _recoverable(path)


def _tidy(path: Path) -> None:
    """Rank 0, before a save: restore an interrupted save's previous checkpoint, drop leftovers."""
    old = _recoverable(path)
    if old is not None and not path.exists():
        os.replace(old, path)
    for leftover in _siblings(path, "tmp") + _siblings(path, "old"):
        shutil.rmtree(leftover, ignore_errors=True)


def save(path: Any, shards: dict[str, dict], meta: dict) -> Path:
    """Write ``shards`` (DCP, every rank) and ``meta`` (rank 0) atomically to directory ``path``."""
    path = _agree_on_path(Path(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp_box = [str(path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"))]
    if dist.is_initialized():
        dist.broadcast_object_list(tmp_box, src=0)
    tmp = Path(tmp_box[0])
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _tidy(path)
        tmp.mkdir()
    if dist.is_initialized():
        dist.barrier()
    dcp.save(shards, checkpoint_id=tmp)
    if rank == 0:
        torch.save(meta, tmp / META_FILE)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        if not path.exists():
            os.replace(tmp, path)
        elif _exchange(tmp, path):
            shutil.rmtree(tmp, ignore_errors=True)  # now holds the previous checkpoint
        else:
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return path


def _fit_problems(prefix: str, state: dict, stored: dict) -> list[str]:
    """This rank's tensors of ``state`` that the checkpoint lacks or holds with another shape."""
    problems = []
    for key, value in state.items():
        name = f"{prefix}.{key}"
        if name not in stored:
            problems.append(f"{name} is missing from the checkpoint")
        elif isinstance(value, torch.Tensor) and tuple(getattr(stored[name], "size", value.shape)) != tuple(value.shape):
            problems.append(f"{name} has shape {tuple(stored[name].size)} in the checkpoint but "
                            f"{tuple(value.shape)} here")
    return problems


def load(path: Any, shards: dict[str, Any], layout: Optional[dict] = None) -> dict:
    """Fill ``shards`` from the checkpoint at ``path``; return its meta. A shard is a state dict of
    live tensors (filled in place) or an :class:`OptimizerShard` (its optimizer is loaded).

    ``layout`` (see :func:`layout_of`) is this run's, quoted if the checkpoint does not fit. The
    fit check runs on every rank and its result is shared, so all ranks raise the same error."""
    path = Path(path)
    recovered = _recoverable(path)
    if recovered is not None:
        warnings.warn(f"{path} is missing: a save was interrupted between its two renames; loading the "
                      f"previous checkpoint from {recovered} (the next save to {path} restores it there).")
        path = recovered
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a lightning_pp sharded checkpoint (a directory with {META_FILE}): pass the "
            f"checkpoint directory that the pipeline strategy saved."
        )
    meta = torch.load(path / META_FILE, weights_only=False)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    requests, problems, optimizer_problems = {}, [], []
    for prefix, shard in shards.items():
        if isinstance(shard, OptimizerShard):
            request, missing, misfits = shard.request(prefix, path, metadata)
            requests[prefix] = request
            problems += missing
            optimizer_problems += misfits
        else:
            requests[prefix] = shard
            problems += _fit_problems(prefix, shard, metadata.state_dict_metadata)
    gathered = _gather((problems, optimizer_problems))
    problems = sorted({p for rank_problems, _ in gathered for p in rank_problems})
    optimizer_problems = list(dict.fromkeys(p for _, rank_problems in gathered for p in rank_problems))
    if problems:
        saved = meta.get(LAYOUT_KEY) if isinstance(meta, dict) else None
        raise ValueError(
            f"the checkpoint {path} does not fit this model, so it cannot be re-sharded into it: "
            f"{len(problems)} tensor(s) do not match, e.g. {'; '.join(problems[:3])}. It was saved with "
            f"layout {describe_layout(saved)}; this run has layout {describe_layout(layout)}. A checkpoint "
            f"stores every parameter under its global name, so it loads at any pipeline, virtual or expert "
            f"layout, but only into a model with the same parameters and shapes (the same layers, sizes "
            f"and number of experts)."
        )
    if optimizer_problems:
        more = len(optimizer_problems) - 1
        raise ValueError(optimizer_problems[0] + (f" ({more} more such problem(s))" if more else ""))
    dcp.load(requests, checkpoint_id=path)
    for prefix, shard in shards.items():
        if isinstance(shard, OptimizerShard):
            shard.apply(requests[prefix])
    return meta


def load_full_state_dict(module: nn.Module, state_dict: dict, strict: bool = True) -> None:
    """Load a single-file (unsharded) state dict into a cut module: each rank takes its own keys."""
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    if strict and missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} parameter(s) this stage holds, e.g. {missing[:3]}")
    module.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False)
