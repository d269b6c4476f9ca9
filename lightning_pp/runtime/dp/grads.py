"""Gradient reduction after (and overlapped with the tail of) the pipeline schedule.

Three reductions, all sums, so their order does not matter:

* data parallel: dense parameters over the dp group, expert parameters (``param._lpp_expert``)
  over the expert-data-parallel group. Coalesced into one flat buffer per (chunk, group) bucket
  and launched asynchronously as soon as the chunk's last backward on this rank is done, so they
  run during the cooldown of the remaining chunks;
* tied parameters (a shared embedding/head on the first and last stage): summed over the pipeline
  ranks that hold a copy, in the same data-parallel slot;
* the loss normalisation: everything is divided by the global sample (or token) count.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_pp.runtime.cut.partition import Partition, tie_groups_for
from lightning_pp.runtime.dp.sharded_grads import ShardedBucket
from lightning_pp.runtime.dtensors import is_dtensor, laid_out_like
from lightning_pp.runtime.dtensors import local as local_of
from lightning_pp.runtime.dp.sharding import StageSharding
from lightning_pp.runtime.topology import Topology
from lightning_pp.runtime.tp.params import local_grad, refuse_other_meshes
from lightning_pp.schedules import WEIGHT_GRAD, Action


def grads_nonfinite(grads, device: torch.device) -> torch.Tensor:
    """1.0 if any of ``grads`` (``None`` for no gradient) holds inf/nan, else 0.0, computed on the device (no
    sync). Uses AMP's fused check (what ``GradScaler`` runs every step): one pass over the
    gradients, exact (no overflow as with a norm), and its "unscale" by exactly 1.0 leaves every
    value unchanged."""
    found = torch.zeros(1, dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        if grad is None:
            continue
        if grad.is_sparse:
            found += (~torch.isfinite(grad.coalesce().values())).any().float()
        else:
            by_dtype.setdefault(grad.dtype, []).append(local_of(grad))  # a DTensor's shard: this rank's values
    if by_dtype:
        one = torch.ones(1, dtype=torch.float32, device=device)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    return found[0].clamp(max=1.0).to(torch.float64)


def is_expert_parameter(param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, "_lpp_expert", False))


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], group, chunks: tuple[int, ...]) -> None:
        self.params = params
        self.group = group
        self.chunks = chunks  # the local chunks whose backwards produce these gradients
        self.launch_after = -1  # action index of the step being run (see GradientSync.begin_step)
        self.flat: Optional[torch.Tensor] = None
        self.work = None


def _flatten_with_presence(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat buffer of the parameters' gradients (zeros where a gradient is None) followed by one
    element per parameter, 1 where it has a gradient: summed over replicas, a count of the replicas
    that produced one, so the reduction itself tells whether the sum is a gradient or no gradient
    at all, as on one device, without another collective."""
    return _flatten_grads([None if p.grad is None else local_of(p.grad) for p in params], [local_of(p) for p in params])


def _flatten_grads(grads: Sequence[Optional[torch.Tensor]], like: Sequence[torch.Tensor]) -> torch.Tensor:
    filled = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, like)]
    presence = torch.tensor([g is not None for g in grads], dtype=filled[0].dtype, device=filled[0].device)
    return _flatten_dense_tensors(filled + [presence])


