"""Sharded checkpoints with global names, so a checkpoint saved at one layout loads at another.

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP):

* ``model``: every rank's ``module.state_dict()``. Parameters keep the names they have in the
  unsharded model (a tied weight appears under each of its names, as in the full model's state
  dict), so the union over ranks is the full model and DCP can re-shard it to any pipeline size;
* ``optimizer_<i>``: optimizer state flattened per parameter (``state.<name>.<key>``,
  ``param_groups.<name>.<key>``) under each parameter's canonical (first) name;
* ``meta.pt`` (rank 0): everything else Lightning or the user saved (loop state, epoch, ...).

This is the layout of Lightning's sharded FSDP checkpoints, so
``python -m lightning.pytorch.utilities.consolidate_checkpoint <dir>`` turns one into a
single-file checkpoint that ``LightningModule.load_from_checkpoint`` loads on one device.

Saving is atomic: shards go to a temporary sibling directory that rank 0 renames into place
after every rank has finished, so an interrupted save never leaves a half-written checkpoint at
the target path.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

META_FILE = "meta.pt"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def is_sharded_checkpoint(path: Any) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def _canonical_names(module: nn.Module) -> dict[str, str]:
    """Local parameter name -> canonical name, for parameters whose names differ (tied copies)."""
    executor = getattr(module, "_lpp_executor", None)
    if executor is None:
        return {}
    canonical = executor.partition.parameter_names
    return {name: canonical[id(p)] for name, p in module.named_parameters() if canonical.get(id(p), name) != name}


def _rename(flat: dict, mapping: dict[str, str]) -> dict:
    if not mapping:
        return flat
    out = {}
    for key, value in flat.items():
        prefix, rest = key.split(".", 1)
        name, field = rest.rsplit(".", 1)
        out[f"{prefix}.{mapping.get(name, name)}.{field}"] = value
    return out


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Flattened optimizer state under canonical parameter names."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer / _FabricOptimizer
    flat = get_optimizer_state_dict(module, optimizer, options=_FLAT)
    return _rename(flat, _canonical_names(module))


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, flat: dict) -> None:
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    back = {v: k for k, v in _canonical_names(module).items()}
    set_optimizer_state_dict(module, optimizer, _rename(flat, back), options=_FLAT)


def _agree_on_path(path: Path) -> Path:
    if dist.is_initialized():
        box = [str(path)]
        dist.broadcast_object_list(box, src=0)
        return Path(box[0])
    return path


def save(path: Any, shards: dict[str, dict], meta: dict) -> Path:
    """Write ``shards`` (DCP, every rank) and ``meta`` (rank 0) atomically to directory ``path``."""
    path = _agree_on_path(Path(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp_box = [str(path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"))]
    if dist.is_initialized():
        dist.broadcast_object_list(tmp_box, src=0)
    tmp = Path(tmp_box[0])
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(shards, checkpoint_id=tmp)
    if rank == 0:
        torch.save(meta, tmp / META_FILE)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def load(path: Any, shards: dict[str, dict]) -> dict:
    """Fill ``shards`` (live tensors, in place) from the checkpoint at ``path``; return its meta."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a lightning_pp sharded checkpoint (a directory with {META_FILE}): pass the "
            f"checkpoint directory that the pipeline strategy saved."
        )
    dcp.load(shards, checkpoint_id=path)
    return torch.load(path / META_FILE, weights_only=False)


def load_full_state_dict(module: nn.Module, state_dict: dict, strict: bool = True) -> None:
    """Load a single-file (unsharded) state dict into a cut module: each rank takes its own keys."""
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    if strict and missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} parameter(s) this stage holds, e.g. {missing[:3]}")
    module.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False)

