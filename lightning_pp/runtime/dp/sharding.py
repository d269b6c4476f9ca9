"""Sharded data parallelism inside each pipeline stage, with torch's FSDP2 (``fully_shard``).

Between steps every parameter of a sharded layer is a ``DTensor`` sharded along dim 0 over the
stage's data-parallel group (an expert's over the expert-data-parallel group): that is what the
optimizer steps and what checkpoints store, so parameters, gradients and optimizer state cost
``1/dp`` of a replica's. Within a step the pipeline drives the units itself, because its schedule
is not one forward and one backward:

* **gathered once per step**: at the start of a step every unit's all-gather is posted
  (asynchronously, in the order the chunks are first used) and waited for just before its chunk's
  first action, so later chunks' gathers run under earlier chunks' work. The units are built with
  ``reshard_after_forward=False`` and told ``set_reshard_after_backward(False)``, so no microbatch
  gathers again (what torchtitan does under pipelining);
* **reduced once per chunk, as soon as it can be**: FSDP's own reduction is switched off
  (``set_requires_gradient_sync(False)``: the unsharded gradients accumulate over the
  microbatches); when a chunk's last backward (its last ``W`` under the zero-bubble schedules) is
  done, :class:`~lightning_pp.runtime.dp.grads.GradientSync` reduce-scatters its gradients
  asynchronously (with the presence counts that keep ``grad = None`` exact, and the pipeline's own
  global normalisation) and the chunk's units reshard, freeing the gathered parameters and their
  gradients while the other chunks still work. Torch's pipelining reduces a stage's gradients
  once, after its last backward.

The user's own route is the same: layers that ``configure_model`` already wrapped with
``fully_shard`` over the data-parallel dimension of the module's ``device_mesh`` are driven alike.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch.distributed as dist
from torch import nn

from lightning_pp.runtime.cut.stacked import stacked_rows
from lightning_pp.runtime.protocols import ExpertParallelLayer
from lightning_pp.runtime.dtensors import is_dtensor
from lightning_pp.runtime.timeline import SpanKind, Timeline
from lightning_pp.runtime.topology import Topology

log = logging.getLogger("lightning_pp")

DataParallelSharding = Literal["none", "full"]
SHARDING_MODES: tuple = DataParallelSharding.__args__


def check_sharding_mode(mode: str) -> None:
    if mode not in SHARDING_MODES:
        raise ValueError(f"data_parallel_sharding={mode!r} is invalid: choose one of "
                         f"{', '.join(map(repr, SHARDING_MODES))} ('full' shards parameters, gradients and "
                         f"optimizer state over each stage's data-parallel replicas).")


def fsdp_api():
    """``(fully_shard, FSDPModule)``, or ``None`` where torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return fully_shard, FSDPModule


def is_sharded_module(module: nn.Module) -> bool:
    api = fsdp_api()
    return api is not None and isinstance(module, api[1])


@dataclass
class Unit:
    """One FSDP2 unit of a chunk (a layer, or an expert inside one) and the mesh it shards over."""

    module: nn.Module
    chunk: int
    expert: bool
    layer: int = 0  # which of the rank's layers (in chunk and layer order) it is part of
    handle: object = None  # the posted all-gather of this step
    posted: object = None  # the timeline's mark when it was posted
    waited: bool = False