def _unflatten_with_presence(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Write a reduced buffer of :func:`_flatten_with_presence` back: the summed gradient where any
    replica had one, ``None`` where none had."""
    shapes = [local_of(p) for p in params] + [flat.new_empty(len(params))]
    *reduced, presence = _unflatten_dense_tensors(flat, shapes)
    for p, value, present in zip(params, reduced, presence.tolist()):
        if present > 0:
            if p.grad is None:
                p.grad = laid_out_like(p, value.clone())
            else:
                local_of(p.grad).copy_(value)
        else:
            p.grad = None


def create_tie_groups(partition: Partition, topology: Topology) -> dict[tuple[int, ...], object]:
    """Process groups for tied parameters: one per (set of pipeline ranks, data- and tensor-parallel slot).
    Created on every rank in the same order (``new_group`` is collective)."""
    mine = {}
    for pp_ranks in tie_groups_for(partition.tied):
        for slot in range(topology.dp * topology.tp):
            ranks = [topology.dims.rank_of(p, *divmod(slot, topology.tp)) for p in pp_ranks]
            group = dist.new_group(ranks)
            if topology.rank in ranks:
                mine[pp_ranks] = (group, ranks[0])
    return mine


class _TieGroup(NamedTuple):
    group: object
    src: int  # global rank whose copies the others take at start-up (the lowest pipeline rank)
    params: list  # this rank's copies, in the global order of the ties' names


class ParametersChangedError(RuntimeError):
    """The module's parameters are no longer those the pipeline cut and set up (replaced, wrapped
    or added after setup, e.g. by ``fully_shard`` in ``configure_optimizers``)."""


class GradientSync:
    """Owns the data-parallel and tied-weight reductions of one rank's chunks.

    The parameters are the ones the chunks hold when the pipeline is built. ``module`` (the
    user's module) is watched: :meth:`check_parameters`, at the start of every training step,
    rebuilds the buckets when a parameter was frozen or unfrozen since (a fine-tuning callback) and
    raises :class:`ParametersChangedError` when a parameter was replaced or added, whose gradient
    nothing here would reduce, scale or check."""

    def __init__(self, partition: Partition, topology: Topology, actions: list[Action],
                 module: Optional[torch.nn.Module] = None, sharding: Optional[StageSharding] = None) -> None:
        self.topology = topology
        self.partition = partition
        self.tie_groups = create_tie_groups(partition, topology)
        self.sharding = sharding
        self._actions = actions
        self.module = module
        self._index()

    def adopt_sharding(self, sharding: Optional[StageSharding]) -> None:
        """The chunks' parameters were sharded (``runtime.dp.sharding``): index the new ones."""
        self.sharding = sharding
        self._index()

    def _index(self) -> None:
        partition, topology = self.partition, self.topology
        by_id = {}
        for chunk in partition.chunks:
            for p in chunk.parameters():
                by_id.setdefault(id(p), p)
        self.tensor_parallel = _refuse_distributed_tensors(by_id.values(), partition.parameter_names, self.sharding,
                                                           topology)
        self.params = list(by_id.values())
        # Each parameter once, with the first local chunk holding it: the inf/nan check is per
        # virtual stage, so a non-finite gradient is named by the stage whose parameter holds it.
        seen: set[int] = set()
        self.stage_params: list[tuple[int, list[torch.nn.Parameter]]] = []
        for chunk in partition.chunks:
            own = [p for p in chunk.parameters() if id(p) not in seen]
            seen.update(id(p) for p in own)
            self.stage_params.append((chunk.stage, own))
        # Tied copies are matched by their global name and reduced in one order that every rank
        # derives alike (the ties sorted by name, grouped by the pipeline ranks that share them),
        # never in a rank's own parameter order, which differs between ranks (a tied autoencoder
        # lists encoder i and its decoder twin in opposite orders).
        local_by_name = {partition.parameter_names.get(pid): p for pid, p in by_id.items()}
        self.ties: list[_TieGroup] = []
        for pp_ranks in tie_groups_for(partition.tied):
            if topology.pp_rank not in pp_ranks:
                continue
            group, src = self.tie_groups[pp_ranks]
            params = []
            for tie in partition.tied:  # sorted by name
                if tie.pp_ranks != pp_ranks:
                    continue
                if tie.name not in local_by_name:
                    raise RuntimeError(f"tied parameter {tie.name} is not held by {topology.describe()}, which "
                                       f"the cut assigned it to (pipeline ranks {pp_ranks}).")
                params.append(local_by_name[tie.name])
            self.ties.append(_TieGroup(group, src, params))
        self.buckets: list = self._make_buckets(self._actions)
        self.begin_step(self._actions)
        self._watched = self._signature()

    def _make_buckets(self, actions: list[Action]) -> list[_Bucket]:
        """One bucket per (set of local chunks holding the parameter, expert or dense) of the
        trainable parameters; a parameter shared by several local chunks is reduced after the last
        of them. Buckets are ordered by when ``actions`` finishes their chunks, and always launched
        in that order, so every replica issues the same collectives in the same order whatever
        schedule a step runs (a short batch runs fewer microbatches, see ``begin_step``)."""
        topology = self.topology
        holders: dict[int, set[int]] = {}
        for chunk_id, chunk in enumerate(self.partition.chunks):
            for p in chunk.parameters():
                holders.setdefault(id(p), set()).add(chunk_id)
        grouped: dict[tuple[tuple[int, ...], bool], list] = {}
        for p in self.params:
            if p.requires_grad and (not is_dtensor(p) or id(p) in self.tensor_parallel):
                grouped.setdefault((tuple(sorted(holders[id(p)])), is_expert_parameter(p)), []).append(p)
        finish = _chunk_finish(actions)
        buckets: list = []
        for (chunks, expert), params in grouped.items():
            group = topology.edp_group if expert else topology.dp_group
            size = topology.dims.edp if expert else topology.dp
            if size > 1:
                buckets.append(_Bucket(params, group, chunks))
        if self.sharding is not None:  # every sharded chunk's units, trainable or not: a fixed set
            for chunk in self.sharding.chunks:
                for expert in sorted({unit.expert for unit in self.sharding.by_chunk[chunk]}):
                    group = topology.edp_group if expert else topology.dp_group
                    buckets.append(ShardedBucket(self.sharding, chunk, expert, group, self.partition.chunks[chunk].stage))
        order = {id(b): (max(finish[c] for c in b.chunks), _is_expert_bucket(b), b.chunks) for b in buckets}
        return sorted(buckets, key=lambda b: order[id(b)])

    # -- the parameters the optimizer steps must stay the ones set up ---------------------------
    def _signature(self) -> tuple:
        if self.module is None:
            return ()
        return tuple((id(p), p.requires_grad) for p in self.module.parameters())

    def check_parameters(self) -> None:
        """Called at the start of every training step (cheap: one pass over the parameter list).
        A parameter frozen or unfrozen since the last step: the buckets are rebuilt (every replica
        sees the same change, made by the same callback). A parameter replaced or added since setup:
        :class:`ParametersChangedError` naming it, before any work of the step."""
        signature = self._signature()
        if signature == self._watched:
            return
        before = {pid for pid, _ in self._watched}
        named = dict(self.module.named_parameters())
        new = [name for name, p in named.items() if id(p) not in before]
        gone = before - {id(p) for p in named.values()}
        if new or gone:
            gone_names = [self.partition.parameter_names.get(pid, "?") for pid in gone]
            raise ParametersChangedError(_changed_message(type(self.module).__name__, new, gone_names, named))
        held = {id(p) for p in self.params}
        orphans = [name for name, p in named.items() if p.requires_grad and id(p) not in held
                   and not name.startswith("_lpp_frozen_stage.")]
        if orphans:
            raise ParametersChangedError(
                f"{len(orphans)} parameter(s) of {type(self.module).__name__} were made trainable after the pipeline "
                f"was set up but belong to no pipeline layer: {', '.join(orphans[:6])}"
                f"{', ...' if len(orphans) > 6 else ''}. Only parameters reached from pipeline_layers() train; keep "
                f"these frozen, or move their module into a layer.")
        self.buckets = self._make_buckets(self._actions)
        self._watched = signature

    def begin_step(self, actions: list[Action]) -> None:
        """Set the action after which each bucket is launched for a step that runs ``actions``;
        a bucket is never launched before the buckets ahead of it."""
        finish = _chunk_finish(actions)
        latest = -1
        for bucket in self.buckets:
            latest = max(latest, max(finish[c] for c in bucket.chunks))
            bucket.launch_after = latest

    def broadcast_parameters(self) -> None:
        """Make replicas equal at start-up: data-parallel replicas take dp rank 0's values, tied
        copies take the first stage's."""
        with torch.no_grad():
            for bucket in self.buckets:
                if isinstance(bucket, _Bucket):  # a sharded parameter's shards are its only copy
                    src = dist.get_process_group_ranks(bucket.group)[0]
                    self._broadcast([local_of(p).data for p in bucket.params], src, bucket.group)
            for tie in self.ties:
                self._broadcast([local_of(p).data for p in tie.params], tie.src, tie.group)

    @staticmethod
    def _broadcast(tensors: list[torch.Tensor], src: int, group) -> None:
        flat = _flatten_dense_tensors(tensors)
        dist.broadcast(flat, src=src, group=group)
        for t, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(value)

    def after_action(self, index: int) -> None:
        """Launch every bucket whose chunks have finished their backward at action ``index``."""
        for bucket in self.buckets:
            if bucket.launch_after <= index and bucket.work is None:
                if isinstance(bucket, ShardedBucket):
                    # The chunk's gathered parameters go first (its backward is done), then each
                    # gathered gradient as it is copied into the reduction's buffer: the buffer never
                    # coexists with both.
                    self.sharding.release(bucket.chunk)
                    bucket.launch(grads_nonfinite)
                    continue
                bucket.flat = _flatten_with_presence(bucket.params)
                bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)

    def finish(self, scale: float, wait=None) -> None:
        """Wait for the data-parallel reductions, sum tied copies, and multiply by ``scale``.
        ``wait(work, what)`` waits for one collective (the executor's, with its timeout); the
        default waits without a limit. A parameter keeps ``grad = None`` where no replica and no
        tied copy produced a gradient, as on one device."""
        wait = wait or (lambda work, what: work.wait())
        for bucket in self.buckets:
            if bucket.work is None:  # a chunk with no backward on this rank's schedule
                self.after_action(bucket.launch_after)
            if isinstance(bucket, ShardedBucket):
                bucket.finish(wait)
                continue
            wait(bucket.work, "the data-parallel gradient all-reduce")
            _unflatten_with_presence(bucket.params, bucket.flat)
            bucket.flat, bucket.work = None, None
        if self.sharding is not None:
            self.sharding.release_all()
        for tie in self.ties:
            _reduce_tie(tie, wait)
        if scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    local_grad(p).mul_(scale)

    def nonfinite_flags(self, device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """(virtual stage, 1.0 if a gradient of its parameters on this rank holds inf/nan), before
        the reductions: a sharded chunk's were checked when its reduce-scatter was posted."""
        flags = [(stage, grads_nonfinite((p.grad for p in params), device)) for stage, params in self.stage_params]
        flags += [(b.stage, b.flag) for b in self.buckets if isinstance(b, ShardedBucket) and b.flag is not None]
        return flags

    def abandon(self) -> None:
        for bucket in self.buckets:
            if isinstance(bucket, ShardedBucket):
                bucket.abandon()
            else:
                bucket.flat, bucket.work = None, None


def _is_expert_bucket(bucket) -> bool:
    return bucket.expert if isinstance(bucket, ShardedBucket) else is_expert_parameter(bucket.params[0])


def _reduce_tie(tie: _TieGroup, wait) -> None:
    """Sum a tied parameter's copies' gradients (their local shards where sharded: every copy is
    sharded alike over the same data-parallel slot)."""
    shards = [local_of(p) for p in tie.params]
    flat = _flatten_grads([None if p.grad is None else local_of(p.grad) for p in tie.params], shards)
    wait(dist.all_reduce(flat, group=tie.group, async_op=True), "the tied-parameter gradient all-reduce")
    *reduced, presence = _unflatten_dense_tensors(flat, shards + [flat.new_empty(len(shards))])
    for p, value, present in zip(tie.params, reduced, presence.tolist()):
        if present <= 0:
            p.grad = None
        elif p.grad is not None:
            local_of(p.grad).copy_(value)
        else:
            p.grad = laid_out_like(p, value.clone())


def _changed_message(module: str, new: list[str], gone: list[str], named: dict) -> str:
    kinds = sorted({type(named[name]).__name__ for name in new if name in named})
    what = f"{len(new)} parameter(s) are not the ones it set up ({', '.join(new[:6])}{', ...' if len(new) > 6 else ''}"
    what += f"; now {' / '.join(kinds)})" if kinds else ")"
    if not new:
        what = f"parameter(s) {', '.join(gone[:6])} are gone"
    return (
        f"the parameters of {module} changed after the pipeline was set up: {what}. The pipeline took this "
        f"rank's parameters when it cut the model, to reduce their gradients over the data-parallel replicas, "
        f"divide them by the global sample count and check them for inf/nan; a parameter replaced, wrapped or "
        f"added later (fully_shard or a module swap in configure_optimizers or a callback) would train with "
        f"wrong gradients. Change the modules before the cut: in configure_model (Trainer, which runs before "
        f"the pipeline is set up) or before fabric.setup_module (Fabric), and build the optimizers from the "
        f"module's parameters after it. To shard over the data-parallel replicas, pass data_parallel_sharding='full' or apply "
        f"fully_shard to the pipeline layers in configure_model."
    )


def _refuse_distributed_tensors(params, names: dict[int, str], sharding: Optional[StageSharding],
                                topology: Topology) -> set[int]:
    """The ids of the tensor-parallel parameters. DTensor parameters other than those and the stage's
    FSDP2 units' are sharded by another owner: the pipeline's reductions would mix them with plain
    tensors. Refused by name, at setup."""
    managed = set()
    if sharding is not None:
        for chunk in sharding.chunks:
            managed.update(id(s) for s, _, _ in sharding.pairs(chunk))
    tensor_parallel = refuse_other_meshes(params, names, managed, topology)
    sharded = [names.get(id(p), "?") for p in params if is_dtensor(p) and id(p) not in managed | tensor_parallel]
    if sharded:
        raise ValueError(
            f"{len(sharded)} parameter(s) are DTensors when the pipeline is set up ({', '.join(sharded[:6])}"
            f"{', ...' if len(sharded) > 6 else ''}), e.g. from tensor parallelism applied in configure_model, "
            f"which the pipeline does not drive: their gradients would be reduced wrongly. Remove the "
            f"parallelize_module call. To shard over the data-parallel replicas, pass "
            f"data_parallel_sharding='full', or apply fully_shard to the pipeline layers over "
            f"self.device_mesh['dp'].")
    return tensor_parallel


def _chunk_finish(actions: list[Action]) -> dict[int, int]:
    """Index of the last action whose backward or weight gradient (``W``: zero-bubble schedules,
    where a chunk's gradients are complete only after its last W) touches each chunk (the last
    action for a chunk with neither in ``actions``)."""
    last = defaultdict(lambda: len(actions) - 1)
    for index, action in enumerate(actions):
        part = action.backward_part()
        if part is None and action.kind == WEIGHT_GRAD:
            part = (action.microbatch, action.chunk)
        if part is not None:
            last[part[1]] = index
    return last
