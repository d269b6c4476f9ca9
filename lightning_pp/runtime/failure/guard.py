"""A step's failure handling: what a rank publishes while it runs a step, and what it does when
the step fails (see :mod:`lightning_pp.runtime.failure` for the board, the watchdog and the
diagnosis it relies on).

A rank whose step raises records itself on the job's failure board before its connections close
(``rank 1 (pp=1, dp=0, ep=0) during F0.0 (...) failed: ValueError: ...``); a rank whose transfer
or collective fails because a peer went away or stalled raises a ``PipelineError`` quoting the
board (or, if nobody recorded anything, naming the peer from its published position).
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_pp.runtime.failure.diagnosis import Diagnosis
from lightning_pp.runtime.failure.board import FailureBoard, Position
from lightning_pp.runtime.failure.errors import PipelineCommError, PipelineError, add_note, classify
from lightning_pp.runtime.failure.outside_step import is_comm_error
from lightning_pp.runtime.failure.watchdog import process_watchdog
from lightning_pp.runtime.process import state

def failure_seen_in_process() -> bool:
    """Whether a pipeline step failed in this process, or its watchdog last saw a failure on the
    job's board: a peer may then still be inside a collective with this process."""
    watchdog = process_watchdog()
    return state().failed_steps > 0 or (watchdog is not None and watchdog.failure is not None)


class StepGuard:
    """Runs steps under the failure protocol. ``describe()`` names this rank; ``on_abort()``
    drops the transfer and reduction state of a failed step; ``stage_of(pp_rank, chunk)`` (the
    schedule's :meth:`~lightning_pp.schedules.ScheduleConfig.stage_of`) places an action's virtual
    stage in messages."""

    def __init__(self, position: Position, board: FailureBoard, diagnosis: Diagnosis, watchdog, describe: Callable[[], str],
                 stage_of: Callable[[int, int], int], pp_rank: int, on_abort: Callable[[], None]) -> None:
        self.position, self.board, self.diagnosis, self.watchdog = position, board, diagnosis, watchdog
        self.describe, self.stage_of, self.pp_rank, self.on_abort = describe, stage_of, pp_rank, on_abort
        self.actions_started = False  # for where(): a failure before the first action is at the start

    def run(self, step: int, owner_ref, fn: Callable[[], Any]) -> Any:
        """``fn()`` as step ``step`` of this rank (``owner_ref``: a weak reference to the executor,
        for the watchdog)."""
        position = self.position
        position.step, position.in_step, position.failed = step, True, False
        self.actions_started = False
        try:
            if self.watchdog is not None:
                self.watchdog.activate(owner_ref)
                if self.watchdog.failure is not None:  # a peer already failed: do not start a doomed step
                    self._refuse(step)
            return fn()
        except BaseException as exc:
            self._on_failure(exc)
            raise
        finally:
            position.in_step, position.action, position.waiting = False, None, None

    def _refuse(self, step: int) -> None:
        origin = self.watchdog.known_failure()
        if origin is not None:
            self.watchdog.acknowledge(origin)
            raise PipelineError(f"{origin}\n  -> {self.where()} did not start step {step}: "
                                f"the pipeline has already failed.")

    def where(self) -> str:
        """This rank and the action it is running, for error messages and published positions."""
        position = self.position
        action = position.action
        if action is None:
            if position.in_step:
                moment = "end" if self.actions_started else "start"
                return f"{self.describe()} at the {moment} of step {position.step}"
            return f"{self.describe()} outside the schedule"
        part = action.forward_part() or action.backward_part() or (action.microbatch, action.chunk)
        stage = self.stage_of(self.pp_rank, part[1])
        return (f"{self.describe()} during {action.describe()} (microbatch {part[0]}, chunk {part[1]}, "
                f"virtual stage {stage})")

    def _on_failure(self, exc: BaseException) -> None:
        state().failed_steps += 1
        where = self.where()
        self.position.failed = True  # published as "failed": peers diagnosing a stall skip this rank
        self.on_abort()
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