class StageSharding:
    """The FSDP2 units of this rank's chunks and how a step drives them (see the module docstring).

    Every unit's all-gather is posted at the start of the step; each is waited for just before its
    module's first forward of the step (a forward pre-hook, ahead of FSDP's own), so a layer's
    gather runs under the layers before it. A chunk run through its schedule plan (the fused
    schedules), whose layers' own forwards may never be called, waits for all of its units before
    its first action (``wait``); so does the chunk's gradient reduction."""

    def __init__(self, units: list[Unit], num_chunks: int) -> None:
        self.units = units
        self.timeline: Optional[Timeline] = None  # set by the executor: the collectives' spans
        self.by_chunk: list[list[Unit]] = [[u for u in units if u.chunk == c] for c in range(num_chunks)]
        self.gathered = False
        for unit in units:
            unit.module.set_requires_gradient_sync(False, recurse=False)
            unit.module.set_reshard_after_backward(False, recurse=False)
            unit.module.set_reshard_after_forward(False, recurse=False)
            unit.module.register_forward_pre_hook(self._before_forward(unit), prepend=True)

    @property
    def chunks(self) -> list[int]:
        return [c for c, units in enumerate(self.by_chunk) if units]

    def gather(self, order: list[int]) -> None:
        """Queue every unit's all-gather, chunks in ``order`` (their first use in the step), layers in
        order within a chunk, and post the first :attr:`AHEAD` layers' (a layer's experts with it).
        Each layer's first wait posts the gathers :attr:`AHEAD` layers further, always in the queue's
        order, which every replica shares (collectives must be issued in the same order on every
        member of a group; when they are waited for may differ, e.g. an expert given no tokens)."""
        for c in order + [c for c in range(len(self.by_chunk)) if c not in order]:
            for sharded, gathered, _ in self.pairs(c):  # frozen or unfrozen between steps
                if gathered is not None and gathered.requires_grad != sharded.requires_grad:
                    gathered.requires_grad_(sharded.requires_grad)
        if tuple(order) != getattr(self, "_order", None):  # the queue of a step's order, made once
            self._order = tuple(order)
            ranked = {c: i for i, c in enumerate(order + [c for c in range(len(self.by_chunk)) if c not in order])}
            layers = sorted({(ranked[u.chunk], u.layer) for u in self.units})
            self._queue = [[u for u in self.units if (ranked[u.chunk], u.layer) == key] for key in layers]
            self._slot = {id(u): i for i, group in enumerate(self._queue) for u in group}
        self._next = 0
        for unit in self.units:
            unit.waited = False
        self._post_until(self.AHEAD - 1)
        self.gathered = True

    #: Layers whose all-gathers are in flight ahead of the one computing: the next layer's gather
    #: runs under this one's forward, and at most this many layers' gather buffers exist at once.
    AHEAD = 2

    def _post_until(self, slot: int) -> None:
        while self._next <= min(slot, len(self._queue) - 1):
            for unit in self._queue[self._next]:
                unit.posted = self.timeline.mark() if self.timeline is not None else None
                unit.handle = unit.module.unshard(async_op=True)
            self._next += 1

    def _before_forward(self, unit: Unit):
        def hook(module, args):
            self._wait_unit(unit)
        return hook

    def _wait_unit(self, unit: Unit) -> None:
        if unit.waited or not self.gathered:
            return
        slot = self._slot[id(unit)]
        self._post_until(slot + self.AHEAD)
        unit.waited = True
        for other in self._queue[slot]:  # a layer's units together: its experts' modules may never run
            if other is not unit and not other.waited:  # their own forward (stacked experts are indexed)
                self._wait_unit(other)
        if unit.handle is None:
            return
        timeline = self.timeline
        with timeline.span(SpanKind.GATHER_WAIT, -1, unit.chunk) if timeline is not None else nullcontext():
            unit.handle.wait()
        unit.handle = None
        if timeline is not None:
            timeline.add_between(SpanKind.GATHER, -1, unit.chunk, unit.posted, timeline.mark())

    def wait(self, chunk: int) -> None:
        """Every unit of ``chunk`` gathered (before a schedule plan runs it, and before its reduction)."""
        for unit in self.by_chunk[chunk]:
            self._wait_unit(unit)

    def working(self, chunk: int) -> list[tuple[nn.Parameter, nn.Parameter, bool]]:
        """``(sharded, gathered, expert)`` for every parameter of ``chunk``'s units, in a fixed
        order: call while the chunk is gathered (the units have swapped their gathered parameters
        in; both objects persist from step to step)."""
        self.wait(chunk)
        return self.pairs(chunk)

    def pairs(self, chunk: int) -> list[tuple[nn.Parameter, nn.Parameter, bool]]:
        pairs = []
        for unit in self.by_chunk[chunk]:
            state = fsdp_api()[0].state(unit.module)
            for group in state._fsdp_param_groups:
                for fp in group.fsdp_params:  # the gathered one exists from the first gather on
                    pairs.append((fp.sharded_param, getattr(fp, "_unsharded_param", None), unit.expert))
        return pairs

    def release(self, chunk: int) -> None:
        """Reshard ``chunk``'s units (their gathered parameters are freed)."""
        self.wait(chunk)
        for unit in self.by_chunk[chunk]:
            unit.module.reshard()

    def abandon(self) -> None:
        """After a failed step: reshard without waiting (a peer may be gone) or posting anything."""
        for unit in self.units:
            unit.handle = None
            try:
                unit.module.reshard()
            except Exception:  # noqa: BLE001 - the step's own error is the one to report
                pass
        self.gathered = False

    def release_all(self) -> None:
        if self.gathered:
            for c in range(len(self.by_chunk)):
                self.release(c)
        self.gathered = False


