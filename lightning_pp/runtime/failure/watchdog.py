"""The per-process watchdog thread: publishes this rank's position, polls the failure board, and
ends a rank that stays blocked after another rank failed.

* **Published positions.** A rank that is SIGKILLed, or stuck, writes nothing to the failure
  board (:mod:`lightning_pp.runtime.failure.board`). So the watchdog thread publishes where the rank is
  (in a step or not, which action, and whether it is blocked waiting for a peer or in a
  collective) whenever that changes, at most every ``position_interval`` seconds, plus a heartbeat
  every ``heartbeat_interval``. The main thread only stores plain attributes
  (:class:`~lightning_pp.runtime.failure.board.Position`); all I/O happens on the watchdog thread.
* **The last resort.** A gloo wait cannot be interrupted from another thread (process group
  ``abort``/``shutdown`` leave a blocked receive blocked), and a rank stuck in computation never
  reaches a wait at all. So once a failure is on the board, a rank whose main thread has not
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
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional

from lightning_pp.runtime.failure.board import STORE_GONE, FailureBoard
from lightning_pp.runtime.process import state

WATCHDOG_EXIT_CODE = 70  # EX_SOFTWARE: the watchdog ended a rank that could not raise


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
        self._generation = 0  # bumped by forget(): a board read from before it is stale
        self._executors: "weakref.WeakSet" = weakref.WeakSet()
        self._active: Optional[weakref.ref] = None
        self._stop = threading.Event()
        # Published before the thread's first beat: rank 0 leaving at exit waits for every rank that
        # has a position, and a rank without one yet (its first beat is position_interval away, longer
        # than a toy step) would be taken for one that never joined: the store gone under it.
        self._publish("idle")
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

    def forget(self) -> None:
        """A new run starts in this process after the board was cleared (a sweep's next trial after a
        failed one): drop the failure seen and what was acknowledged."""
        self._generation += 1
        self.failure = None
        self._acknowledged.clear()

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
        self._publish("left")

    def _publish(self, state: str) -> None:
        now = time.time()
        self.board.publish(self.rank, {"where": f"rank {self.rank}", "state": state, "beat": now, "since": now,
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
        generation = self._generation
        failure = self.board.read()
        if generation != self._generation:
            return  # forget() ran meanwhile: this read may be from before the board was cleared
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
            self._publish("left")  # the store's host need not wait for this rank's heartbeat to stop
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


def watchdog_for(board: FailureBoard, rank: int, world_size: int, config: WatchdogConfig) -> Optional[Watchdog]:
    """This process's watchdog for ``board``'s store (started on first use; restarted if it stopped
    or the job's store changed, e.g. after a new ``init_process_group``). ``None`` when disabled
    or without a store."""
    if not config.enabled or board.store is None:
        return None
    process = state()
    with process.watchdog_lock:
        current = process.watchdog
        if current is not None and current.running and current.board.store is board.store and current.rank == rank:
            current.config = config
            return current
        if current is not None:
            current.leave()
        process.watchdog = Watchdog(board, rank, world_size, config)
        return process.watchdog


def process_watchdog() -> Optional[Watchdog]:
    """This process's watchdog, running or stopped (what it last saw stays readable), or ``None``."""
    return state().watchdog


def current_watchdog() -> Optional[Watchdog]:
    """This process's watchdog, if it is running."""
    watchdog = state().watchdog
    return watchdog if watchdog is not None and watchdog.running else None
