"""Runs one rank's action list over its model chunks.

One training step:

1. the batch is split into microbatches along dim 0;
2. the rank's actions (from :mod:`lightning_pp.schedules`) run in order; a forward receives its
   input from the previous virtual stage (or calls ``pipeline_inputs`` on the first stage), runs
   the chunk and sends the output on (or calls ``pipeline_loss`` on the last stage); a backward
   receives the output gradient, runs autograd through the chunk and sends the input gradient back;
3. data-parallel reductions are launched as each chunk finishes its backward;
4. the loss sum and sample count are all-reduced, which gives every rank the batch loss and the
   normaliser, and the gradients are divided by the global count. The same all-reduce carries one
   flag per pipeline rank saying whether its gradients hold inf/nan, so the non-finite decision
   (raise, skip the step, or ignore) is the same on every rank without another collective.

Failures (see :mod:`lightning_pp.runtime.failure`): every wait, point-to-point or collective, has
the pipeline timeout; the rank that fails records itself on the job's failure board, and a rank
whose peer vanished or stalled names that peer from its published position.

Loss normalisation: a ``pipeline_loss`` that returns a mean is weighted by its microbatch's sample
count; one that returns ``(loss_sum, count)`` is divided by the global count over all
microbatches and data-parallel ranks. Either way the gradients equal those of the whole batch on
one device.
"""

from __future__ import annotations

import datetime
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.runtime.context import microbatch_context
from lightning_pp.runtime.failure import (
    Diagnosis,
    FailureBoard,
    BatchMismatchError,
    NonFiniteError,
    PipelineCommError,
    PipelineError,
    Position,
    WatchdogConfig,
    add_note,
    classify,
    is_comm_error,
    watchdog_for,
)
from lightning_pp.runtime.grads import GradientSync
from lightning_pp.runtime.nodes import sending
from lightning_pp.runtime.plan import set_streams
from lightning_pp.runtime.protocols import HoldsResources, StepObserver
from lightning_pp.runtime.microbatch import batch_fingerprint, batch_size, broadcast_batch, split_microbatches
from lightning_pp.runtime.p2p import PointToPoint
from lightning_pp.runtime.rng import StageRNG
from lightning_pp.runtime.partition import Partition, default_pipeline_inputs
from lightning_pp.runtime.timeline import Timeline
from lightning_pp.runtime.topology import Topology
from lightning_pp.schedules import ScheduleConfig, config_for_batch, rank_actions
from lightning_pp.schedules.messages import Message, send_order

DEFAULT_TIMEOUT = datetime.timedelta(seconds=600)
NonFinitePolicy = Literal["raise", "skip", "ignore"]
NONFINITE_POLICIES = ("raise", "skip", "ignore")
BatchCheck = Literal["raise", "warn", "off"]
BATCH_CHECKS = ("raise", "warn", "off")


