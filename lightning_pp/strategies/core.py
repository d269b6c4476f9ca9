"""What the Trainer and the Fabric strategies share: options, building the pipeline, logging
from the last stage, gradient clipping, predictions."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.runtime import (
    CheckpointPolicy,
    PipelineExecutor,
    StepResult,
    build_pipeline,
    build_topology,
    check_protocol,
)
from lightning_pp.runtime.executor import check_batch_policy, check_nonfinite_policy
from lightning_pp.runtime.failure import WatchdogConfig
from lightning_pp.runtime.grads import clip_grad_norm_, grad_norm
from lightning_pp.runtime.microbatch import batch_size
from lightning_pp.runtime.partition import checkpointed_layers
from lightning_pp.runtime.topology import ParallelDims
from lightning_pp.schedules import SCHEDULES, ScheduleConfig, make_config

DEFAULT_PIPELINE_TIMEOUT = datetime.timedelta(seconds=600)


@dataclass
class PipelineOptions:
    """The pipeline part of a strategy's configuration. ``None`` sizes are derived from the world
    size: pipeline size = world / expert size, microbatches = 2 x pipeline size.

    ``nonfinite="raise"`` by default: a step whose loss or gradients hold inf/nan stops training on
    every rank at that step, naming the pipeline ranks whose gradients were affected. Unnoticed,
    one such step turns every parameter into nan and the rest of a long multi-GPU run is wasted;
    "skip" (drop the step, keep going, warn) is for runs that expect rare spikes, "ignore" is
    plain PyTorch's behaviour."""

    pipeline_parallel_size: Optional[int] = None
    expert_parallel_size: int = 1
    virtual_pipeline_size: int = 1
    num_microbatches: Optional[int] = None
    schedule: str = "1f1b"
    layout: Union[None, str, list[int]] = None
    microbatch_group_size: Optional[int] = None
    pipeline_timeout: datetime.timedelta = DEFAULT_PIPELINE_TIMEOUT
    nonfinite: str = "raise"
    pipeline_watchdog: Union[bool, WatchdogConfig] = True
    activation_checkpointing: CheckpointPolicy = False
    static_shapes: bool = True
    check_batches: str = "raise"
    broadcast_batches: bool = False

    def check_static(self) -> None:
        """Checks that need no world size (run in the constructor)."""
        check_nonfinite_policy(self.nonfinite)
        check_batch_policy(self.check_batches, self.broadcast_batches)
        if not isinstance(self.static_shapes, bool):
            raise ValueError(f"static_shapes={self.static_shapes!r} is invalid: pass True or False.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not a known schedule: choose one of {', '.join(SCHEDULES)}.")
        if self.pipeline_parallel_size is not None:
            self.schedule_config(self.pipeline_parallel_size)
        checkpointed_layers([], self.activation_checkpointing)  # the policy's form; its layers at setup

    def dims(self, world_size: int) -> ParallelDims:
        ep = self.expert_parallel_size
        if self.pipeline_parallel_size is None:
            ParallelDims(world_size, 1, ep).check()
            return ParallelDims(world_size, world_size // ep, ep).check()
        return ParallelDims(world_size, self.pipeline_parallel_size, ep).check()

    def schedule_config(self, pp: int) -> ScheduleConfig:
        return make_config(self.schedule, pp, self.virtual_pipeline_size, self.num_microbatches, self.microbatch_group_size)

    def check(self, world_size: int) -> ScheduleConfig:
        """Every configuration check, before any process group exists."""
        return self.schedule_config(self.dims(world_size).pp)


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


class PipelineEngine:
    """Builds the executor for a module and runs steps; no Lightning state."""

    def __init__(self, options: PipelineOptions) -> None:
        self.options = options
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

    def setup_topology(self, device_type: str) -> None:
        if self.topology is None:
            dims = self.options.dims(dist.get_world_size())
            self.options.check(dist.get_world_size())
            self.topology = build_topology(dims.pp, dims.ep, device_type)

    def setup_module(self, module: nn.Module, device: torch.device) -> PipelineExecutor:
        """Cut ``module`` for this rank (once; a module already cut is reused)."""
        existing = getattr(module, "_lpp_executor", None)
        if existing is not None:
            self.executor = existing
            return existing
        check_protocol(module)
        self.setup_topology(device.type)
        opts = self.options
        executor = build_pipeline(
            module,
            pipeline_parallel_size=self.topology.pp,
            virtual_pipeline_size=opts.virtual_pipeline_size,
            num_microbatches=opts.num_microbatches,
            schedule=opts.schedule,
            expert_parallel_size=opts.expert_parallel_size,
            layout=opts.layout,
            microbatch_group_size=opts.microbatch_group_size,
            device=device,
            timeout=opts.pipeline_timeout,
            topology=self.topology,
            nonfinite=opts.nonfinite,
            watchdog=opts.pipeline_watchdog,
            activation_checkpointing=opts.activation_checkpointing,
            static_shapes=opts.static_shapes,
            check_batches=opts.check_batches,
            broadcast_batches=opts.broadcast_batches,
        )
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

    def last_stage_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's data-parallel slot."""
        cfg = self.executor.config
        return self.topology.global_rank((cfg.num_stages - 1) % cfg.pp)

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
            box = [_to_cpu(outputs)]
            dist.broadcast_object_list(box, src=self.last_stage_rank(), group=self.topology.pp_group)
            outputs = box[0]
        return join_microbatches(outputs)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        ex = self.executor
        return clip_grad_norm_(ex.grad_sync, ex.topology, ex.partition, max_norm, norm_type, error_if_nonfinite)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        ex = self.executor
        return grad_norm(ex.grad_sync, ex.topology, ex.partition, norm_type)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    return value


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
    in the bases; the subclass sets ``self.options`` and ``self.engine`` in its constructor."""

    options: PipelineOptions
    engine: PipelineEngine
    #: Modules left on the meta device (``configure_model``, ``init_module(empty_init=True)``) are
    #: materialised after the cut, only what each rank keeps (``lightning_pp.runtime.meta``).
    materializes_meta_modules = True

    def _configure_launcher(self) -> None:
        # Runs in the launching process once devices and nodes are known: a configuration that
        # cannot work fails here, before processes are spawned or groups created.
        self.options.check(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @property
    def distributed_sampler_kwargs(self) -> dict:
        # Every stage of one pipeline must see the same batch: shard the data over dp only.
        dims = self.options.dims(self.world_size)
        return {"num_replicas": dims.dp, "rank": dims.coordinates(self.global_rank)["dp"]}

    @property
    def skipped_steps(self) -> int:
        """Training steps dropped so far because their loss or gradients were not finite."""
        return self.engine.skipped_steps

    def teardown(self) -> None:
        if self.engine.executor is not None:
            self.engine.executor.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        from lightning_pp.strategies.registration import register_into

        register_into(strategy_registry, cls)

