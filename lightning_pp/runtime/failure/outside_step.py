"""Failures outside the pipeline step: making an exception that ends a rank's run name the rank
that failed first.

A rank can fail where no executor guards it: a user hook between steps, the data pipeline, a
collective of the framework. Its peers then fail in their own communication (a closed
connection) with nothing on the failure board, or with a raw backend error. The strategies call
:func:`explain_exception` on the rank whose run an exception is ending (Lightning's
``on_exception``, or the ``sys.excepthook`` :func:`install_excepthook` installs for Fabric): the
rank that raised records itself, a rank whose communication failed looks the origin up, and each
exception gets a note naming the rank that failed first.

Also here, because the executor and the strategies both need them: :func:`is_comm_error` (is this
a failed or timed-out communication?), :func:`reported_by_executor` (did this come out of a
pipeline step?), :func:`locate` and :func:`summarize` (an exception's place and text, in words).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import torch.distributed as dist

from lightning_pp.runtime.failure.board import FAILURE_KEY, STORE_GONE, FailureBoard
from lightning_pp.runtime.failure.diagnosis import Diagnosis
from lightning_pp.runtime.failure.errors import NonFiniteError, PipelineCommError, PipelineError, add_note, classify
from lightning_pp.runtime.failure.watchdog import Watchdog, current_watchdog
from lightning_pp.runtime.process import state

EXECUTOR_NOTE = "lightning_pp: the pipeline step failed on "  # the note PipelineExecutor adds


# What a backend's RuntimeError says when a peer went away or a transfer timed out.
_COMM_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe")


def _chain(exc: Optional[BaseException]):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a failed or timed-out communication:
    a :class:`PipelineCommError`, a ``torch.distributed`` error, or a backend's (gloo, NCCL) error."""
    dist_error = getattr(dist, "DistError", None)
    for item in _chain(exc):
        if isinstance(item, PipelineCommError) or (dist_error is not None and isinstance(item, dist_error)):
            return True
        if isinstance(item, RuntimeError) and any(m in str(item).lower() for m in _COMM_MARKERS):
            return True
    return False


# The function that runs a pipeline step: its frame is on the traceback of every exception a
# step raised. Looked up by name (and only in modules already imported) so that this module does
# not import the executor, which imports it.
_STEP_RUNNERS = (
    ("lightning_pp.runtime.failure.guard", "StepGuard", "run"),
    ("lightning_pp.runtime.step.executor", "PipelineExecutor", "_guarded"),  # before StepGuard existed
)


