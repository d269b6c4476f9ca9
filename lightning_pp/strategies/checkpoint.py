"""Sharded checkpoints with global names, so a checkpoint saved at one layout loads at another,
and single-file checkpoints of one device load both ways: the directory format, saving it
atomically, loading it (re-sharded, with one fit check for every rank) and the layout record.
The optimizer state's one-device format lives in :mod:`lightning_pp.strategies.optimizer_state`
(its names are re-exported here).

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP):

* ``model``: every rank's ``module.state_dict()``. Parameters keep the names they have in the
  unsharded model (a tied weight appears under each of its names, as in the full model's state
  dict), so the union over ranks is the full model and DCP can re-shard it to any pipeline size;
* ``optimizer_<i>``: the optimizer in the format of ``torch.optim.Optimizer.state_dict()`` on one
  device, each rank writing the state of its own parameters (see
  :mod:`~lightning_pp.strategies.optimizer_state` for the numbering and the format's details);
* ``meta.pt`` (rank 0): everything else Lightning or the user saved (loop state, epoch, ...).

This is the layout of Lightning's sharded FSDP checkpoints, so
``python -m lightning.pytorch.utilities.consolidate_checkpoint <dir>`` turns one into a
single-file checkpoint that ``LightningModule.load_from_checkpoint`` loads on one device and that a
plain one-device ``Trainer`` resumes from, optimizer included. The other way, a one-device ``.ckpt``
(or a one-device Fabric file) loads into the pipeline with its optimizer state, re-sharded.

Saving is atomic: shards go to a temporary directory (``.lightning_pp-partial/<name>.tmp-<id>``
beside the checkpoint) that rank 0 swaps into place after every rank has finished, with one
``renameat2(RENAME_EXCHANGE)`` on Linux. A process killed at any moment of a save therefore leaves
either the previous checkpoint or the new one at the path, complete. Where the exchange is
unsupported (not Linux, or e.g. NFS) two renames are used, and a crash between them leaves the
previous checkpoint as ``.lightning_pp-partial/<name>.old-<id>``, which the next load or save of
that path recovers. Leftovers of interrupted saves are removed by the next save of the same path.
The hidden folder's name holds no checkpoint's name, so no lookup by name ever sees what is in
it: not Lightning's ``ckpt_path="last"`` (``last*.ckpt``), nor its SLURM requeue numbering, which
takes the digits of every name containing ``hpc_ckpt_`` (a temporary ``.hpc_ckpt_2.ckpt.tmp-1a2b``
beside the checkpoints would make it resume from a ``hpc_ckpt_21.ckpt`` that does not exist).

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
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_pp.strategies.optimizer_state import (  # re-exported: the strategies use ``ckpt.<name>``
    PARAM_ORDER_RULE,
    OptimizerIndex,
    OptimizerShard,
    gather_from_every_rank,
    load_optimizer_state,
    optimizer_index,
    optimizer_state,
    sharded_as,
)

META_FILE = "meta.pt"
LAYOUT_KEY = "lightning_pp_layout"


def is_sharded_checkpoint(path: Any) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def _agree_on_path(path: Path) -> Path:
    if dist.is_initialized():
        box = [str(path)]
        dist.broadcast_object_list(box, src=0)
        return Path(box[0])
    return path


def layout_of(executor) -> dict:
    """The layout a checkpoint is saved with (recorded in its meta, quoted when it does not fit)."""
    topology, config = executor.topology, executor.schedule
    return {
        "world_size": topology.dims.world_size,
        "pipeline_parallel_size": config.pp,
        "virtual_pipeline_size": config.vp,
        "expert_parallel_size": topology.ep,
        "tensor_parallel_size": topology.tp,
        "data_parallel_size": topology.dp,
        "layers_per_stage": list(executor.partition.layout),
        "schedule": config.schedule,
        "data_parallel_sharding": executor.pipeline.config.data_parallel_sharding,
    }


def describe_layout(layout: Optional[dict]) -> str:
    if not layout:
        return "unknown (the checkpoint has no layout record)"
    layers = layout["layers_per_stage"]
    return (
        f"pp={layout['pipeline_parallel_size']} x vp={layout['virtual_pipeline_size']} "
        f"(layers per virtual stage {layers}, {sum(layers)} layers), ep={layout['expert_parallel_size']}, "
        f"{'tp=%d, ' % layout['tensor_parallel_size'] if layout.get('tensor_parallel_size', 1) != 1 else ''}"
        f"dp={layout['data_parallel_size']}{' (sharded)' if layout.get('data_parallel_sharding') == 'full' else ''}, "
        f"world size {layout['world_size']}"
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


#: The folder beside a checkpoint that holds its saves in progress (see the module docstring).
PARTIAL_DIR = ".lightning_pp-partial"


def _partial(path: Path, kind: str) -> Path:
    """A new temporary (``kind="tmp"``) or previous (``"old"``) directory for a save of ``path``."""
    return path.parent / PARTIAL_DIR / f"{path.name}.{kind}-{uuid.uuid4().hex[:8]}"


def _siblings(path: Path, kind: str) -> list[Path]:
    """The ``kind`` leftovers of earlier saves of ``path`` (also where versions before 2026-12-03 put
    them: ``.<name>.<kind>-*`` beside it)."""
    found = []
    for folder, pattern in ((path.parent / PARTIAL_DIR, f"{path.name}.{kind}-*"), (path.parent, f".{path.name}.{kind}-*")):
        if folder.is_dir():
            found += sorted(folder.glob(pattern))
    return found


def _drop_partial_dir(path: Path) -> None:
    try:
        os.rmdir(path.parent / PARTIAL_DIR)
    except OSError:
        pass  # absent, or holding another path's save


def _recoverable(path: Path) -> Optional[Path]:
    """The previous checkpoint left as ``<name>.old-*`` (in :data:`PARTIAL_DIR`) by a save interrupted
    between its two renames (only where the atomic exchange is unavailable), if ``path`` itself is
    missing."""
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
    _drop_partial_dir(path)


def save(path: Any, shards: dict[str, dict], meta: dict) -> Path:
    """Write ``shards`` (DCP, every rank) and ``meta`` (rank 0) atomically to directory ``path``."""
    path = _agree_on_path(Path(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp_box = [str(_partial(path, "tmp"))]
    if dist.is_initialized():
        dist.broadcast_object_list(tmp_box, src=0)
    tmp = Path(tmp_box[0])
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _tidy(path)
        tmp.mkdir(parents=True)
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
            old = _partial(path, "old")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        _drop_partial_dir(path)
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
                      f"previous checkpoint from {recovered} (the next save to {path} restores it there).", stacklevel=2)
        path = recovered
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a lightning_pp sharded checkpoint (a directory with {META_FILE}): pass the "
            f"checkpoint directory that the pipeline strategy saved."
        )
    meta = torch.load(path / META_FILE, weights_only=False)
    _refuse_other_tensor_parallel_size(path, meta.get(LAYOUT_KEY) if isinstance(meta, dict) else None, layout)
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
    gathered = gather_from_every_rank((problems, optimizer_problems))
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


def _refuse_other_tensor_parallel_size(path: Path, saved: Optional[dict], layout: Optional[dict]) -> None:
    """Resuming at another tensor-parallel size is not supported yet (issue 37): the same error on
    every rank (each reads the same record)."""
    was = (saved or {}).get("tensor_parallel_size", 1)
    now = (layout or {}).get("tensor_parallel_size", 1)
    if was != now:
        raise ValueError(
            f"the checkpoint {path} was saved at tensor_parallel_size={was} and this run has tensor_parallel_size="
            f"{now}: loading a checkpoint at another tensor-parallel size is not supported yet. Resume at "
            f"tensor_parallel_size={was}.")


def load_full_state_dict(module: nn.Module, state_dict: dict, strict: bool = True) -> None:
    """Load a single-file (unsharded) state dict into a cut module: each rank takes its own keys."""
    from lightning_pp.runtime import find_executor

    executor = find_executor(module)
    if executor is not None and executor.topology.tp > 1:
        raise ValueError(
            f"loading a single-file (one-device or consolidated) checkpoint into a model split with "
            f"tensor_parallel_size={executor.topology.tp} is not supported yet; load it at tensor_parallel_size=1, "
            f"or resume from the sharded checkpoint directory saved at this tensor-parallel size.")
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    if strict and missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} parameter(s) this stage holds, e.g. {missing[:3]}")
    # A sharded parameter takes its shard of the whole tensor (every rank read the same file).
    module.load_state_dict({k: sharded_as(own[k], v) for k, v in state_dict.items() if k in own}, strict=False)


__all__ = [
    "LAYOUT_KEY",
    "META_FILE",
    "PARAM_ORDER_RULE",
    "OptimizerIndex",
    "OptimizerShard",
    "describe_layout",
    "find_checkpoint",
    "is_sharded_checkpoint",
    "layout_of",
    "load",
    "load_full_state_dict",
    "load_optimizer_state",
    "optimizer_index",
    "optimizer_state",
    "save",
]


def remove(path: Any) -> None:
    """Delete a checkpoint: a sharded directory or a single file (call on one rank)."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