def check_nonfinite_policy(nonfinite: str) -> None:
    """Raise ``ValueError`` unless ``nonfinite`` is one of :data:`NONFINITE_POLICIES`."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r} is invalid: choose one of {', '.join(map(repr, NONFINITE_POLICIES))}.")


def check_batch_policy(check_batches: str, broadcast_batches: bool) -> None:
    """Raise ``ValueError`` unless the batch options are valid."""
    if check_batches not in BATCH_CHECKS:
        raise ValueError(f"check_batches={check_batches!r} is invalid: choose one of {', '.join(map(repr, BATCH_CHECKS))}.")
    if not isinstance(broadcast_batches, bool):
        raise ValueError(f"broadcast_batches={broadcast_batches!r} is invalid: pass True or False.")


class Stash(NamedTuple):
    """What a forward keeps for its backward."""

    received: tuple  # the stage's received inputs (their .grad are the input gradients)
    outputs: tuple  # the outputs sent on, or (loss_sum,) on the last stage
    is_loss: bool
    plan: Any  # the schedule plan (combined 1F1B), else None
    detached: Any  # last stage with a plan: the detached outputs the loss was computed from


@dataclass(frozen=True)
class StepPlan:
    """What one rank runs for one schedule configuration."""

    config: ScheduleConfig
    actions: list  # training actions, in order
    eval_actions: list  # forward-only actions, in order
    expected: dict  # forward_only -> {neighbour pipeline rank: its send order to this rank}


@dataclass
class StepResult:
    """What a pipelined step returns on every rank."""

    loss: Optional[torch.Tensor]  # batch loss (global weighted mean), same on every rank
    num_samples: float  # global normaliser: samples, or the counts returned by pipeline_loss
    outputs: list = field(default_factory=list)  # last stage, forward-only: per-microbatch outputs
    nonfinite: Optional[str] = None  # what was not finite (loss, gradients on which ranks), same everywhere
    skipped: bool = False  # nonfinite="skip" dropped this step's gradients


def _as_tensors(value: Any, where: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return value, True
    raise TypeError(
        f"{where} returned a {type(value).__name__}; between pipeline stages a layer must return a "
        f"tensor or a tuple of tensors (the next layer gets the tuple unpacked). Return tensors only."
    )


def _backward(roots: list[torch.Tensor], grads: list[Optional[torch.Tensor]]) -> None:
    """Autograd from ``roots``. Goes through the engine directly so that roots whose storage was
    released after sending (see ``_release``) pass: the shape check is done against the graph's
    recorded metadata, which the received gradients match."""
    torch.autograd.Variable._execution_engine.run_backward(
        tuple(roots), tuple(grads), False, False, (), True, True
    )


def _release(tensors: tuple[torch.Tensor, ...]) -> None:
    """Drop the storage of sent stage outputs; backward only needs their ``grad_fn``. The send
    holds its own reference to the storage until it completes."""
    for t in tensors:
        if t.requires_grad and t._base is None and t.grad_fn is not None:
            t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


def normalise_loss(value: Any, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) from what ``pipeline_loss`` returned."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        loss_sum, count = value
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
            raise ValueError(
                f"pipeline_loss returned a pair whose first item is {type(loss_sum).__name__}"
                f"{'' if not isinstance(loss_sum, torch.Tensor) else ' of shape ' + str(tuple(loss_sum.shape))}: "
                f"it must be a scalar tensor (the loss summed over the microbatch), with the count second."
            )
        count = torch.as_tensor(count, dtype=torch.float64).reshape(())
        return loss_sum.reshape(()), count
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"pipeline_loss returned {shape}: it must return a scalar tensor (the microbatch's mean "
            f"loss) or a (loss_sum, count) pair. Reduce the loss, e.g. with .mean()."
        )
    return value.reshape(()) * samples, torch.tensor(float(samples), dtype=torch.float64)


class PipelineExecutor:
    """Executes the schedule for one rank. Holds no Lightning state; strategies wrap it.

    ``nonfinite`` decides what a training step whose loss or gradients hold inf/nan does, on every
    rank alike: ``"raise"`` (:class:`NonFiniteError`), ``"skip"`` (the step's gradients are dropped,
    ``.grad`` is left as before the step, so ``optimizer.step()`` after ``zero_grad()`` changes
    nothing; ``StepResult.skipped`` is set) or ``"ignore"`` (no gradient check).

    ``check_batches`` compares a fingerprint of each stage's batch every step (on the loss
    all-reduce; forward-only steps without a loss add one small all-reduce): ``"raise"``
    (:class:`BatchMismatchError` on every rank), ``"warn"`` or ``"off"``. ``broadcast_batches``
    replaces every stage's batch by pipeline rank 0's (one broadcast per step; no check needed).
    """

    def __init__(
        self,
        module: nn.Module,
        partition: Partition,
        topology: Topology,
        config: ScheduleConfig,
        device: torch.device = torch.device("cpu"),
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        loss_fn: Optional[Callable] = None,
        inputs_fn: Optional[Callable] = None,
        board: Optional[FailureBoard] = None,
        broadcast_parameters: bool = True,
        record_timeline: bool = True,
        nonfinite: NonFinitePolicy = "raise",
        watchdog: WatchdogConfig = WatchdogConfig(),
        static_shapes: bool = True,
        check_batches: BatchCheck = "raise",
        broadcast_batches: bool = False,
    ) -> None:
        check_nonfinite_policy(nonfinite)
        check_batch_policy(check_batches, broadcast_batches)
        # Every stage of a pipeline must run the same batch: compared every step by fingerprint
        # (``check_batches``), or made so by sending pipeline rank 0's batch to the others.
        self.check_batches = "off" if broadcast_batches else check_batches
        self.broadcast_batches = broadcast_batches
        self.nonfinite = nonfinite
        self.timeout = timeout
        self.module = module
        self.partition = partition
        self.topology = topology
        self.config = config
        self.device = device
        self.loss_fn = loss_fn or module.pipeline_loss
        self.inputs_fn = inputs_fn or getattr(module, "pipeline_inputs", None) or default_pipeline_inputs
        # Optional: post-processing of the last stage's output per microbatch in prediction
        # (argmax, decoding), the pipeline's place for what a predict_step would do.
        self.predict_fn = getattr(module, "pipeline_predict", None)
        self.board = board if board is not None else FailureBoard()
        self.pp_rank = topology.pp_rank
        self.num_stages = config.num_stages
        self._plans: dict[ScheduleConfig, StepPlan] = {}
        plan = self._plan(config)
        self.actions, self.eval_actions = plan.actions, plan.eval_actions
        self.step_config = config  # the configuration the last step ran (fewer microbatches for a short batch)
        self._short_batch_warned = False
        self._actions_started = False  # for where(): a failure before the first action is at the start
        self.timeline = Timeline(enabled=record_timeline, device=device)
        # Stage-boundary shapes are a function of the microbatch shapes (true unless a layer's
        # output shape depends on the data): skip the shape header once they repeat (p2p.py).
        self.static_shapes = static_shapes
        # Combined 1F1B runs chunks node by node (see runtime/nodes.py) so FB actions can overlap.
        self._use_plans = config.schedule == "combined_1f1b"
        if device.type == "cuda":
            set_streams(high_priority=True)  # the process's comm stream (runtime.plan)
        self.rng = StageRNG([chunk.stage for chunk in partition.chunks], topology.dp_rank, device)
        self.position = Position()
        self.p2p = PointToPoint(topology.pp_group, topology.global_rank, device, timeout, topology.describe,
                                timeline=self.timeline, position=self.position)
        self.grad_sync = GradientSync(partition, topology, self.actions)
        if broadcast_parameters:
            self.grad_sync.broadcast_parameters()
        self.steps_done = 0
        self.diagnosis = Diagnosis(self.board, topology.dims.world_size, topology.describe, watchdog,
                                   timeout.total_seconds())
        self._ref = weakref.ref(self)
        self.watchdog = watchdog_for(self.board, topology.rank, topology.dims.world_size, watchdog)
        if self.watchdog is not None:
            self.watchdog.watch(self)
        self._step_hooks = [
            sub.pipeline_step_end
            for chunk in partition.chunks for layer in chunk.layers for sub in layer.modules()
            if isinstance(sub, StepObserver)
        ]

    def _plan(self, config: ScheduleConfig) -> "StepPlan":
        """This rank's actions for ``config`` and the send orders of its neighbours (cached)."""
        plan = self._plans.get(config)
        if plan is None:
            pp, rank = config.pp, self.pp_rank
            neighbours = {(rank - 1) % pp, (rank + 1) % pp} - {rank}
            plan = StepPlan(
                config,
                rank_actions(config, rank),
                rank_actions(config, rank, forward_only=True),
                {forward_only: {src: send_order(config, src, rank_actions(config, src, forward_only), rank)
                                for src in neighbours}
                 for forward_only in (False, True)},
            )
            self._plans[config] = plan
        return plan

    def _plan_for_batch(self, batch: Any) -> "StepPlan":
        size = batch_size(batch)
        if size is None:
            split_microbatches(batch, self.config.microbatches)  # raises: no batch dimension
        config = config_for_batch(self.config, size)
        if config is not self.config and not self._short_batch_warned:
            self._short_batch_warned = True
            warnings.warn(
                f"lightning_pp: a batch of {size} samples is smaller than num_microbatches="
                f"{self.config.microbatches}; it runs as {config.microbatches} microbatches "
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
        result = self._guarded(lambda: self._step(batch, train=True, grad_scale=grad_scale))
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
            return self._guarded(lambda: self._step(batch, train=False, compute_loss=compute_loss, collect=collect_outputs))

    def close(self) -> None:
        """Release per-layer resources (staging buffers) on every rank; call at teardown, before
        the process groups are destroyed (symmetric buffers are released collectively)."""
        if self.watchdog is not None:
            self.watchdog.release(self)
        for chunk in self.partition.chunks:
            for layer in chunk.layers:
                for sub in layer.modules():
                    if isinstance(sub, HoldsResources):
                        sub.pipeline_teardown()

    @property
    def is_last_stage_rank(self) -> bool:
        return self.pp_rank == (self.num_stages - 1) % self.config.pp

    # -- machinery ----------------------------------------------------------------------------
    def _guarded(self, fn):
        position = self.position
        position.step, position.in_step, position.failed = self.steps_done, True, False
        try:
            if self.watchdog is not None:
                self.watchdog.activate(self._ref)
                if self.watchdog.failure is not None:  # a peer already failed: do not start a doomed step
                    self._refuse_step()
            return fn()
        except BaseException as exc:
            self._on_failure(exc)
            raise
        finally:
            position.in_step, position.action, position.waiting = False, None, None

    def _refuse_step(self) -> None:
        origin = self.watchdog.known_failure()
        if origin is not None:
            self.watchdog.acknowledge(origin)
            raise PipelineError(f"{origin}\n  -> {self.where()} did not start step {self.steps_done}: "
                                f"the pipeline has already failed.")

    def where(self) -> str:
        """This rank and the action it is running, for error messages and published positions."""
        position = self.position
        action = position.action
        if action is None:
            if position.in_step:
                moment = "end" if self._actions_started else "start"
                return f"{self.topology.describe()} at the {moment} of step {position.step}"
            return f"{self.topology.describe()} outside the schedule"
        detail = action.describe()
        part = action.forward_part() or action.backward_part()
        stage = part[1] * self.config.pp + self.pp_rank
        return (
            f"{self.topology.describe()} during {detail} (microbatch {part[0]}, chunk {part[1]}, "
            f"virtual stage {stage})"
        )

    _where = where

    def _on_failure(self, exc: BaseException) -> None:
        where = self.where()
        self.position.failed = True  # published as "failed": peers diagnosing a stall skip this rank
        self.p2p.reset()
        self.grad_sync.abandon()
        watchdog = self.watchdog
        if isinstance(exc, PipelineError):
            return  # already names the origin (a refused step)
        if isinstance(exc, PipelineCommError):
            peer_failure = exc.reason in ("timeout", "closed")
        else:  # a backend error raised while posting a transfer (not waiting for one)
            peer_failure = is_comm_error(exc)
        if peer_failure:
            # Someone else's failure, most likely: a rank that raised recorded itself before its
            # connections closed. If nobody did, name the peer that vanished or the rank that stalled.
            comm = exc if isinstance(exc, PipelineCommError) else PipelineCommError(str(exc), reason=classify(exc))
            origin = self.board.read(wait_seconds=0.2)
            if origin is None:
                self.board.report(self.diagnosis.explain(comm))
                origin = self.board.read() or self.diagnosis.explain(comm)
            if watchdog is not None:
                watchdog.acknowledge(origin)
            raise PipelineError(f"{origin}\n  -> seen by {where}: {comm}") from exc
        message = f"{where} failed: {type(exc).__name__}: {exc}"
        self.board.report(message)
        if watchdog is not None:
            watchdog.acknowledge(self.board.read() or message)
        add_note(exc, f"lightning_pp: the pipeline step failed on {where}.")

    def _wait_collective(self, work, what: str) -> None:
        """Wait for an in-step collective with the pipeline timeout, telling the watchdog."""
        self.position.waiting = (None, what)
        try:
            ok = work.wait(timeout=self.timeout)
        except Exception as exc:  # a member went away, or the timeout
            reason = classify(exc)
            raise PipelineCommError(
                f"{self.topology.describe()}: {what} "
                + (f"timed out after {self.timeout.total_seconds():g}s" if reason == "timeout" else f"failed: {exc}"),
                peer=None, reason=reason,
            ) from exc
        finally:
            self.position.waiting = None
        if ok is False:
            raise PipelineCommError(f"{self.topology.describe()}: {what} timed out after "
                                    f"{self.timeout.total_seconds():g}s", peer=None, reason="timeout")

    def _local_grads_nonfinite(self) -> torch.Tensor:
        """1.0 if any of this rank's gradients holds inf/nan, else 0.0, computed on the device (no
        sync). Uses AMP's fused check (what ``GradScaler`` runs every step): one pass over the
        gradients, exact (no overflow as with a norm), and its "unscale" by exactly 1.0 leaves
        every value unchanged."""
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.grad_sync.params:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                found += (~torch.isfinite(grad.coalesce().values())).any().float()
            else:
                by_dtype.setdefault(grad.dtype, []).append(grad)
        if by_dtype:
            one = torch.ones(1, dtype=torch.float32, device=self.device)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        return found[0].clamp(max=1.0).to(torch.float64)

    def _nonfinite_description(self, loss_sum: float, count: float, flags: list[float]) -> Optional[str]:
        pp = self.config.pp
        loss_bad = not math.isfinite(loss_sum)
        ranks = [r for r, flag in enumerate(flags) if flag > 0]
        if not loss_bad and not ranks:
            return None
        parts = []
        if loss_bad:
            parts.append(f"the batch loss is {loss_sum / count if count else loss_sum}")
        if ranks:
            stages = [r + c * pp for r in ranks for c in range(self.config.vp)]
            parts.append(f"gradients hold inf/nan on pipeline rank(s) {ranks} (virtual stage(s) {sorted(stages)})")
        return "; ".join(parts)

    def _check_same_batches(self, fingerprints: list[float], train: bool) -> None:
        """Compare every pipeline's stages' batch fingerprints (all ranks see all of them, so they
        all decide alike); raise or warn per ``check_batches``."""
        dims = self.topology.dims
        differing = []
        for dp_rank in range(dims.dp):
            ranks = [dims.rank_of(p, dp_rank) for p in range(dims.pp)]
            first = fingerprints[ranks[0]]
            odd = [p for p, r in enumerate(ranks) if fingerprints[r] != first]
            if odd:
                differing.append((dp_rank, ranks, odd))
        if not differing:
            return
        where = "; ".join(
            f"data-parallel replica {dp_rank}: pipeline rank(s) {odd} (global rank(s) {[ranks[p] for p in odd]}) "
            f"got a different batch than pipeline rank 0 (global rank {ranks[0]})"
            for dp_rank, ranks, odd in differing[:4]
        )
        step = f"training step {self.steps_done}" if train else "an evaluation/prediction step"
        message = (
            f"{step}: the stages of a pipeline were given different batches ({where}). Stage 0 reads the "
            f"inputs and the last stage the targets of its own copy of the batch, so this trains on inputs "
            f"paired with other samples' targets. Likely causes: randomness that is not seeded alike on every "
            f"rank (an unseeded `random`/NumPy transform in a Dataset, DataLoader workers seeded per rank, "
            f"e.g. by seed_everything(workers=True), shuffle=True without a common seed), or a sampler that "
            f"depends on the global rank (with Lightning keep use_distributed_sampler=True: the strategy "
            f"shards over data-parallel ranks only). Fixes: seed the data pipeline identically on the ranks of "
            f"a pipeline; or pass broadcast_batches=True, which uses pipeline rank 0's batch on every stage; "
            f"or check_batches='off' if the difference is intended."
        )
        if self.check_batches == "raise":
            raise BatchMismatchError(message)
        warnings.warn(message, stacklevel=2)

    def _step(self, batch: Any, train: bool, compute_loss: bool = True, collect: bool = False,
              grad_scale: float = 1.0) -> StepResult:
        cfg = self.config
        self._actions_started = False
        if self.broadcast_batches and cfg.pp > 1:
            batch = broadcast_batch(batch, self.topology.global_rank(0), self.topology.pp_group, self.device)
        fingerprint = batch_fingerprint(batch, self.device) if self.check_batches != "off" and cfg.pp > 1 else None
        plan = self._plan_for_batch(batch)
        self.step_config = plan.config
        microbatches = split_microbatches(batch, plan.config.microbatches)
        self.p2p.begin_step(_shapes_key(microbatches) if self.static_shapes else None, mode=not train)
        for src, order in plan.expected[not train].items():
            self.p2p.expect(src, order)
        self._batches = microbatches
        self._saved: dict[tuple[int, int], Stash] = {}
        self._local: dict[Message, tuple] = {}
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._count = torch.zeros((), dtype=torch.float64, device=self.device)
        self._outputs = []
        self._train, self._compute_loss, self._collect = train, compute_loss, collect
        actions = plan.actions if train else plan.eval_actions
        if train:
            self.grad_sync.begin_step(actions)
        timeline = self.timeline
        timeline.begin_step()
        position = self.position
        self._actions_started = True
        for index, action in enumerate(actions):
            position.action = action
            with timeline.span(action.kind, action.microbatch, action.chunk, device_side=True):
                fwd, bwd = action.forward_part(), action.backward_part()
                if fwd is not None and bwd is not None:
                    self._forward_backward(fwd, bwd)
                elif fwd is not None:
                    self._forward(*fwd)
                else:
                    self._backward(*bwd)
            if train:
                self.grad_sync.after_action(index)
        position.action = None
        self.p2p.finish()
        loss, count, nonfinite = None, 0.0, None
        if train or compute_loss or fingerprint is not None:
            # One all-reduce carries the loss and the count (only last-stage ranks contribute), one
            # inf/nan flag per pipeline rank and one batch fingerprint per rank: every rank gets them
            # all and decides alike, with no collective of its own.
            parts = [torch.stack([self._loss_sum, self._count])]
            flags = None
            if train and self.nonfinite != "ignore":
                flags = torch.zeros(cfg.pp, dtype=torch.float64, device=self.device)
                flags[self.pp_rank] = self._local_grads_nonfinite()
                parts.append(flags)
            if fingerprint is not None:
                prints = torch.zeros(self.topology.dims.world_size, dtype=torch.float64, device=self.device)
                prints[self.topology.rank] = fingerprint
                parts.append(prints)
            totals = torch.cat(parts)
            self._wait_collective(dist.all_reduce(totals, async_op=True), "the all-reduce of the step's loss")
            values = totals.tolist()
            if fingerprint is not None:
                self._check_same_batches(values[len(values) - self.topology.dims.world_size:], train)
            if train or compute_loss:
                count = values[1]
                if count <= 0:
                    raise ValueError(
                        f"the global loss count is {count}: pipeline_loss must return a positive count "
                        f"(or a mean over a non-empty microbatch)."
                    )
                loss = totals[0] / totals[1]
                nonfinite = self._nonfinite_description(values[0], count, values[2:2 + cfg.pp] if flags is not None else [])
        if train:
            self.grad_sync.finish(scale=grad_scale / count,
                                  wait=lambda work, what: self._wait_collective(work, what))
        timeline.end_step()
        outputs, self._outputs, self._saved, self._batches = self._outputs, [], {}, None
        return StepResult(loss=loss, num_samples=count, outputs=outputs, nonfinite=nonfinite)

    def _deliver(self, stage: int, message: Message, tensors: tuple, as_tuple: bool) -> None:
        dst = stage % self.config.pp
        if dst == self.pp_rank:
            # Same-rank hand-off (pp == 1 with several chunks): a fresh leaf, like a received tensor.
            self._local[message] = (
                tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors),
                as_tuple,
            )
        elif message.direction == "F" and self._use_plans:
            with sending():  # combined 1F1B: forward sends from the comm stream
                self.p2p.send(dst, message, tensors, as_tuple)
        else:
            self.p2p.send(dst, message, tensors, as_tuple)

    def _receive(self, stage: int, message: Message) -> tuple[tuple, bool]:
        src = stage % self.config.pp
        if src == self.pp_rank:
            return self._local.pop(message)
        return self.p2p.recv(src, message)

    # -- forward / backward of one (microbatch, chunk) -------------------------------------------
    def _stage_input(self, microbatch: int, chunk_id: int) -> tuple[tuple, Any]:
        """(received tensors, the chunk's input) for a forward."""
        stage = self.partition.chunks[chunk_id].stage
        if stage == 0:
            return (), self.inputs_fn(self._batches[microbatch])
        received, as_tuple = self._receive(stage - 1, Message("F", microbatch, stage))
        return received, (received if as_tuple else received[0])

    def _context(self, microbatch: int, chunk_id: int):
        samples = batch_size(self._batches[microbatch]) or 1
        return microbatch_context(float(samples), microbatch, chunk_id, self.timeline, self._wait_collective)

    def _forward(self, microbatch: int, chunk_id: int) -> None:
        if self._use_plans and self._train:
            with self._context(microbatch, chunk_id), self.rng.stream(chunk_id):
                plan, hooks = self._forward_plan(microbatch, chunk_id)
                type(plan).run(plan, None, **hooks)
            return
        received, inputs = self._stage_input(microbatch, chunk_id)
        with self._context(microbatch, chunk_id), self.rng.stream(chunk_id), torch.set_grad_enabled(self._train):
            output = self.partition.chunks[chunk_id](inputs)
        self._finish_forward(microbatch, chunk_id, received, output, None)

    def _forward_plan(self, microbatch: int, chunk_id: int):
        """The chunk's plan for ``microbatch`` (built with the pipeline inputs on the first stage)
        and the hooks that carry its stage-boundary transfers: ``pre_forward`` receives the input,
        ``post_forward`` sends the output on (or computes the loss on the last stage)."""
        chunk = self.partition.chunks[chunk_id]
        received_box: list = [()]
        pre_forward = None
        if chunk.stage == 0:
            inputs = self.inputs_fn(self._batches[microbatch])
            plan = chunk.build_schedule_plan(*(inputs if isinstance(inputs, tuple) else (inputs,)))
        else:
            plan = chunk.build_schedule_plan()

            def pre_forward():
                received, inputs = self._stage_input(microbatch, chunk_id)
                received_box[0] = received
                return inputs if isinstance(inputs, tuple) else (inputs,)

        def post_forward(outputs):
            self._finish_forward(microbatch, chunk_id, received_box[0], _untuple(outputs), plan)

        return plan, dict(pre_forward=pre_forward, post_forward=post_forward)

    def _backward_plan(self, microbatch: int, chunk_id: int):
        """The plan a forward stashed, and the hooks of its backward: ``pre_backward`` gets the
        output gradients (received, or the loss's), ``post_backward`` sends the input gradients."""
        plan = self._saved[(microbatch, chunk_id)].plan
        received_box: list = [()]

        def pre_backward():
            received, _, _, grads = self._output_grads(microbatch, chunk_id)
            received_box[0] = received
            return grads

        def post_backward(in_grads):
            self._finish_backward(microbatch, chunk_id, received_box[0], in_grads)

        return plan, dict(pre_backward=pre_backward, post_backward=post_backward)

    def _finish_forward(self, microbatch: int, chunk_id: int, received: tuple, output: Any, plan) -> None:
        chunk = self.partition.chunks[chunk_id]
        stage = chunk.stage
        mb_batch = self._batches[microbatch]
        if stage == self.num_stages - 1:
            if self._collect:
                value = self.predict_fn(output, mb_batch) if self.predict_fn is not None else output
                self._outputs.append(value.detach() if isinstance(value, torch.Tensor) else value)
            if not (self._train or self._compute_loss):
                return
            detached = None
            if plan is not None:  # the loss is its own autograd segment; its grad feeds the plan
                detached = _detach_tree(output)
                output = detached
            with torch.set_grad_enabled(self._train):
                samples = batch_size(mb_batch) or 1
                loss_sum, count = normalise_loss(self.loss_fn(output, mb_batch), samples)
            self._loss_sum += loss_sum.detach().to(torch.float64)
            self._count += count.to(self._count.device)
            if self._train:
                self._saved[(microbatch, chunk_id)] = Stash(received, (loss_sum,), True, plan, detached)
            return
        tensors, as_tuple = _as_tensors(
            output, f"virtual stage {stage} (layers {chunk.first_layer}..{chunk.first_layer + len(chunk.layers) - 1})"
        )
        self._deliver(stage + 1, Message("F", microbatch, stage + 1), tensors, as_tuple)
        if self._train:
            if plan is None and (stage + 1) % self.config.pp != self.pp_rank:
                _release(tensors)
            self._saved[(microbatch, chunk_id)] = Stash(received, tensors, False, plan, None)

    def _output_grads(self, microbatch: int, chunk_id: int):
        """Pop the stash of a forward and get the gradients of its outputs: from the loss on the
        last stage, else from the next stage. Returns (received, plan, roots, grads)."""
        stage = self.partition.chunks[chunk_id].stage
        received, outputs, is_loss, plan, detached = self._saved.pop((microbatch, chunk_id))
        if is_loss:
            roots, grads = list(outputs), [torch.ones_like(outputs[0])]
            if plan is not None:
                _backward(roots, grads)
                leaves = detached if isinstance(detached, tuple) else (detached,)
                return received, plan, None, tuple(t.grad if t.requires_grad else None for t in leaves)
            return received, None, roots, grads
        out_grads, _ = self._receive(stage + 1, Message("B", microbatch, stage))
        needing = [t for t in outputs if t.requires_grad]
        if len(needing) != len(out_grads):
            raise PipelineCommError(
                f"{self.topology.describe()}: stage {stage} produced {len(needing)} outputs that need a "
                f"gradient, but {len(out_grads)} gradients came back for microbatch {microbatch}."
            )
        grads = [None if _is_no_grad(g) else g for g in out_grads]
        if plan is not None:
            it = iter(grads)
            return received, plan, None, tuple(next(it) if t.requires_grad else None for t in outputs)
        pairs = [(t, g) for t, g in zip(needing, grads) if g is not None]
        return received, None, [t for t, _ in pairs], [g for _, g in pairs]

    def _backward(self, microbatch: int, chunk_id: int) -> None:
        if self._saved[(microbatch, chunk_id)].plan is not None:
            with self._context(microbatch, chunk_id):
                plan, hooks = self._backward_plan(microbatch, chunk_id)
                type(plan).run(None, plan, **hooks)
            return
        received, _, roots, grads = self._output_grads(microbatch, chunk_id)
        with self._context(microbatch, chunk_id):
            if roots:
                _backward(roots, grads)
            in_grads = tuple(t.grad for t in received)
        self._finish_backward(microbatch, chunk_id, received, in_grads)

    def _finish_backward(self, microbatch: int, chunk_id: int, received: tuple, in_grads: tuple) -> None:
        stage = self.partition.chunks[chunk_id].stage
        if stage > 0:
            grads = tuple(
                g if g is not None else _no_grad_marker(t)
                for t, g in zip(received, in_grads)
                if t.requires_grad
            )
            self._deliver(stage - 1, Message("B", microbatch, stage - 1), grads, True)

    def _forward_backward(self, f: tuple[int, int], b: tuple[int, int]) -> None:
        """Combined step: the forward of ``f`` and the backward of ``b``, their layers interleaved so
        that one's expert all-to-all runs while the other computes."""
        if not self._use_plans:
            self._forward(*f)
            self._backward(*b)
            return
        with self._context(*f), self.rng.stream(f[1]):  # backward nodes draw no random numbers
            f_plan, f_hooks = self._forward_plan(*f)
            b_plan, b_hooks = self._backward_plan(*b)
            if type(f_plan) is type(b_plan):  # the plan class fuses them, the hooks carry the transfers
                type(f_plan).run(f_plan, b_plan, **f_hooks, **b_hooks)
            else:  # chunks of different plan classes (a layer with its own): one after the other
                type(f_plan).run(f_plan, None, **f_hooks)
                type(b_plan).run(None, b_plan, **b_hooks)


def _no_grad_marker(t: torch.Tensor) -> torch.Tensor:
    """What crosses a stage boundary for a stage input that received no gradient (no path from it
    to the loss: a stop-gradient, an unused output): an empty tensor of the input's dtype and
    number of dimensions. The previous stage then runs no backward from that output, so its
    parameters keep ``grad = None`` as on one device instead of receiving a zero gradient."""
    if t.dim() == 0:
        return torch.zeros_like(t)  # a 0-d tensor has no empty form of its own rank; zero is exact
    return t.new_zeros((0,) + tuple(t.shape[1:]))


def _is_no_grad(g: torch.Tensor) -> bool:
    return g.dim() > 0 and g.numel() == 0


def _shapes_key(microbatches: list) -> tuple:
    """The shapes and dtypes of every tensor of every microbatch, in order."""
    def walk(obj, out):
        if isinstance(obj, torch.Tensor):
            out.append((tuple(obj.shape), obj.dtype))
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                walk(item, out)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item, out)
        return out

    return tuple(tuple(walk(mb, [])) for mb in microbatches)


def _untuple(outputs: tuple) -> Any:
    return outputs[0] if len(outputs) == 1 else outputs


def _detach_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_detach_tree(v) for v in value)
    return value
