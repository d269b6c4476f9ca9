"""Runs one rank's action list over its model chunks: the step loop.

One training step:

1. the batch is split into microbatches along dim 0 (fewer microbatches for a short batch);
2. the rank's actions (from :mod:`lightning_pp.schedules`) run in order, each the forward,
   backward or both of one (microbatch, chunk) (:mod:`lightning_pp.runtime.step.stage`, over an
   explicit :class:`~lightning_pp.runtime.step.stage.StepState`);
3. data-parallel reductions are launched as each chunk finishes its backward
   (:mod:`lightning_pp.runtime.dp.grads`);
4. one all-reduce gives every rank the batch loss, the normaliser, the inf/nan flags and the batch
   fingerprints, and every rank decides alike (:mod:`lightning_pp.runtime.step.loss`); the gradients
   are divided by the global count.

Failures (:mod:`lightning_pp.runtime.failure.guard`): every wait has the pipeline timeout; the rank that
fails records itself on the job's failure board, and a rank whose peer vanished or stalled names
that peer from its published position.
"""

from __future__ import annotations

import datetime
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_pp.runtime.compile.watch import CompileWatch
from lightning_pp.runtime.config import ResolvedPipeline
from lightning_pp.runtime.failure.diagnosis import Diagnosis
from lightning_pp.runtime.failure.board import FailureBoard, Position
from lightning_pp.runtime.failure.errors import NonFiniteError
from lightning_pp.runtime.failure.watchdog import watchdog_for
from lightning_pp.runtime.dp.grads import GradientSync
from lightning_pp.runtime.failure.guard import StepGuard
from lightning_pp.runtime.step.loss import StepEnd
from lightning_pp.runtime.step.microbatch import batch_fingerprint, batch_size, broadcast_batch, split_microbatches, tensors_in
from lightning_pp.runtime.transport.p2p import PointToPoint
from lightning_pp.runtime.cut.partition import Partition, default_pipeline_inputs
from lightning_pp.runtime.plans.plan import set_streams
from lightning_pp.runtime.process import COMPILED, fact
from lightning_pp.runtime.protocols import HoldsResources, StepObserver
from lightning_pp.runtime.step.rng import StageRNG
from lightning_pp.runtime.dp.sharding import StageSharding, adopt_user_sharding, shard_stage
from lightning_pp.runtime.step.stage import StageRunner, StepState
from lightning_pp.runtime.timeline import Timeline
from lightning_pp.runtime.topology import Topology
from lightning_pp.runtime.transport.waits import BoundedWait
from lightning_pp.schedules import ScheduleConfig, config_for_batch, rank_actions, split_backwards
from lightning_pp.schedules.actions import Action
from lightning_pp.schedules.messages import Message, delivery_marks, send_order


@dataclass(frozen=True)
class StepPlan:
    """What one rank runs for one schedule configuration."""

    config: ScheduleConfig
    actions: list[Action]  # training actions, in order
    eval_actions: list[Action]  # forward-only actions, in order
    expected: dict[bool, dict[int, list[Message]]]  # forward_only -> {neighbour pipeline rank: its send order here}
    deferred: frozenset[tuple[int, int]] = frozenset()  # (microbatch, chunk) whose weight gradient is a W action
    marks: dict[bool, tuple[dict, dict]] = field(default_factory=dict)  # forward_only -> messages.delivery_marks


@dataclass
class StepResult:
    """What a pipelined step returns on every rank."""

    loss: Optional[torch.Tensor]  # batch loss (global weighted mean), same on every rank
    num_samples: float  # global normaliser: samples, or the counts returned by pipeline_loss
    outputs: list[Any] = field(default_factory=list)  # last stage, forward-only: per-microbatch outputs
    nonfinite: Optional[str] = None  # what was not finite (loss, gradients on which ranks), same everywhere
    skipped: bool = False  # nonfinite="skip" dropped this step's gradients