def _layer_number(partition, layer: nn.Module) -> int:
    layers = [m for chunk in partition.chunks for m in chunk.layers]
    return next(i for i, m in enumerate(layers) if m is layer)


def _experts_of(layer: nn.Module) -> list[nn.Module]:
    """This rank's experts in ``layer`` (the modules of its expert-parallel layers' ``expert_list()``
    that hold parameters: the others are placeholders for another rank's)."""
    found = []
    for sub in layer.modules():
        if isinstance(sub, ExpertParallelLayer):
            found.extend(e for e in sub.expert_list() if any(True for _ in e.parameters()))
    return found


def _user_units(partition) -> list[tuple[int, nn.Module, nn.Module]]:
    api = fsdp_api()
    if api is None:
        return []
    return [(c, layer, sub) for c, chunk in enumerate(partition.chunks) for layer in chunk.layers
            for sub in layer.modules() if isinstance(sub, api[1])]


def _init_roots(units: list[Unit]) -> None:
    """FSDP2 initialises a unit tree from its root at the root's first forward; a pipeline layer may
    never run its own forward (a schedule plan calls its parts), so the roots are set up here."""
    fully_shard = fsdp_api()[0]
    for unit in units:
        if not any(u.module is not unit.module and any(m is unit.module for m in u.module.modules()) for u in units):
            fully_shard.state(unit.module)._lazy_init()


def adopt_user_sharding(module: nn.Module, partition, topology: Topology, mode: str) -> Optional[StageSharding]:
    """The FSDP2 units the user applied to the layers in ``configure_model`` (checked: inside a
    layer, over this stage's data-parallel group), driven as the pipeline's own; ``None`` if none."""
    check_sharding_mode(mode)
    found = _user_units(partition)
    check_sharded_placement(module, partition)
    if not found:
        return None
    if mode == "full":
        c, layer, sub = found[0]
        raise ValueError(
            f"data_parallel_sharding='full' was given, but {type(sub).__name__} (in pipeline layer "
            f"{type(layer).__name__} of virtual stage {partition.chunks[c].stage}) is already wrapped by "
            f"fully_shard: shard one way, not both. Remove the fully_shard call from configure_model, or leave "
            f"data_parallel_sharding='none' (the default) and keep sharding the layers yourself.")
    dp_ranks = sorted(dist.get_process_group_ranks(topology.dp_group))
    edp_ranks = sorted(dist.get_process_group_ranks(topology.edp_group))
    units = []
    for c, layer, sub in found:
        mesh = _unit_mesh(sub)
        ranks = sorted(dist.get_process_group_ranks(mesh.get_group())) if mesh is not None else []
        expert = any(getattr(p, "_lpp_expert", False) for p in sub.parameters())
        wanted = edp_ranks if expert else dp_ranks
        if mesh is not None and (mesh.ndim != 1 or ranks != wanted):
            raise ValueError(
                f"{type(sub).__name__} in pipeline layer {type(layer).__name__} is sharded by fully_shard over "
                f"ranks {ranks}, but its {'expert-' if expert else ''}data-parallel group on this rank is "
                f"{wanted}: inside a pipeline, shard over the data-parallel dimension only, "
                f"fully_shard(block, mesh=self.device_mesh[{'edp' if expert else 'dp'!r}]).")
        units.append(Unit(sub, c, expert, layer=_layer_number(partition, layer)))
    _nest_stacked(units, topology)
    _init_roots(units)
    return StageSharding(units, len(partition.chunks))


