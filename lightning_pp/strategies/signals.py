"""Signals under the pipeline: SIGTERM (preemption), SIGINT (Ctrl+C) and the SLURM requeue signal
(``SLURMEnvironment(auto_requeue=True)``, SIGUSR1 by default) are acted on between training steps,
on every rank alike.

Lightning's own handlers act inside the handler, wherever the main thread is when the signal
lands: on SIGTERM it broadcasts a flag over the world group, on the requeue signal it saves a
checkpoint. Under a pipeline the main thread is usually inside a step, so that collective is run
by one rank alone while its peers wait for a stage-boundary transfer (the job hangs), or it pairs
with another collective of its peers (gloo aborts: ``Received data size doesn't match expected
size``). Python's default SIGINT raises ``KeyboardInterrupt`` at the same random place.

Here a handler only records the signal. At the start of every training batch, where Lightning
already runs one collective for its SIGTERM flag (a broadcast from rank 0, which cannot carry
another rank's flag), :meth:`PipelineSignalConnector.at_step_boundary` runs one all-reduce of two
integers instead, so every rank learns at the same boundary which rank received which signal
first. Then, on every rank:

* the requeue signal: the checkpoint Lightning's handler saves (``hpc_ckpt_<n>.ckpt`` in
  ``default_root_dir``, sharded, atomic) is saved, and rank 0 runs ``scontrol requeue <job id>``;
  training goes on until the scheduler ends the job. A requeued ``fit`` resumes from it as on one
  device.
* SIGTERM or SIGINT: the rank that received it goes on the job's failure board (``rank 1 (pp=1,
  dp=0, ep=0) received SIGTERM ...``) and every rank raises :class:`PipelineStopped` (a
  ``SIGTERMException``, so ``OnExceptionCheckpoint`` and ``on_exception`` hooks see the preemption
  they know), which exits the process with status 1 and that message. The last checkpoint saved
  is complete (no save was interrupted) and is the one to resume from.

A second SIGINT raises ``KeyboardInterrupt`` at once, for a job that does not reach its next step.
SIGTERM on the process of Lightning's launcher is passed on to the other local ranks, as Lightning
does. A signal received during validation is acted on at the next training step; one received in
the last training step lets the fit finish (its work is done). ``Trainer.validate``, ``test`` and
``predict`` have no step boundary every rank passes and no state to keep: there SIGTERM and SIGINT
raise :class:`PipelineStopped` at once, which the failure board passes on to every peer as for any
failure in a step.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PipelineStopped(SIGTERMException):
    """Every rank stopped between two training steps because one received SIGTERM or SIGINT. The
    message names that rank and the signal; the process exits with status 1."""


def _encode(signum: Optional[int], rank: int, world_size: int) -> int:
    # The all-reduce takes the maximum: the lowest rank that received a signal wins.
    return 0 if signum is None else (world_size - rank) * 256 + int(signum)


def _decode(code: int, world_size: int) -> tuple[int, int]:
    """(rank, signal number) of a non-zero code."""
    return world_size - code // 256, code % 256


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PipelineSignalConnector(_SignalConnector):
    """The Trainer's signal connector under :class:`~lightning_pp.PipelineStrategy` (see the module
    docstring). ``received_sigterm`` becomes true on every rank at the same step boundary."""

    @classmethod
    def install(cls, trainer: Any, strategy: Any) -> None:
        """Make this the Trainer's connector (before Lightning registers its handlers)."""
        if not isinstance(trainer._signal_connector, cls):
            trainer._signal_connector = cls(trainer, strategy)

    def __init__(self, trainer: Any, strategy: Any) -> None:
        super().__init__(trainer)
        self.strategy = strategy
        self.pending_stop: Optional[int] = None  # the first SIGTERM/SIGINT this rank received
        self.pending_requeue: Optional[int] = None  # the requeue signal, if received since the last save

    # -- handlers: record only ------------------------------------------------------------------
    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self.pending_stop = self.pending_requeue = None
        self._original_handlers = self._get_current_signal_handlers()
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
            return  # signals go to the main thread only; Windows has neither SIGUSR1 nor this problem
        environment = self.trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            log.info("SLURM auto-requeueing enabled. Setting signal handlers.")
            requeue_signal = environment.requeue_signal
            if requeue_signal is not None and not self._has_already_handler(requeue_signal):
                self._register_signal(requeue_signal, self._on_requeue_signal)
        term_handlers: list = [self._on_stop_signal]
        if self._has_already_handler(signal.SIGTERM):
            term_handlers.append(signal.getsignal(signal.SIGTERM))  # a user's handler runs too
        self._register_signal(signal.SIGTERM, _HandlersCompose(term_handlers))
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a user's own is left alone
            self._register_signal(signal.SIGINT, self._on_stop_signal)
        # Lightning's per-batch SIGTERM broadcast (a collective every rank already runs at the start
        # of each training batch) becomes the boundary where every rank learns of any signal.
        self.trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self.at_step_boundary

    def teardown(self) -> None:
        self.trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        super().teardown()

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        if self.pending_stop is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # pressed again: the user does not want to wait for the step
            return
        self.pending_stop = signum
        launcher = self.trainer.strategy.launcher
        if signum == signal.SIGTERM and launcher is not None:
            launcher.kill(signum)  # the launcher's process passes it on to the ranks it started
        if self.trainer.state.fn != TrainerFn.FITTING:
            raise PipelineStopped(f"{self._describe(self.trainer.global_rank)} received {signal_name(signum)} "
                                  f"during {self.trainer.state.fn.value}")
        log.info(rank_prefixed_message(f"Received {signal_name(signum)}: every rank stops before its next "
                                       f"training step", self.trainer.local_rank))

    def _on_requeue_signal(self, signum: int, _frame: Any) -> None:
        if self.pending_requeue is None:
            self.pending_requeue = signum

    # -- the step boundary: every rank alike ---------------------------------------------------
    def at_step_boundary(self) -> None:
        """Called at the start of each training batch on every rank (in place of Lightning's
        ``_broadcast_sigterm_tensor``): one all-reduce tells every rank the signals any rank has
        received; then every rank saves and requeues, or stops, alike."""
        trainer = self.trainer
        world = trainer.world_size
        codes = torch.tensor([_encode(self.pending_stop, trainer.global_rank, world),
                              _encode(self.pending_requeue, trainer.global_rank, world)],
                             dtype=torch.int64, device=self.strategy.root_device)
        work = dist.all_reduce(codes, op=dist.ReduceOp.MAX, async_op=True)
        work.wait(timeout=self.strategy.config.timeout)
        stop, requeue = codes.tolist()
        if requeue:
            self.pending_requeue = None
            self._save_and_requeue(*_decode(requeue, world))
        if stop:
            self._stop(*_decode(stop, world))

    def _describe(self, rank: int) -> str:
        topology = self.strategy.engine.topology
        return topology.describe(rank) if topology is not None else f"rank {rank}"

    def _stop(self, rank: int, signum: int) -> None:
        trainer = self.trainer
        origin = (f"{self._describe(rank)} received {signal_name(signum)}: every rank stopped before training "
                  f"step {trainer.global_step}")
        found = self.strategy.engine.failure_context(trainer.global_rank)
        if found is not None:
            board = found[0]
            board.report(origin)  # first writer wins: every rank writes the same
            origin = board.read() or origin
        from lightning_pp.runtime.failure.watchdog import current_watchdog

        watchdog = current_watchdog()
        if watchdog is not None:
            watchdog.acknowledge(origin)  # this rank is raising for it
        self.received_sigterm = True
        raise PipelineStopped(f"{origin}\n  -> {self._describe(trainer.global_rank)} stopped")

    def _save_and_requeue(self, rank: int, signum: int) -> None:
        trainer = self.trainer
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        rank_zero_info(f"{self._describe(rank)} received {signal_name(signum)} (auto-requeue): saving {path} on "
                       f"every rank, then requeueing the job")
        for logger in trainer.loggers:
            logger.finalize("finished")
        trainer.save_checkpoint(path)  # rank 0's path is the one every rank writes (checkpoint.save)
        if trainer.is_global_zero:
            requeue_slurm_job()