class PipelineExecutor:
    """Executes the schedule for one rank. Holds no Lightning state; strategies wrap it.

    ``pipeline`` (a :class:`~lightning_pp.runtime.config.ResolvedPipeline`: the options, the sizes
    and the schedule) decides, among
    the rest: ``nonfinite``, what a training step whose loss or gradients hold inf/nan does, on
    every rank alike: ``"raise"`` (:class:`NonFiniteError`), ``"skip"`` (the step's gradients are
    dropped, ``.grad`` is left as before the step, so ``optimizer.step()`` after ``zero_grad()``
    changes nothing; ``StepResult.skipped`` is set) or ``"ignore"`` (no gradient check);
    ``check_batches``, the per-step comparison of a fingerprint of each stage's batch (on the loss
    all-reduce; forward-only steps without a loss add one small all-reduce), ``"raise"``
    (:class:`BatchMismatchError` on every rank), ``"warn"`` or ``"off"``; ``broadcast_batches``,
    every stage's batch replaced by pipeline rank 0's (one broadcast per step; no check needed).
    :attr:`schedule` is the schedule (:class:`~lightning_pp.schedules.ScheduleConfig`),
    :attr:`step_schedule` the one the last step ran (fewer microbatches for a short batch).
    """

    def __init__(self, module: nn.Module, partition: Partition, topology: Topology, pipeline: ResolvedPipeline,
                 device: torch.device = torch.device("cpu"), loss_fn: Optional[Callable] = None,
                 inputs_fn: Optional[Callable] = None, board: Optional[FailureBoard] = None,
                 broadcast_parameters: bool = True, record_timeline: bool = True,
                 sharding: Optional[StageSharding] = None) -> None:
        options, schedule = pipeline.config, pipeline.schedule
        self.pipeline, self.schedule = pipeline, schedule
        self.module, self.partition, self.topology, self.device = module, partition, topology, device
        self.timeout: datetime.timedelta = options.timeout
        self.nonfinite = options.nonfinite
        # Every stage of a pipeline must run the same batch: compared every step by fingerprint
        # (``check_batches``), or made so by sending pipeline rank 0's batch to the others.
        self.broadcast_batches = options.broadcast_batches
        self.check_batches = "off" if options.broadcast_batches else options.check_batches
        # Stage-boundary shapes are a function of the microbatch shapes (true unless a layer's
        # output shape depends on the data): skip the shape header once they repeat (p2p.py).
        self.static_shapes = options.static_shapes
        self.board = board if board is not None else FailureBoard()
        self.pp_rank = topology.pp_rank
        self._plans: dict[ScheduleConfig, StepPlan] = {}
        plan = self._plan(schedule)
        self.actions, self.eval_actions = plan.actions, plan.eval_actions
        self.step_schedule = schedule  # what the last step ran (fewer microbatches for a short batch)
        self._short_batch_warned = False
        self.timeline = Timeline(enabled=record_timeline, device=device)
        if device.type == "cuda":
            set_streams(high_priority=True)  # the process's comm stream (runtime.plan)
        self.rng = StageRNG([chunk.stage for chunk in partition.chunks], topology.dp_rank, device)
        self.position = Position()
        self.p2p = PointToPoint(topology.pp_group, topology.global_rank, device, self.timeout, topology.describe,
                                timeline=self.timeline, position=self.position)
        self.wait_collective = BoundedWait(self.timeout, topology.describe, self.position)
        # Sharded data parallelism (runtime.dp.sharding): the user's own fully_shard units, adopted
        # as they are, or (data_parallel_sharding="full") the layers sharded here, after the replicas
        # took dp rank 0's values (a sharded parameter's shards are its only copy).
        # (``sharding``: the layers build_pipeline sharded as it materialised them from the meta device.)
        self.sharding = sharding or adopt_user_sharding(module, partition, topology, options.data_parallel_sharding)
        self.grad_sync = GradientSync(partition, topology, self.actions, module, sharding=self.sharding)
        if broadcast_parameters:
            self.grad_sync.broadcast_parameters()
        if options.data_parallel_sharding == "full" and sharding is None:
            self.sharding = shard_stage(module, partition, topology)
            self.grad_sync.adopt_sharding(self.sharding)
        if self.sharding is not None:
            self.sharding.timeline = self.timeline
        self.steps_done = 0
        watchdog = options.watchdog_config
        self.diagnosis = Diagnosis(self.board, topology.dims.world_size, topology.describe, watchdog,
                                   self.timeout.total_seconds())
        self.watchdog = watchdog_for(self.board, topology.rank, topology.dims.world_size, watchdog)
        self.guard = StepGuard(self.position, self.board, self.diagnosis, self.watchdog, topology.describe,
                               schedule.stage_of, self.pp_rank, on_abort=self._abort)
        self._ref = weakref.ref(self)
        if self.watchdog is not None:
            self.watchdog.watch(self)
        # Schedules with FB actions (combined 1F1B, DualPipeV) run chunks through their schedule plans
        # (runtime/plan.py, runtime/nodes.py) so that an FB overlaps one microbatch's forward with
        # another's backward.
        self.stage = StageRunner(partition, self.p2p, schedule, self.pp_rank, self.rng, self.timeline,
                                 self.wait_collective, topology.describe, schedule.spec.fused,
                                 loss_fn or module.pipeline_loss,
                                 inputs_fn or getattr(module, "pipeline_inputs", None) or default_pipeline_inputs,
                                 # the pipeline's place for what a predict_step would do (argmax, decoding)
                                 getattr(module, "pipeline_predict", None))
        self.step_end = StepEnd(schedule, topology, device)
        layer_modules = [sub for chunk in partition.chunks for layer in chunk.layers for sub in layer.modules()]
        self._step_hooks = [sub.pipeline_step_end for sub in layer_modules if isinstance(sub, StepObserver)]
        self._holders = [sub for sub in layer_modules if isinstance(sub, HoldsResources)]
        # compile=: torch.compile's recompilations and graph breaks, counted per step
        self.compile_watch = CompileWatch() if any(fact(sub, COMPILED, False) for sub in layer_modules) else None
        if self.compile_watch is not None:
            self._step_hooks.append(self.compile_watch.pipeline_step_end)

    # -- the model's functions (the strategies wrap them: self.log calls, Fabric's precision) ----
    @property
    def loss_fn(self) -> Callable:
        return self.stage.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: Callable) -> None:
        self.stage.loss_fn = fn

    @property
    def inputs_fn(self) -> Callable:
        return self.stage.inputs_fn

    @inputs_fn.setter
    def inputs_fn(self, fn: Callable) -> None:
        self.stage.inputs_fn = fn

    @property
    def predict_fn(self) -> Optional[Callable]:
        return self.stage.predict_fn

    # -- schedules ------------------------------------------------------------------------------
    def _plan(self, config: ScheduleConfig) -> StepPlan:
        """This rank's actions for ``config`` and the send orders of its neighbours (cached)."""
        plan = self._plans.get(config)
        if plan is None:
            rank = self.pp_rank
            expected, marks = {}, {}
            for forward_only in (False, True):  # every other rank that sends here, and its order
                tables = [rank_actions(config, r, forward_only) for r in range(config.pp)]
                orders = {src: send_order(config, src, tables[src], rank) for src in range(config.pp) if src != rank}
                expected[forward_only] = {src: order for src, order in orders.items() if order}
                marks[forward_only] = delivery_marks(config, rank, tables)
            actions = rank_actions(config, rank)
            plan = StepPlan(config, actions, rank_actions(config, rank, forward_only=True), expected,
                            frozenset(split_backwards(actions)), marks)
            self._plans[config] = plan
        return plan

    def _plan_for_batch(self, batch: Any) -> StepPlan:
        size = batch_size(batch)
        if size is None:
            split_microbatches(batch, self.schedule.num_microbatches)  # raises: no batch dimension
        config = config_for_batch(self.schedule, size)
        if config is not self.schedule and not self._short_batch_warned:
            self._short_batch_warned = True
            warnings.warn(
                f"lightning_pp: a batch of {size} samples is smaller than num_microbatches="
                f"{self.schedule.num_microbatches}; it runs as {config.num_microbatches} microbatches "
                f"(schedule={config.schedule!r}). Its gradients are exact; only the bubble is larger. This is "
                f"normal for the last batch of an epoch (drop_last=False); for every batch, use a batch size "
                f">= num_microbatches. (Shown once.)", stacklevel=4)
        return self._plan(config)

    # -- public steps -------------------------------------------------------------------------
    def train_step(self, batch: Any, grad_scale: float = 1.0) -> StepResult:
        """Forward and backward of every microbatch; gradients are accumulated into ``.grad``
        (added to any already there) and equal ``grad_scale`` times those of the whole batch on one
        device (``grad_scale = 1 / accumulate_grad_batches`` under gradient accumulation)."""
        saved = {p: p.grad for p in self.grad_sync.params if p.grad is not None}
        for p in saved:
            p.grad = None
        result = self.guard.run(self.steps_done, self._ref, lambda: self._step(batch, train=True, grad_scale=grad_scale))
        self.steps_done += 1
        for hook in self._step_hooks:  # layers that note steps (e.g. staging buffers: warm-up over)
            hook(self.steps_done)
        if result.nonfinite is not None and self.nonfinite != "ignore":
            for p in self.grad_sync.params:  # drop this step's contribution
                p.grad = saved.get(p)
            if self.nonfinite == "raise":
                raise NonFiniteError(
                    f"step {self.steps_done - 1} is not finite: {result.nonfinite}. Every rank raises at this step "
                    f"(nonfinite='raise'); the gradients are left as they were before it. Pass nonfinite='skip' "
                    f"to skip such steps, or run one step under torch.autograd.detect_anomaly() to find the "
                    f"operation that produced it."
                )
            result.skipped = True
            return result
        for p, grad in saved.items():
            p.grad = grad if p.grad is None else p.grad.add_(grad)
        return result

    def eval_step(self, batch: Any, compute_loss: bool = True, collect_outputs: bool = False) -> StepResult:
        """Forward-only pass: the loss (if ``compute_loss``) on every rank and, on the last stage,
        the per-microbatch outputs (if ``collect_outputs``)."""
        with torch.no_grad():
            return self.guard.run(self.steps_done, self._ref, lambda: self._step(
                batch, train=False, compute_loss=compute_loss, collect=collect_outputs))

    def close(self) -> None:
        """Release per-layer resources (staging buffers) on every rank; call at teardown, before
        the process groups are destroyed (symmetric buffers are released collectively)."""
        if self.watchdog is not None:
            self.watchdog.release(self)
        for holder in self._holders:
            holder.pipeline_teardown()

    def where(self) -> str:
        """This rank and the action it is running, for error messages and published positions."""
        return self.guard.where()

    # -- the step loop --------------------------------------------------------------------------
    def _abort(self) -> None:
        self.p2p.reset()
        self.grad_sync.abandon()
        if self.sharding is not None:
            self.sharding.abandon()

    def _step(self, batch: Any, train: bool, compute_loss: bool = True, collect: bool = False,
              grad_scale: float = 1.0) -> StepResult:
        pp = self.schedule.pp
        if train:
            self.grad_sync.check_parameters()  # replaced after setup: raise before any work
        if self.broadcast_batches and pp > 1:
            batch = broadcast_batch(batch, self.topology.global_rank(0), self.topology.pp_group, self.device)
        fingerprint = batch_fingerprint(batch, self.device) if self.check_batches != "off" and pp > 1 else None
        plan = self._plan_for_batch(batch)
        self.step_schedule = plan.config
        microbatches = split_microbatches(batch, plan.config.num_microbatches)
        self.p2p.begin_step(_shapes_key(microbatches) if self.static_shapes else None, forward_only=not train,
                            marks=plan.marks.get(not train))
        for src, order in plan.expected[not train].items():
            self.p2p.expect(src, order)
        state = StepState.start(microbatches, train, compute_loss, collect, self.device, plan.deferred)
        actions = plan.actions if train else plan.eval_actions
        if train:
            self.grad_sync.begin_step(actions)
        self.timeline.begin_step()
        self.guard.actions_started = True
        if self.sharding is not None:  # every unit's all-gather posted, in the order of first use
            self.sharding.gather(list(dict.fromkeys(c for a in actions for c in _chunks_of(a))))
        for index, action in enumerate(actions):
            self.position.action = action
            if self.sharding is not None and self.stage.use_plans:  # plain layers wait in their forward
                for chunk in _chunks_of(action):
                    self.sharding.wait(chunk)
            with self.timeline.span(action.kind, action.microbatch, action.chunk, device_side=True):
                fwd, bwd = action.forward_part(), action.backward_part()
                if fwd is not None and bwd is not None:
                    self.stage.forward_backward(state, fwd, bwd)
                elif fwd is not None:
                    self.stage.forward(state, *fwd)
                elif bwd is not None:
                    self.stage.backward(state, *bwd)
                else:  # W: the weight gradient of an earlier input-gradient-only B
                    self.stage.weight(state, action.microbatch, action.chunk)
            if train:
                self.grad_sync.after_action(index)
        self.position.action = None
        if self.sharding is not None and not train:
            self.sharding.release_all()
        self.p2p.finish()
        totals = self.step_end.run(state.loss_sum, state.count, train=train, compute_loss=compute_loss,
                                   fingerprint=fingerprint, stage_flags=lambda: self.grad_sync.nonfinite_flags(self.device),
                                   step=self.steps_done,
                                   nonfinite=self.nonfinite, check_batches=self.check_batches,
                                   wait=self.wait_collective)
        if train:
            self.grad_sync.finish(scale=grad_scale / totals.count, wait=self.wait_collective)
        self.timeline.end_step()
        return StepResult(loss=totals.loss, num_samples=totals.count, outputs=state.outputs,
                          nonfinite=totals.nonfinite)


def _chunks_of(action: Action) -> tuple[int, ...]:
    """The local chunks an action runs (both halves of an FB)."""
    return tuple(part[1] for part in (action.forward_part(), action.backward_part()) if part is not None) or (action.chunk,)


def _shapes_key(microbatches: list) -> tuple:
    """The shapes and dtypes of every tensor of every microbatch, in order."""
    return tuple(tuple((tuple(t.shape), t.dtype) for t in tensors_in(mb)) for mb in microbatches)
