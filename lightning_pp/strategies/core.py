"""What the Trainer and the Fabric strategies share: the pipeline's configuration (one
:class:`~lightning_pp.runtime.config.PipelineConfig`, made from the constructor's typed arguments),
building the pipeline, logging from the last stage, gradient clipping, predictions."""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
from typing_extensions import override
from torch import nn

from lightning_pp.runtime.build import build_pipeline, find_executor
from lightning_pp.runtime.cut.partition import check_protocol
from lightning_pp.runtime.step.executor import PipelineExecutor, StepResult
from lightning_pp.runtime.topology import build_topology
from lightning_pp.runtime.config import PipelineConfig, ResolvedPipeline
from lightning_pp.runtime.step.norm import clip_grad_norm_, grad_norm
from lightning_pp.runtime.failure.guard import failure_seen_in_process
from lightning_pp.runtime.step.microbatch import batch_size, map_tensors
from lightning_pp.strategies.data import DataParallelWorld, LitdataSharding, data_parallel_world
from lightning_pp.runtime.process import state

_log = logging.getLogger("lightning_pp")


class LogRecorder:
    """Collects ``self.log`` calls made inside ``pipeline_loss`` on the last stage, so they can be
    replayed on every rank once the step is done (a ``sync_dist`` collective must run everywhere).
    Values are averaged over microbatches, weighted by their sample count; a torchmetrics
    ``Metric`` contributes the value of its latest ``forward``."""

    def __init__(self) -> None:
        self.entries: dict[str, list] = {}
        self.weight = 1.0

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("inside pipeline_loss, pass self.log options by keyword (e.g. prog_bar=True)")
        value = getattr(value, "_forward_cache", value)  # torchmetrics Metric -> its step value
        if value is None:
            return
        value = torch.as_tensor(value).detach().to("cpu", torch.float64)
        if value.numel() != 1:
            raise ValueError(f"self.log({name!r}, ...) inside pipeline_loss needs a scalar, got shape {tuple(value.shape)}")
        entry = self.entries.setdefault(name, [0.0, 0.0, kwargs])
        entry[0] += float(value) * self.weight
        entry[1] += self.weight

    def log_dict(self, dictionary: dict, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    def take(self) -> dict[str, tuple[float, dict]]:
        out = {name: (total / weight, kwargs) for name, (total, weight, kwargs) in self.entries.items() if weight > 0}
        self.entries = {}
        return out


def _destroy_process_groups_at_exit() -> None:
    """At the exit of a job that ended well, destroy the process groups while the interpreter is
    still whole. Lightning does so for NCCL only; a gloo group left to interpreter shutdown can abort
    a finished run (``terminate called without an active exception``, exit code -6), as torch's
    ``destroy_process_group`` documentation warns. After a failure it is left alone: a peer may
    still hold a collective open with this process, and destroying the group would wait for it."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # never made, or the user destroyed it
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return  # ending on an uncaught exception
    if failure_seen_in_process():
        return
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    _destroy_dist_connection()  # Lightning's own (Ctrl+C cannot interrupt it), which it registers for NCCL


def destroy_process_groups_at_exit() -> None:
    """Register :func:`_destroy_process_groups_at_exit` once per process. Registered when the
    strategy makes its groups, before the runtime's watchdog starts, so it runs after the
    watchdog's own exit handler (handlers run in reverse order)."""
    process = state()
    if not process.exit_handler_registered:
        atexit.register(_destroy_process_groups_at_exit)
        process.exit_handler_registered = True


class PipelineEngine:
    """Builds the executor for a module and runs steps; no Lightning state."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.resolved: Optional[ResolvedPipeline] = None
        self.executor: Optional[PipelineExecutor] = None
        self.topology = None
        self.recorder = LogRecorder()
        self.skipped_steps = 0  # training steps dropped by nonfinite="skip"

    def train_step(self, batch: Any, grad_scale: float = 1.0) -> StepResult:
        """One pipelined training step; counts and warns about steps skipped as non-finite."""
        result = self.executor.train_step(batch, grad_scale=grad_scale)
        if result.skipped:
            from lightning.fabric.utilities.rank_zero import rank_zero_warn

            self.skipped_steps += 1
            rank_zero_warn(
                f"lightning_pp skipped a training step (nonfinite='skip'): {result.nonfinite}. Its gradients were "
                f"dropped, so the optimizer step that follows changes nothing; {self.skipped_steps} step(s) "
                f"skipped so far."
            )
        return result

    def resolve(self, world_size: int) -> ResolvedPipeline:
        """The configuration for ``world_size`` ranks, resolved once (the launcher resolves it
        before processes start; setup reuses that when the world is the same)."""
        if self.resolved is None or self.resolved.dims.world_size != world_size:
            self.resolved = self.config.resolve(world_size)
        return self.resolved

    def setup_topology(self, device_type: str) -> None:
        if self.topology is None:
            destroy_process_groups_at_exit()
            resolved = self.resolve(dist.get_world_size())  # every check that needs the world size
            self.topology = build_topology(resolved.dims.pp, resolved.dims.ep, device_type)
            _log.info("lightning_pp: schedule=%s, pipeline_parallel_size=%d, virtual_pipeline_size=%d, "
                      "num_microbatches=%d, expert_parallel_size=%d, data-parallel replicas=%d",
                      resolved.schedule.schedule, resolved.dims.pp, resolved.schedule.vp,
                      resolved.schedule.num_microbatches, resolved.dims.ep, resolved.dims.dp)

    def setup_module(self, module: nn.Module, device: torch.device, example_batch: Any = None) -> PipelineExecutor:
        """Cut ``module`` for this rank (once; a module already cut is reused). ``example_batch``:
        what ``layout="auto"`` measures on (see ``build_pipeline``)."""
        existing = find_executor(module)
        if existing is not None:
            self.executor = existing
            return existing
        check_protocol(module)
        self.setup_topology(device.type)
        executor = build_pipeline(module, self.resolved, device=device, topology=self.topology,
                                  example_batch=example_batch)
        _log.info("lightning_pp: rank %s holds layers %s (layers per virtual stage %s)", self.topology.describe(),
                  [f"{c.first_layer}..{c.first_layer + len(c.layers) - 1}" for c in executor.partition.chunks],
                  executor.partition.layout)
        executor.loss_fn = self._recording_loss(module)
        self.executor = executor
        return executor

    def _recording_loss(self, module: nn.Module):
        recorder = self.recorder

        def loss_fn(output, batch):
            recorder.weight = float(batch_size(batch) or 1)
            module.__dict__["log"] = recorder.log
            module.__dict__["log_dict"] = recorder.log_dict
            try:
                return module.pipeline_loss(output, batch)
            finally:
                module.__dict__.pop("log", None)
                module.__dict__.pop("log_dict", None)

        return loss_fn

    def failure_context(self, global_rank: int) -> Optional[tuple]:
        """``(board, this rank's description, diagnosis)`` for explaining a failure outside the
        step on every rank, or ``None`` when there is no process group (yet) to share it through."""
        from lightning_pp.runtime.failure.board import FailureBoard

        executor = self.executor
        board = executor.board if executor is not None else FailureBoard()
        if board.store is None:
            return None
        topology = executor.topology if executor is not None else self.topology
        me = topology.describe() if topology is not None else f"rank {global_rank}"
        return board, me, executor.diagnosis if executor is not None else None

    def last_stage_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's data-parallel slot."""
        return self.topology.global_rank(self.executor.schedule.last_stage_rank)

    def gather_logs(self) -> dict[str, tuple[float, dict]]:
        """The last stage's recorded logs, on every rank of the pipeline."""
        logs = self.recorder.take()
        if self.topology.pp > 1:
            box = [logs]
            dist.broadcast_object_list(box, src=self.last_stage_rank(), group=self.topology.pp_group)
            logs = box[0]
        return logs

    def gather_outputs(self, outputs: list) -> Any:
        """Per-microbatch outputs of the last stage (``pipeline_predict``'s results where the module
        has it), joined along the batch, on every rank of the pipeline: tensors concatenated,
        lists chained, dicts and tuples joined field by field; anything else stays a list with one
        entry per microbatch."""
        if self.topology.pp > 1:
            box = [map_tensors(torch.Tensor.cpu, outputs)]
            dist.broadcast_object_list(box, src=self.last_stage_rank(), group=self.topology.pp_group)
            outputs = box[0]
        return join_microbatches(outputs)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        ex = self.executor
        return clip_grad_norm_(ex.grad_sync, ex.topology, ex.partition, max_norm, norm_type, error_if_nonfinite)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        ex = self.executor
        return grad_norm(ex.grad_sync, ex.topology, ex.partition, norm_type)


def join_microbatches(outputs: list) -> Any:
    """Join per-microbatch results along the batch (see ``PipelineEngine.gather_outputs``)."""
    if not outputs:
        return outputs
    first = outputs[0]
    if all(isinstance(o, torch.Tensor) and o.dim() > 0 for o in outputs):
        return torch.cat(outputs, dim=0)
    if all(isinstance(o, list) for o in outputs):
        return [item for o in outputs for item in o]
    if all(isinstance(o, dict) for o in outputs) and all(o.keys() == first.keys() for o in outputs):
        return type(first)((k, join_microbatches([o[k] for o in outputs])) for k in first)
    if (all(isinstance(o, tuple) and not hasattr(o, "_fields") for o in outputs)
            and len({len(o) for o in outputs}) == 1):
        return tuple(join_microbatches([o[i] for o in outputs]) for i in range(len(first)))
    return outputs


class PipelineStrategyMixin:
    """What the Trainer and Fabric strategies do alike. Put it before Lightning's ``DDPStrategy``
    in the bases; the subclass makes ``self._engine`` (a :class:`PipelineEngine` of its
    :class:`PipelineConfig`) in its constructor."""

    _engine: PipelineEngine

    @property
    def engine(self) -> PipelineEngine:
        """What the Trainer and Fabric strategies share: the resolved configuration, the topology,
        this rank's executor."""
        return self._engine

    @property
    def config(self) -> PipelineConfig:
        """The pipeline's options, as given to the constructor (checked there)."""
        return self._engine.config

    @property
    def resolved(self) -> Optional[ResolvedPipeline]:
        """The options for this job's world size (sizes and schedule), once known."""
        return self._engine.resolved
    #: Modules left on the meta device (``configure_model``, ``init_module(empty_init=True)``) are
    #: materialised after the cut, only what each rank keeps (``lightning_pp.runtime.cut.meta``).
    materializes_meta_modules = True

    @override
    def _configure_launcher(self) -> None:
        # Runs in the launching process once devices and nodes are known: a configuration that
        # cannot work fails here, before processes are spawned or groups created.
        self.engine.resolve(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @property
    def data_parallel_world(self) -> DataParallelWorld:
        """What data is sharded over: the data-parallel replicas (every stage of one pipeline reads
        the same batches), this rank's replica and the nodes one stage spans."""
        return data_parallel_world(self.config.dims(self.world_size), self.global_rank, self.num_nodes)

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas: what a dataset that shards itself should use as its world size."""
        return self.data_parallel_world.size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's replica: what a dataset that shards itself should use as its rank (the same
        on every stage of one pipeline)."""
        return self.data_parallel_world.rank

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict:
        # Every stage of one pipeline must see the same batch: shard the data over dp only.
        world = self.data_parallel_world
        return {"num_replicas": world.size, "rank": world.rank}

    def _shard_data_over_data_parallel(self) -> None:
        """From the moment the groups exist: litdata shards over the data-parallel ranks
        (``lightning_pp.strategies.data``)."""
        if getattr(self, "_litdata", None) is None:
            self._litdata = LitdataSharding(self.data_parallel_world)
            self._litdata.install()

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        litdata = getattr(self, "_litdata", None)
        return litdata.apply(dataloader) if litdata is not None else dataloader

    @property
    def skipped_steps(self) -> int:
        """Training steps dropped so far because their loss or gradients were not finite."""
        return self.engine.skipped_steps

    @override
    def teardown(self) -> None:
        if self.engine.executor is not None:
            self.engine.executor.close()
        if getattr(self, "_litdata", None) is not None:
            self._litdata.uninstall()
            self._litdata = None
        super().teardown()