def record_stop(exception: BaseException, board: Any) -> bool:
    """Whether ``exception``, ending this rank's run, is a :class:`PipelineStopped`. If so its first
    line (the rank and the signal) goes on the failure board (where a stop outside a step is not
    yet) and the watchdog is told this rank is raising for it."""
    if not isinstance(exception, PipelineStopped):
        return False
    from lightning_pp.runtime.failure.watchdog import current_watchdog

    board.report(str(exception).splitlines()[0])  # first writer wins: a fit's stop is there already
    watchdog = current_watchdog()
    if watchdog is not None:
        watchdog.acknowledge(board.read())
    return True


def requeue_slurm_job() -> int:
    """``scontrol requeue`` this SLURM job (or array task); the command's exit status."""
    array_job_id = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job_id is not None:
        job_id = f"{array_job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_-]+", job_id):
        raise ValueError(f"SLURM job id {job_id!r} is not a job id: it must be digits (an array task: "
                         f"<job>_<task>)")
    log.info(f"requeueing SLURM job {job_id}...")
    result = subprocess.call(["scontrol", "requeue", job_id])
    if result == 0:
        log.info(f"Requeued SLURM job: {job_id}")
    else:
        log.warning(f"Requeuing SLURM job {job_id} failed with error code {result}")
    return result
