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
from lightning_pp.runtime.dp.grads import GradientSync
from lightning_pp.runtime.dp.norm import clip_grad_norm_, grad_norm
from lightning_pp.runtime.failure.guard import StepGuard
from lightning_pp.runtime.step.loss import StepEnd
from lightning_pp.runtime.step.microbatch import batch_fingerprint, batch_size, broadcast_batch, split_microbatches, tensors_in
from lightning_pp.runtime.transport.p2p import PointToPoint
from lightning_pp.runtime.cut.partition import Partition
from lightning_pp.runtime.step.rng import StageRNG
from lightning_pp.runtime.dp.sharding import StageSharding
from lightning_pp.runtime.step.stage import StageRunner, StepState
from lightning_pp.runtime.timeline import Timeline
from lightning_pp.runtime.topology import Topology
from lightning_pp.runtime.transport.waits import BoundedWait
from lightning_pp.schedules.tables import RankPlan, ScheduleConfig, config_for_batch, rank_plan
from lightning_pp.schedules.actions import Action


@dataclass
class StepResult:
    """What a pipelined step returns on every rank."""

    loss: Optional[torch.Tensor]  # batch loss (global weighted mean), same on every rank
    num_samples: float  # global normaliser: samples, or the counts returned by pipeline_loss
    outputs: list[Any] = field(default_factory=list)  # last stage, forward-only: per-microbatch outputs
    nonfinite: Optional[str] = None  # what was not finite (loss, gradients on which ranks), same everywhere
    skipped: bool = False  # nonfinite="skip" dropped this step's gradients


@dataclass
class StepParts:
    """The executor's collaborators, made and wired by :func:`~lightning_pp.runtime.build.build_pipeline`
    (which decides everything about them, sharding included): the executor only runs steps with them."""

    module: nn.Module
    partition: Partition
    topology: Topology
    device: torch.device
    timeline: Timeline
    rng: StageRNG
    position: Position
    p2p: PointToPoint
    wait_collective: BoundedWait  # every in-step collective's bounded wait
    sharding: Optional[StageSharding]  # FSDP2 units of this rank's stage (runtime.dp.sharding), or None
    grad_sync: GradientSync
    board: FailureBoard
    diagnosis: Diagnosis
    watchdog: Any  # a failure.watchdog.Watchdog, or None
    guard: StepGuard
    stage: StageRunner
    step_end: StepEnd
    step_hooks: list = field(default_factory=list)  # called with the step count after each training step
    holders: list = field(default_factory=list)  # layers with per-layer resources, released by close()
    compile_watch: Optional[CompileWatch] = None  # compile=: compilations and recompilations per step


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

    The strategies and callbacks use only :attr:`SURFACE` (tests/test_imports.py holds them to it);
    the collaborators in ``parts`` are the runtime's own.
    """

    SURFACE = ("train_step", "eval_step", "forward", "clip_grad_norm", "grad_norm", "close", "failure_context",
               "pipeline", "schedule", "step_schedule", "topology", "partition", "module", "device", "timeline",
               "compile_watch", "layout_choice", "loss_fn", "inputs_fn")

    def __init__(self, pipeline: ResolvedPipeline, parts: StepParts) -> None:
        options = pipeline.config
        self.pipeline, self.schedule, self.parts = pipeline, pipeline.schedule, parts
        self.step_schedule = pipeline.schedule  # what the last step ran (fewer microbatches for a short batch)
        self.module, self.partition, self.topology, self.device = parts.module, parts.partition, parts.topology, parts.device
        self.pp_rank, self.timeline, self.compile_watch = parts.topology.pp_rank, parts.timeline, parts.compile_watch
        self.p2p, self.grad_sync, self.sharding, self.stage = parts.p2p, parts.grad_sync, parts.sharding, parts.stage
        self.rng, self.position, self.guard, self.step_end = parts.rng, parts.position, parts.guard, parts.step_end
        self.wait_collective, self.watchdog = parts.wait_collective, parts.watchdog
        self.nonfinite = options.nonfinite
        # Every stage of a pipeline must run the same batch: compared every step by fingerprint
        # (``check_batches``), or made so by sending pipeline rank 0's batch to the others.
        self.broadcast_batches = options.broadcast_batches
        self.check_batches = "off" if options.broadcast_batches else options.check_batches
        # Stage-boundary shapes are a function of the microbatch shapes (true unless a layer's
        # output shape depends on the data): skip the shape header once they repeat (p2p.py).
        self.static_shapes = options.static_shapes
        self._plans: dict[ScheduleConfig, RankPlan] = {}  # this rank's table per configuration run
        plan = self._plan(pipeline.schedule)
        self.actions, self.eval_actions = plan.actions, plan.eval_actions
        self.steps_done, self._short_batch_warned = 0, False
        self.layout_choice = None  # layout="auto": what was chosen and why (set by build_pipeline)
        self._ref = weakref.ref(self)
        if self.watchdog is not None:
            self.watchdog.watch(self)

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
    def _plan(self, config: ScheduleConfig) -> RankPlan:
        plan = self._plans.get(config)
        if plan is None:
            plan = self._plans[config] = rank_plan(config, self.pp_rank)
        return plan

    def _plan_for_batch(self, batch: Any) -> RankPlan:
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
        for hook in self.parts.step_hooks:  # layers that note steps (e.g. staging buffers: warm-up over)
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

    def forward(self, inputs: tuple) -> StepResult:
        """Forward-only pass of the first pipeline layer's positional ``inputs`` (not a batch: no
        ``pipeline_inputs``, no ``pipeline_predict``), split into microbatches as a batch is; the
        last stage's result holds the per-microbatch outputs of the last layer."""
        stage = self.stage
        saved = stage.inputs_fn, stage.predict_fn
        stage.inputs_fn, stage.predict_fn = tuple, None  # the microbatch of the arguments, unpacked
        try:
            return self.eval_step(tuple(inputs), compute_loss=False, collect_outputs=True)
        finally:
            stage.inputs_fn, stage.predict_fn = saved

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every rank's gradients by the global norm over all pipeline, data and expert ranks
        (:mod:`lightning_pp.runtime.dp.norm`); returns that norm."""
        return clip_grad_norm_(self.grad_sync, self.topology, self.partition, max_norm, norm_type, error_if_nonfinite)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm, as one device computes it over the whole model."""
        return grad_norm(self.grad_sync, self.topology, self.partition, norm_type)

    def failure_context(self) -> tuple[FailureBoard, Diagnosis]:
        """The job's failure board and this rank's diagnosis, for explaining a failure outside the step."""
        return self.parts.board, self.parts.diagnosis

    def close(self) -> None:
        """Release per-layer resources (staging buffers) on every rank; call at teardown, before
        the process groups are destroyed (symmetric buffers are released collectively)."""
        if self.watchdog is not None:
            self.watchdog.release(self)
        for holder in self.parts.holders:
            holder.pipeline_teardown()

    def where(self) -> str:
        """This rank and the action it is running, for error messages and published positions."""
        return self.guard.where()

    # -- the step loop --------------------------------------------------------------------------
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