def _step_codes() -> set:
    codes = set()
    for module_name, class_name, method in _STEP_RUNNERS:
        module = sys.modules.get(module_name)
        runner = getattr(getattr(module, class_name, None), method, None)
        code = getattr(runner, "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


def reported_by_executor(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a pipeline step, whose executor has already recorded it on the
    board (or, for a peer's failure, looked it up)."""
    if isinstance(exc, (PipelineError, NonFiniteError)):
        return True
    codes = _step_codes()
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return any(str(note).startswith(EXECUTOR_NOTE) for note in getattr(exc, "__notes__", ()))


def _frame_location(frame, lineno: int) -> str:
    return f"{frame.f_code.co_name} at {os.path.basename(frame.f_code.co_filename)}:{lineno}"


def locate(exc: BaseException, label_frame: Optional[Callable] = None) -> Optional[str]:
    """Where ``exc`` was raised, in words: the innermost frame ``label_frame(frame)`` names (a
    strategy names its framework's hooks), else "loading a batch (DataLoader)" for the data
    pipeline, else the innermost frame's function, file and line. ``None`` without a traceback."""
    label, innermost = None, None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        named = label_frame(frame) if label_frame is not None else None
        if named is None and f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}" in frame.f_code.co_filename:
            named = "loading a batch (DataLoader)"
        if named is not None:
            label = named
        innermost = (frame, tb.tb_lineno)
        tb = tb.tb_next
    if label is not None:
        return label
    return _frame_location(*innermost) if innermost is not None else None


def summarize(exc: BaseException, limit: int = 2000) -> str:
    """``Type: message`` of ``exc`` in a few lines. An error re-raised from a DataLoader worker
    carries the worker's whole traceback: keep its first line and the original error."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    if "Original Traceback" in text and len(lines) > 2:
        text = f"{lines[0]} {lines[-1].strip()}"
    if len(text) > limit:
        text = text[:limit] + " ..."
    return f"{type(exc).__name__}: {text}"


def _names(origin: str, me: str) -> bool:
    return origin.startswith(me + " ") or origin == me


def explain_exception(exc: BaseException, board: FailureBoard, me: str, where: Optional[str] = None,
                      diagnosis: Optional[Diagnosis] = None, watchdog: Optional[Watchdog] = None,
                      wait_seconds: float = 2.0) -> Optional[str]:
    """Make the failure board and ``exc`` name the rank that failed first, on a rank whose run ``exc``
    is ending. ``me`` describes this rank (``rank 1 (pp=1, dp=0, ep=0)``), ``where`` the place outside
    the step ``exc`` was raised in (see :func:`locate`). Returns the failure on the board.

    * A pipeline failure (:class:`PipelineError`, :class:`NonFiniteError`, or an exception the
      executor recorded) already names its origin: nothing is added.
    * A communication error (a peer went away, or stopped answering): the origin is looked up on the
      board, waiting up to ``wait_seconds`` for it; if there is none, ``diagnosis`` names the rank
      that went away or stalled, and that goes on the board. ``exc`` gets the note
      ``lightning_pp: caused by a failure on another rank: <origin>  -> seen by <me> ...``; a note
      by which the executor blamed this rank for the peer's failure is removed.
    * Any other exception is this rank's own failure outside the step: the board gets
      ``<me> failed outside the pipeline step (in <where>): <Type>: <message>`` (first writer wins)
      and ``exc`` a note saying so.

    The watchdog is told that this rank is raising for the failure, so it never ends the process
    for it. Store errors are swallowed (the store's host may be the rank that died).
    """
    watchdog = watchdog if watchdog is not None else current_watchdog()
    if isinstance(exc, (PipelineError, NonFiniteError)):
        origin = board.read()
    elif is_comm_error(exc):
        origin = _comm_origin(exc, board, me, diagnosis, wait_seconds)
    elif reported_by_executor(exc):
        origin = board.read()
    else:
        place = where or "between steps"
        message = f"{me} failed outside the pipeline step (in {place}): {summarize(exc)}"
        board.report(message)
        origin = board.read() or (None if board.unreachable else message)
        if origin is None:
            add_note(exc, f"lightning_pp: {me} failed outside the pipeline step (in {place}); the job's "
                          f"key-value store is unreachable ({board.unreachable}), so the other ranks could "
                          f"not be told.")
        elif origin == message:
            add_note(exc, f"lightning_pp: {me} failed outside the pipeline step (in {place}); "
                          f"the other ranks' errors name it.")
        else:
            add_note(exc, f"lightning_pp: {me} failed outside the pipeline step (in {place}), after "
                          f"another failure was recorded: {origin}")
    if watchdog is not None:
        watchdog.acknowledge(origin)
    return origin


def _comm_origin(exc: BaseException, board: FailureBoard, me: str, diagnosis: Optional[Diagnosis],
                 wait_seconds: float) -> Optional[str]:
    origin = board.read(wait_seconds=wait_seconds)
    first_line = summarize(exc).splitlines()[0]
    own_record = origin is not None and _names(origin, me) and first_line in origin
    if (origin is None or own_record) and not board.unreachable and diagnosis is not None:
        # Nobody recorded a failure, or only this rank did, blaming itself for a broken connection
        # (a backend error raised where the executor does not expect one): name the rank that
        # went away or stalled instead.
        reason = "timeout" if classify(exc) == "timeout" else "closed"
        explained = diagnosis.explain(PipelineCommError(first_line, peer=None, reason=reason))
        if origin is None:
            board.report(explained)
        elif not _names(explained, me):
            board._call(lambda: board.store.compare_set(FAILURE_KEY, origin, explained))
        origin = board.read() or explained
    if origin is None and board.unreachable:
        origin = f"{STORE_GONE} ({board.unreachable})"
    if origin is None:
        return None
    if _names(origin, me):
        if not any(origin in str(note) for note in getattr(exc, "__notes__", ())):
            add_note(exc, f"lightning_pp: the failure board names this rank: {origin}")
        return origin
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):  # the executor's note blamed this rank for a peer's failure
        notes[:] = [n for n in notes if not str(n).startswith(EXECUTOR_NOTE + me)]
    add_note(exc, f"lightning_pp: caused by a failure on another rank: {origin}\n"
                  f"  -> seen by {me}: its communication with that rank failed ({first_line})")
    return origin


def install_excepthook(context: Callable[[], Optional[tuple]]) -> None:
    """Make ``sys.excepthook`` call :func:`explain_exception` for an uncaught exception, then the
    previous hook (which prints it, with the notes). Installed once per process; a later call only
    replaces ``context``: a function returning ``(board, me, diagnosis, label_frame)`` for the
    current pipeline, or ``None`` when there is none. For runs without an ``on_exception`` hook
    (Fabric, plain loops). It sees only exceptions that end the program: one the user catches is
    the user's to report, and one raised in a process started by ``multiprocessing`` is printed by
    ``multiprocessing`` without calling the hook."""
    process = state()
    process.excepthook_context = context
    if process.excepthook_installed:
        return
    process.excepthook_installed = True
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        try:
            asked = state().excepthook_context
            found = asked() if asked is not None else None
            if found is not None and isinstance(exc, BaseException):
                board, me, diagnosis, label_frame = found
                explain_exception(exc, board, me, where=locate(exc, label_frame), diagnosis=diagnosis)
        except Exception:  # noqa: BLE001 - the hook must never hide the user's exception
            pass
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
