"""Making one rank's failure every rank's clear error, in bounded time.

Three mechanisms, all through the job's key-value store (the ``TCPStore`` every
``torch.distributed`` job already has), none adding a collective to the step:

* **The failure board.** A rank whose step fails writes one line describing itself (rank,
  pp/dp/ep coordinates, action, microbatch, virtual stage, the error) before it raises; the first
  writer wins. Peers then fail in their own communication (a closed connection or a timeout) and
  read the line, so every rank's error names the rank that failed first, not its neighbour.
* **Published positions.** A rank that is SIGKILLed, or stuck, writes nothing. So every rank's
  watchdog thread publishes where the rank is (in a step or not, which action, and whether it is
  blocked waiting for a peer or in a collective) whenever that changes, at most every
  ``position_interval`` seconds, plus a heartbeat every ``heartbeat_interval``. The main thread only
  stores plain attributes (:class:`Position`); all I/O happens on the watchdog thread. A rank whose
  connection to a peer closed without a board entry names that peer and its last published action;
  a rank whose wait timed out follows the "waiting for" chain of published positions to the rank
  that is not waiting (computing for too long, outside the step, or silent) and names that one.
* **The watchdog's last resort.** A gloo wait cannot be interrupted from another thread (process
  group ``abort``/``shutdown`` leave a blocked receive blocked), and a rank stuck in computation
  never reaches a wait at all. So once a failure is on the board, a rank whose main thread has not
  raised within ``exit_grace`` seconds is ended by its watchdog with ``os._exit`` (exit code
  :data:`WATCHDOG_EXIT_CODE`), after printing the failure and the stacks of its threads to stderr.
  A rank that did raise is never ended this way: its exception is the user's to handle.

One watchdog thread serves a whole process (a process has one main thread, and a test or a
notebook may build several pipelines in it); executors register with it and the most recently
active one is the position it publishes. When the last executor is closed, or at interpreter exit,
the thread stops and the rank marks itself as left. Rank 0, which serves the store under
Lightning's launchers and ``init_process_group``, then waits (bounded) until every other rank has
left or fallen silent, so a failure it recorded before exiting stays readable to them. When rank 0
itself dies, the store goes with it: peers then say so, naming rank 0 as the likely cause.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

FAILURE_KEY = "lightning_pp/failure"
POSITION_KEY = "lightning_pp/position/{rank}"
WATCHDOG_EXIT_CODE = 70  # EX_SOFTWARE: the watchdog ended a rank that could not raise


class PipelineError(RuntimeError):
    """A pipelined step failed; the message names the rank that failed first."""


class PipelineCommError(RuntimeError):
    """A stage-boundary transfer or an in-step collective failed or timed out.

    ``peer`` is the global rank on the other end (``None`` for a collective); ``reason`` is
    ``"timeout"``, ``"closed"`` (the connection went away: the peer's process ended) or ``"error"``.
    """

    def __init__(self, message: str, peer: Optional[int] = None, reason: str = "error") -> None:
        super().__init__(message)
        self.peer = peer
        self.reason = reason


class BatchMismatchError(ValueError):
    """The stages of one pipeline were given different batches (``check_batches="raise"``).
    Raised on every rank at the same step (the comparison rides on the step's loss all-reduce)."""


class NonFiniteError(FloatingPointError):
    """The loss or the gradients of a step were not finite, and ``nonfinite="raise"``. Raised on
    every rank at the same step (the decision is collective)."""


def classify(exc: BaseException) -> str:
    """``"timeout"`` or ``"closed"`` from a backend's exception text."""
    text = str(exc).lower()
    return "timeout" if "timed out" in text or "timeout" in text else "closed"


def add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


@dataclass(frozen=True)
class WatchdogConfig:
    """Settings of the per-process watchdog thread.

    Args:
        enabled: run the thread (positions, heartbeats, failure polling and the last-resort exit).
            Without it a killed or stuck rank is named only as "the peer on the other end".
        heartbeat_interval: seconds between heartbeats and between polls of the failure board.
        position_interval: a changed position is published at most this often (seconds).
        exit_grace: once a failure is on the board, how long this rank's main thread may stay
            blocked (or stuck) before the watchdog ends the process.
        exception_grace: how long a rank whose main thread is handling an exception of its own
            (unwinding through ``except``/``finally`` blocks: Lightning's ``on_exception`` hooks and
            teardown, a user's ``except`` block) is left alone after ``exit_grace`` has passed. Such a
            rank is about to raise; it is ended only if its handler itself stays blocked this long.
    """

    enabled: bool = True
    heartbeat_interval: float = 1.0
    position_interval: float = 0.1
    exit_grace: float = 10.0
    exception_grace: float = 60.0

    @property
    def silence_limit(self) -> float:
        """A rank whose last heartbeat is older than this is considered frozen or gone."""
        return 3 * self.heartbeat_interval + 2.0


def _default_store():
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # a process group without a store (rare): degrade to local errors
            return None
    return None


class FailureBoard:
    """First-writer-wins failure record and per-rank positions in the job's store.

    Every method swallows store errors (the store's host may be the rank that died) and reports
    them through :attr:`unreachable`.
    """

    def __init__(self, store=None) -> None:
        self.store = store if store is not None else _default_store()
        self.unreachable: Optional[str] = None  # the last store error, if the store went away

    def _call(self, fn, default=None):
        if self.store is None or self.unreachable:
            return default  # once the store is gone, stay quiet (each failed call logs a C++ trace)
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any store failure means "unknown"
            self.unreachable = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return default

    def report(self, message: str) -> None:
        self._call(lambda: self.store.compare_set(FAILURE_KEY, "", message))

    def read(self, wait_seconds: float = 0.0) -> Optional[str]:
        """The recorded failure, polling up to ``wait_seconds`` for it to appear."""
        deadline = time.monotonic() + wait_seconds
        while True:
            if self._call(lambda: self.store.check([FAILURE_KEY]), False):
                value = self._call(lambda: self.store.get(FAILURE_KEY).decode())
                if value:
                    return value
            if time.monotonic() >= deadline or self.store is None or self.unreachable:
                return None
            time.sleep(0.05)

    def clear(self) -> None:
        self._call(lambda: self.store.delete_key(FAILURE_KEY))

    def publish(self, rank: int, position: dict) -> None:
        self._call(lambda: self.store.set(POSITION_KEY.format(rank=rank), json.dumps(position)))

    def position(self, rank: int) -> Optional[dict]:
        key = POSITION_KEY.format(rank=rank)
        if not self._call(lambda: self.store.check([key]), False):
            return None
        raw = self._call(lambda: self.store.get(key))
        return json.loads(raw) if raw else None


class Position:
    """Where this rank's pipeline is. The main thread writes these plain attributes (no lock, no
    I/O: a few attribute stores per action); the watchdog thread reads them."""

    __slots__ = ("step", "in_step", "action", "waiting", "failed")

    def __init__(self) -> None:
        self.step = 0
        self.in_step = False
        self.action = None  # the schedule Action being run, or None
        self.waiting: Optional[tuple[Optional[int], str]] = None  # (peer global rank or None, what)
        self.failed = False  # the step is failing: this rank is reporting, not computing

    def snapshot(self) -> tuple:
        return self.step, self.in_step, self.action, self.waiting, self.failed


STORE_GONE = (
    "the job's key-value store is unreachable. It lives in rank 0's process (or torchrun's agent), so rank 0 "
    "(pp=0) has most likely died, e.g. killed by a signal or the out-of-memory killer; no rank could record "
    "which action it was running."
)


class Watchdog:
    """The per-process thread described in the module docstring. Get it with :func:`watchdog_for`."""

    def __init__(self, board: FailureBoard, rank: int, world_size: int, config: WatchdogConfig) -> None:
        self.board = board
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.failure: Optional[str] = None  # what the thread last saw on the board
        self._failure_seen_at = 0.0
        self._handling_since: Optional[float] = None  # when the main thread was first seen unwinding
        self._acknowledged: set[str] = set()
        self._executors: "weakref.WeakSet" = weakref.WeakSet()
        self._active: Optional[weakref.ref] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_pp-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    @property
    def running(self) -> bool:
        return not self._stop.is_set()

    # -- called by executors (main thread) ------------------------------------------------------
    def watch(self, executor) -> None:
        self._executors.add(executor)
        self._active = weakref.ref(executor)

    def activate(self, executor_ref: weakref.ref) -> None:
        self._active = executor_ref

    def release(self, executor) -> None:
        """``executor`` is closed; with none left the thread stops and tells the store this rank left."""
        self._executors.discard(executor)
        if not len(self._executors):
            self.leave()

    def acknowledge(self, failure: Optional[str]) -> None:
        """The main thread has raised for ``failure``: the watchdog will not end this process for it."""
        if failure is not None:
            self._acknowledged.add(failure)
        if self.board.unreachable:
            self._acknowledged.add(STORE_GONE)

    def known_failure(self) -> Optional[str]:
        """The failure on the board, if the thread has seen one (re-read, so a board cleared since
        is not reported)."""
        if self.failure is None:
            return None
        current = self.board.read()
        return STORE_GONE if current is None and self.board.unreachable else current

    def leave(self) -> None:
        """Stop the thread (waiting for a store call in flight) and mark this rank as gone."""
        if self._stop.is_set():
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        self._publish_left()

    def _publish_left(self) -> None:
        now = time.time()
        self.board.publish(self.rank, {"where": f"rank {self.rank}", "state": "left", "beat": now, "since": now,
                                       "step": -1, "peer": None, "what": None})

    def _at_exit(self) -> None:
        # A daemon thread caught by interpreter shutdown inside a C++ store call aborts the process:
        # stop it first. The rank that hosts the store then waits (bounded) for the others to leave,
        # so a failure it recorded stays readable while they are still looking it up.
        self.leave()
        if self.rank == 0 and _hosts_store(self.board.store):
            # Past the others' own exit deadline, so a stuck rank's watchdog still reads the board.
            deadline = time.monotonic() + self.config.exit_grace + 2 * self.config.heartbeat_interval + 1.0
            waiting = set(range(1, self.world_size))
            while waiting and time.monotonic() < deadline and not self.board.unreachable:
                for rank in list(waiting):
                    beat = self.board.position(rank)
                    silent = beat is not None and time.time() - float(beat.get("beat", 0)) > self.config.silence_limit
                    if beat is None or beat.get("state") == "left" or silent:
                        waiting.discard(rank)
                if waiting:
                    time.sleep(0.1)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        last_published, last_beat, last_poll = None, 0.0, 0.0
        since = time.time()
        while not self._stop.wait(self.config.position_interval):
            now = time.time()
            executor = self._active() if self._active is not None else None
            if executor is not None:
                snapshot = executor.position.snapshot()
                if snapshot != last_published:
                    since = now
                if snapshot != last_published or now - last_beat >= self.config.heartbeat_interval:
                    self.board.publish(self.rank, self._describe(executor, since, now))
                    last_published, last_beat = snapshot, now
            if now - last_poll >= self.config.heartbeat_interval:
                last_poll = now
                self._poll_board(now, executor)

    def _describe(self, executor, since: float, now: float) -> dict:
        position = executor.position
        waiting = position.waiting
        if position.failed:
            state = "failed"
        elif not position.in_step:
            state = "idle"
        elif waiting is not None:
            state = "wait"
        else:
            state = "compute"
        return {
            "where": executor.where(),
            "state": state,
            "peer": waiting[0] if waiting else None,
            "what": waiting[1] if waiting else None,
            "step": position.step,
            "since": since,
            "beat": now,
            "pid": os.getpid(),
        }

    def _poll_board(self, now: float, executor) -> None:
        failure = self.board.read()
        if failure is None and self.board.unreachable:
            if self.failure is not None:
                failure = self.failure  # keep counting down on the failure already seen
            elif executor is not None and executor.position.in_step:
                failure = STORE_GONE  # the store's host died in the middle of a step
            else:
                self._stop.set()  # the store's host has gone between steps: the job is over
                return
        if failure is None:
            self.failure = None
            return
        if failure != self.failure:
            self.failure, self._failure_seen_at = failure, now
        if failure in self._acknowledged or not len(self._executors):
            return
        if now - self._failure_seen_at >= self.config.exit_grace and not self._handling_own_exception(now):
            self._exit(failure, executor)

    def _handling_own_exception(self, now: float) -> bool:
        """Whether the main thread is unwinding an exception of its own (and has not been doing so
        for longer than ``exception_grace``): it is about to raise, its exception is the user's."""
        if main_thread_exception() is None:
            self._handling_since = None
            return False
        if self._handling_since is None:
            self._handling_since = now
        return now - self._handling_since < self.config.exception_grace

    def _exit(self, failure: str, executor) -> None:
        where = executor.where() if executor is not None else f"rank {self.rank}"
        try:
            sys.stderr.write(
                f"lightning_pp watchdog: {failure}\n  -> {where} has not stopped {self.config.exit_grace:g}s "
                f"after this failure was recorded: it is blocked in communication or stuck in computation, "
                f"which Python cannot interrupt. Ending the process (exit code {WATCHDOG_EXIT_CODE}). "
                f"Its threads' stacks follow.\n"
            )
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self._publish_left()  # the store's host need not wait for this rank's heartbeat to stop
        finally:
            os._exit(WATCHDOG_EXIT_CODE)


def _hosts_store(store) -> bool:
    """Whether this process (rank 0) serves the job's TCPStore, as under Lightning's launchers and
    ``init_process_group`` with ``env://`` (torchrun's agent serves it itself)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return False
    try:
        inner = store._underlying_non_prefix_store if hasattr(store, "_underlying_non_prefix_store") else store
    except Exception:
        return False
    return type(inner).__name__ == "TCPStore"


_process_watchdog: Optional[Watchdog] = None
_process_watchdog_lock = threading.Lock()


def watchdog_for(board: FailureBoard, rank: int, world_size: int, config: WatchdogConfig) -> Optional[Watchdog]:
    """This process's watchdog for ``board``'s store (started on first use; restarted if it stopped
    or the job's store changed, e.g. after a new ``init_process_group``). ``None`` when disabled
    or without a store."""
    global _process_watchdog
    if not config.enabled or board.store is None:
        return None
    with _process_watchdog_lock:
        current = _process_watchdog
        if current is not None and current.running and current.board.store is board.store and current.rank == rank:
            current.config = config
            return current
        if current is not None:
            current.leave()
        _process_watchdog = Watchdog(board, rank, world_size, config)
        return _process_watchdog


class Diagnosis:
    """Names the rank to blame when a wait failed and nobody has reported a failure yet."""

    def __init__(self, board: FailureBoard, world_size: int, describe: Callable[[int], str],
                 config: WatchdogConfig, timeout_seconds: float) -> None:
        self.board = board
        self.world_size = world_size
        self.describe = describe
        self.config = config
        self.timeout_seconds = timeout_seconds

    def explain(self, exc: PipelineCommError) -> str:
        if exc.reason == "closed" and exc.peer is not None:
            return self._went_away(exc.peer)
        if exc.reason == "closed":
            # A collective lost a member; which one is unknown. Its heartbeat stops: wait for that.
            deadline = time.monotonic() + self.config.silence_limit + 1.0
            while time.monotonic() < deadline and not self.board.unreachable:
                origin = self.board.read()
                if origin is not None:
                    return origin
                for rank in range(self.world_size):
                    beat = self.board.position(rank)
                    if beat is not None and (beat.get("state") == "left"
                                             or self._silent_for(beat) > self.config.silence_limit):
                        return self._went_away(rank)
                time.sleep(self.config.heartbeat_interval / 2)
            if self.board.unreachable:
                return self._store_gone(None)
            return "a member of a collective went away (which one is unknown: no rank stopped its heartbeat)"
        return self._stalled(exc.peer)

    # -- the cases ----------------------------------------------------------------------------
    def _store_gone(self, peer: Optional[int]) -> str:
        text = f"{STORE_GONE} ({self.board.unreachable})"
        if peer is not None and peer != 0:
            text += f" The peer this rank was waiting for, {self.describe(peer)}, went away too."
        return text

    def _went_away(self, peer: int) -> str:
        beat = self.board.position(peer)
        if self.board.unreachable:
            return self._store_gone(peer)
        if beat is None:
            where = f"{self.describe(peer)} (position never published)"
        elif beat["state"] == "left":
            where = self.describe(peer)  # its last position only says that it left
        else:
            where = beat["where"] + ("" if beat["state"] != "wait" else f" while waiting ({beat['what']})")
        return (
            f"{where} went away without reporting an error: its process was killed (e.g. SIGKILL or the "
            f"out-of-memory killer) or exited outside the pipeline step"
        )

    def _silent_for(self, beat: dict) -> float:
        return time.time() - float(beat.get("beat", 0.0))

    def _stalled(self, start: Optional[int]) -> str:
        """Follow the published "waiting for" chain from ``start`` (``None``: a collective, so any
        rank may be the one) to a rank that is not waiting, and describe why it is to blame."""
        visited: list[int] = []
        rank = start
        while rank is not None:
            if rank in visited:
                chain = " -> ".join(str(r) for r in visited + [rank])
                return (
                    f"the pipeline is deadlocked: every rank is waiting for another (global ranks {chain}); "
                    f"{self.describe(visited[0])} timed out first. This is a bug: please report it with the "
                    f"schedule and sizes."
                )
            visited.append(rank)
            beat = self.board.position(rank)
            if self.board.unreachable:
                return self._store_gone(rank)
            verdict = self._verdict(rank, beat)
            if verdict is not None:
                return verdict
            if beat is None or beat["state"] != "wait":
                break  # busy only briefly, or failing itself: look for the rank that is really stuck
            rank = beat["peer"]
        return self._stalled_anywhere(visited, start)

    def _stalled_anywhere(self, visited: list[int], start: Optional[int]) -> str:
        unpublished = []
        for rank in range(self.world_size):
            if rank in visited:
                continue
            beat = self.board.position(rank)
            if self.board.unreachable:
                return self._store_gone(None)
            if beat is None:
                unpublished.append(rank)
                continue
            verdict = self._verdict(rank, beat)
            if verdict is not None:
                return verdict
        if unpublished:
            return (f"{self.describe(unpublished[0])} never published its position: it has not built its "
                    f"pipeline (pipeline_timeout={self.timeout_seconds:g}s)")
        who = "a collective" if start is None else self.describe(start)
        return (f"{who} did not complete within pipeline_timeout={self.timeout_seconds:g}s, and no rank looks "
                f"stuck (all are waiting or only briefly busy): cause unknown")

    def _verdict(self, rank: int, beat: Optional[dict]) -> Optional[str]:
        """Why ``rank`` is to blame, or ``None`` if it is not (it is waiting for someone, failing
        itself, or has been busy for less than half the timeout, i.e. it is progressing)."""
        limit = f"pipeline_timeout={self.timeout_seconds:g}s"
        if beat is None:
            return None
        if beat["state"] == "left":
            return f"{beat['where']} has left the pipeline (closed it or exited) ({limit})"
        silent = self._silent_for(beat)
        if silent > self.config.silence_limit:
            return (
                f"{beat['where']} has been silent for {silent:.1f}s (no heartbeat): its process is frozen "
                f"or its host unreachable ({limit})"
            )
        for_seconds = time.time() - float(beat["since"])
        if for_seconds < self.timeout_seconds / 2:
            return None
        if beat["state"] == "compute":
            return (
                f"{beat['where']} is stuck: it has been computing for {for_seconds:.1f}s without reaching its "
                f"next transfer ({limit})"
            )
        if beat["state"] == "idle":
            return (
                f"{beat['where']} is stuck outside the pipeline step: {for_seconds:.1f}s after its step "
                f"{beat['step']} it has not started the next one (e.g. blocked in user code) ({limit})"
            )
        return None  # waiting, or failing itself


# -- failures outside the pipeline step ---------------------------------------------------------
#
# A rank can fail where no executor guards it: a user hook between steps, the data pipeline, a
# collective of the framework. Its peers then fail in their own communication (a closed
# connection) with nothing on the board, or with a raw backend error. The strategies call
# :func:`explain_exception` on the rank whose run an exception is ending (Lightning's
# ``on_exception``, or the ``sys.excepthook`` installed for Fabric): the rank that raised records
# itself, a rank whose communication failed looks the origin up, and each exception gets a note
# naming the rank that failed first.

EXECUTOR_NOTE = "lightning_pp: the pipeline step failed on "  # the note PipelineExecutor adds


def main_thread_exception() -> Optional[BaseException]:
    """The exception the main thread is handling right now (inside an ``except`` or ``finally``
    block, or a context manager's ``__exit__`` while unwinding), or ``None``."""
    main = threading.main_thread().ident
    try:
        current = sys._current_exceptions().get(main)  # Python < 3.12: an exc_info tuple
    except Exception:  # noqa: BLE001 - an implementation without it: nothing is known
        return None
    if isinstance(current, tuple):
        current = current[1]
    return current


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


def _step_codes() -> set:
    module = sys.modules.get("lightning_pp.runtime.executor")
    guarded = getattr(getattr(module, "PipelineExecutor", None), "_guarded", None)
    code = getattr(guarded, "__code__", None)
    return {code} if code is not None else set()


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


def current_watchdog() -> Optional[Watchdog]:
    """This process's watchdog, if it is running."""
    watchdog = _process_watchdog
    return watchdog if watchdog is not None and watchdog.running else None


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


_excepthook_context: Optional[Callable[[], Optional[tuple]]] = None
_excepthook_installed = False


def install_excepthook(context: Callable[[], Optional[tuple]]) -> None:
    """Make ``sys.excepthook`` call :func:`explain_exception` for an uncaught exception, then the
    previous hook (which prints it, with the notes). Installed once per process; a later call only
    replaces ``context``: a function returning ``(board, me, diagnosis, label_frame)`` for the
    current pipeline, or ``None`` when there is none. For runs without an ``on_exception`` hook
    (Fabric, plain loops). It sees only exceptions that end the program: one the user catches is
    the user's to report, and one raised in a process started by ``multiprocessing`` is printed by
    ``multiprocessing`` without calling the hook."""
    global _excepthook_context, _excepthook_installed
    _excepthook_context = context
    if _excepthook_installed:
        return
    _excepthook_installed = True
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        try:
            found = _excepthook_context() if _excepthook_context is not None else None
            if found is not None and isinstance(exc, BaseException):
                board, me, diagnosis, label_frame = found
                explain_exception(exc, board, me, where=locate(exc, label_frame), diagnosis=diagnosis)
        except Exception:  # noqa: BLE001 - the hook must never hide the user's exception
            pass
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
