"""What the Trainer and the Fabric strategies share: the pipeline's configuration (one
:class:`~lightning_pp.runtime.config.PipelineConfig`, made from the constructor's typed arguments),
building the pipeline, logging from the last stage, gradient clipping, predictions."""

from __future__ import annotations

import atexit
import logging
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from typing_extensions import override
from torch import nn

from lightning_pp.runtime.build import build_pipeline, find_executor
from lightning_pp.runtime.cut.partition import check_protocol
from lightning_pp.runtime.step.executor import PipelineExecutor, StepResult
from lightning_pp.runtime.topology import build_topology
from lightning_pp.runtime.config import PipelineConfig, ResolvedPipeline
from lightning_pp.runtime.failure.guard import failure_seen_in_process
from lightning_pp.runtime.step.microbatch import batch_size, map_tensors
from lightning_pp.strategies.data import DataParallelWorld, LitdataSharding, data_parallel_world
from lightning_pp.strategies.loops import LogRecorder
from lightning_pp.runtime.process import state

_log = logging.getLogger("lightning_pp")

#: Lightning's own arguments of the strategies, described for ``__init__``'s docstring.
LIGHTNING_ARGUMENTS = {
    name: f"as for Lightning's DDPStrategy{extra}." for name, extra in (
        ("accelerator", ""), ("parallel_devices", ""), ("cluster_environment", ""), ("checkpoint_io", ""),
        ("precision_plugin", ""), ("process_group_backend", ""),
        ("timeout", ": the process group's timeout (the pipeline's own waits: pipeline_timeout)"),
        ("start_method", ""))
}


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
        self.model_parameters: Optional[int] = None  # the whole model's parameter count, taken before the cut

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
            self.topology = build_topology(resolved.dims.pp, resolved.dims.ep, device_type, resolved.dims.tp)
            _log.info("lightning_pp: schedule=%s, pipeline_parallel_size=%d, virtual_pipeline_size=%d, "
                      "num_microbatches=%d, expert_parallel_size=%d, data-parallel replicas=%d",
                      resolved.schedule.schedule, resolved.dims.pp, resolved.schedule.vp,
                      resolved.schedule.num_microbatches, resolved.dims.ep, resolved.dims.dp)

    def forget_earlier_failure(self) -> None:
        """At the start of a run, on every rank: a failure that an earlier run in these processes put on
        the job's board (a sweep's trial that failed on every rank) belongs to that run; left there,
        every rank would refuse this run's first step. Cleared between two barriers: no rank still
        reads it, none starts a step before it is gone."""
        from lightning_pp.runtime.failure.board import FailureBoard
        from lightning_pp.runtime.failure.watchdog import process_watchdog

        board = FailureBoard()
        if board.store is None:
            return  # no process group: nothing shared
        dist.barrier()
        if dist.get_rank() == 0:
            board.clear()
        dist.barrier()
        watchdog = process_watchdog()
        if watchdog is not None:
            watchdog.forget()

    def setup_module(self, module: nn.Module, device: torch.device, example_batch: Any = None) -> PipelineExecutor:
        """Cut ``module`` for this rank (once; a module already cut is reused). ``example_batch``:
        what ``layout="auto"`` measures on (see ``build_pipeline``)."""
        existing = find_executor(module)
        if existing is not None:
            self.executor = existing
            return existing
        check_protocol(module)
        self.setup_topology(device.type)
        self.model_parameters = sum(p.numel() for p in module.parameters())  # the whole model's, before the cut
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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The whole model's forward, as on one device, through the forward-only schedule of this
        engine's executor (see :meth:`forward_of`)."""
        return self.forward_of(self.executor, args, kwargs)

    def forward_of(self, executor: PipelineExecutor, args: tuple, kwargs: dict) -> Any:
        """The whole model's forward, as on one device, through ``executor``'s forward-only
        schedule: the positional arguments are the first pipeline layer's inputs (what
        ``pipeline_inputs`` returns for a batch), split into microbatches as a batch is (an uneven
        last one included); the last layer's outputs, joined over the microbatches (tensors
        concatenated, tuples field by field), come back on every rank of the pipeline, on this
        rank's device. Collective: every rank of the pipeline calls it with the same arguments (the
        user's evaluation code runs alike on every rank). Forward-only: gradients must be off, as in
        Lightning's evaluation loops; training's forward and backward belong to the schedule."""
        if kwargs:
            raise TypeError(
                f"the model's forward runs through the pipeline, whose first layer takes positional inputs only; "
                f"got keyword argument(s) {', '.join(sorted(kwargs))}. Pass them positionally, in the order the "
                f"first pipeline layer takes them (as pipeline_inputs returns them).")
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the model's forward under pipeline parallelism is forward-only: call it under torch.no_grad() "
                "(Lightning's validation, test and predict loops do). Training runs every microbatch's forward "
                "and backward through the schedule, with the loss from pipeline_loss: the Trainer does it for "
                "you; in Fabric call `loss = fabric.strategy.pipeline_step(model, batch)`.")
        if not args:
            raise TypeError("the model's forward needs the first pipeline layer's inputs as positional arguments")
        result = executor.forward(tuple(args))
        device = executor.device
        return map_tensors(lambda t: t.to(device), self.gather_outputs(result.outputs, executor))

    @contextmanager
    def module_forward(self, module: nn.Module) -> Iterator[None]:
        """Within: ``module(...)`` (its ``forward``) runs the whole model through the pipeline
        (:meth:`forward`), so evaluation code written for one device (``self(x)`` in
        ``validation_step``) runs as written."""
        previous = module.__dict__.get("forward")
        module.__dict__["forward"] = self.forward
        try:
            yield
        finally:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous

    def describe_stage(self) -> str:
        """What this rank holds, for what shows one rank's view of the model (Lightning's model
        summary): its layers and parameters against the whole model's."""
        executor = self.executor
        layers = ", ".join(f"{c.first_layer}..{c.first_layer + len(c.layers) - 1}" for c in executor.partition.chunks)
        held = sum(p.numel() for p in executor.module.parameters())
        total = f" of the whole model's {self.model_parameters:,}" if self.model_parameters is not None else ""
        return (f"{self.topology.describe()} holds pipeline layers {layers} of {len(executor.partition.layer_stage)} "
                f"and {held:,} parameters{total}")

    def failure_context(self, global_rank: int) -> Optional[tuple]:
        """``(board, this rank's description, diagnosis)`` for explaining a failure outside the
        step on every rank, or ``None`` when there is no process group (yet) to share it through."""
        from lightning_pp.runtime.failure.board import FailureBoard

        executor = self.executor
        board, diagnosis = executor.failure_context() if executor is not None else (FailureBoard(), None)
        if board.store is None:
            return None
        topology = executor.topology if executor is not None else self.topology
        me = topology.describe() if topology is not None else f"rank {global_rank}"
        return board, me, diagnosis

    def last_stage_rank(self, executor: Optional[PipelineExecutor] = None) -> int:
        """Global rank of the last pipeline stage in this rank's data-parallel slot."""
        return self.topology.global_rank((executor or self.executor).schedule.last_stage_rank)

    def gather_logs(self) -> dict[str, tuple[float, dict]]:
        """The last stage's recorded logs, on every rank of the pipeline."""
        logs = self.recorder.take()
        if self.topology.pp > 1:
            box = [logs]
            dist.broadcast_object_list(box, src=self.last_stage_rank(), group=self.topology.pp_group)
            logs = box[0]
        return logs

    def gather_outputs(self, outputs: list, executor: Optional[PipelineExecutor] = None) -> Any:
        """Per-microbatch outputs of the last stage (``pipeline_predict``'s results where the module
        has it), joined along the batch, on every rank of the pipeline: tensors concatenated,
        lists chained, dicts and tuples joined field by field; anything else stays a list with one
        entry per microbatch."""
        if self.topology.pp > 1:
            box = [map_tensors(torch.Tensor.cpu, outputs)]
            dist.broadcast_object_list(box, src=self.last_stage_rank(executor), group=self.topology.pp_group)
            outputs = box[0]
        return join_microbatches(outputs)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        return self.executor.clip_grad_norm(max_norm, norm_type, error_if_nonfinite)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        return self.executor.grad_norm(norm_type)


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