def shard_stage(module: nn.Module, partition, topology: Topology,
                prepare: Optional[Callable[[nn.Module], dict]] = None) -> Optional[StageSharding]:
    """``data_parallel_sharding="full"``: every pipeline layer of this rank becomes an FSDP2 unit over
    the stage's data-parallel group, each local expert one over the expert-data-parallel group
    (experts alone on their rank when ``edp == 1`` stay whole). The partition's index follows the
    new parameters, which keep the runtime's markers. ``prepare(layer)`` runs just before a layer
    is sharded and returns ``{id(old parameter): new}`` (materialising a meta-device layer: only
    one layer is ever whole). ``None`` (and a note) when ``dp == 1``."""
    if topology.dp == 1:
        log.info("lightning_pp: data_parallel_sharding='full' with one data-parallel replica per stage shards "
                 "nothing; the stages keep their parameters whole.")
        return None
    # A parameter two layers of this rank share (a tied embedding and head on one rank, as under the
    # V schedules or pp=1) cannot be in two FSDP2 units: it stays whole, left out of both units, and
    # is reduced over the replicas as an unsharded parameter is.
    shared = set(_shared_between_layers(partition))
    fully_shard = fsdp_api()[0]
    dense_mesh, expert_mesh = topology.dp_mesh, topology.mesh["edp"]
    units: list[Unit] = []
    for c, chunk in enumerate(partition.chunks):
        for layer in chunk.layers:
            if prepare is not None:
                partition.follow(prepare(layer))
            before = {name: (id(p), {k: v for k, v in p.__dict__.items() if k.startswith("_lpp_")})
                      for name, p in layer.named_parameters()}  # no references: each whole layer is freed
            if not before:
                continue
            experts = _experts_of(layer)
            ignored: set = {p for p in layer.parameters() if id(p) in shared}
            for expert in experts:
                if topology.dims.edp > 1:
                    fully_shard(expert, mesh=expert_mesh, reshard_after_forward=False)
                    units.append(Unit(expert, c, True, layer=_layer_number(partition, layer)))
                else:  # each expert lives on one rank of its stage's replicas: nothing to shard
                    ignored.update(expert.parameters())
            if any(p not in ignored for p in _own_parameters(layer, experts)):
                fully_shard(layer, mesh=dense_mesh, reshard_after_forward=False, ignored_params=ignored or None)
                units.append(Unit(layer, c, False, layer=_layer_number(partition, layer)))
            replaced = {}
            for name, new in layer.named_parameters():
                old_id, markers = before[name]
                if id(new) != old_id:
                    new.__dict__.update(markers)
                    replaced[old_id] = new
            partition.follow(replaced)
    _nest_stacked(units, topology)
    _init_roots(units)
    return StageSharding(units, len(partition.chunks)) if units else None


def _nest_stacked(units: list[Unit], topology: Topology) -> None:
    """Experts stacked in one tensor, their rows now sharded again by FSDP2 over edp: record the
    ("ep", "edp") mesh their checkpoint view is sharded over (:mod:`lightning_pp.runtime.cut.stacked`)."""
    for unit in units:
        for p in unit.module.parameters():
            shard = stacked_rows(p)
            if shard is not None and is_dtensor(p):
                shard.nested = topology.ep_edp_mesh


def _shared_between_layers(partition) -> list[int]:
    owner: dict[int, int] = {}
    shared = []
    for chunk in partition.chunks:
        for layer in chunk.layers:
            for p in layer.parameters():
                if owner.setdefault(id(p), id(layer)) != id(layer) and id(p) not in shared:
                    shared.append(id(p))
    return shared


def _own_parameters(layer: nn.Module, experts: list[nn.Module]):
    inside = {id(p) for e in experts for p in e.parameters()}
    return [p for p in layer.parameters() if id(p) not in inside]


def _unit_mesh(module: nn.Module):
    for p in module.parameters(recurse=False):
        if is_dtensor(p):
            return p.device_mesh
    for p in module.parameters():
        if is_dtensor(p):
            return p.device_mesh
    return None


def check_sharded_placement(module: nn.Module, partition) -> None:
    """DTensor parameters must belong to an FSDP2 unit inside a pipeline layer (a ``fully_shard`` of
    the whole model spans every stage's layers, which the cut takes apart)."""
    api = fsdp_api()
    if api is None:
        return
    outside = [name for name, sub in module.named_modules() if isinstance(sub, api[1])
               and not any(sub is m for chunk in partition.chunks for layer in chunk.layers for m in layer.modules())]
    if outside:
        raise ValueError(
            f"fully_shard was applied to {', '.join(repr(n or type(module).__name__) for n in outside[:4])}, which is "
            f"not a pipeline layer or inside one: a pipeline stage holds only some layers, so shard each pipeline "
            f"layer (or modules inside it) over the data-parallel mesh, not the whole model, or pass "
            f"data_parallel_sharding='full' and let the pipeline do it.")
    held = {id(p) for chunk in partition.chunks for p in chunk.parameters()}
    stray = [name for name, p in module.named_parameters() if is_dtensor(p) and id(p) not in held]
    if stray:
        raise ValueError(f"parameter(s) {', '.join(stray[:6])} are DTensors outside every pipeline layer: only the "
                         f"layers' parameters can be sharded.")
