"""The failure board: a first-writer-wins failure record and every rank's published position, in
the job's key-value store (the ``TCPStore`` every ``torch.distributed`` job already has).

* A rank whose step fails writes one line describing itself (rank, pp/dp/ep coordinates, action,
  microbatch, virtual stage, the error) before it raises; the first writer wins. Peers then fail
  in their own communication (a closed connection or a timeout) and read the line, so every
  rank's error names the rank that failed first, not its neighbour.
* A rank that is SIGKILLed, or stuck, writes nothing; so every rank's watchdog
  (:mod:`lightning_pp.runtime.failure.watchdog`) publishes where the rank is, read from the rank's
  :class:`Position`, and :class:`~lightning_pp.runtime.failure.diagnosis.Diagnosis` reads the positions
  to name the rank to blame.

Nothing here adds a collective to the step.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import torch.distributed as dist

FAILURE_KEY = "lightning_pp/failure"
POSITION_KEY = "lightning_pp/position/{rank}"

STORE_GONE = (
    "the job's key-value store is unreachable. It lives in rank 0's process (or torchrun's agent), so rank 0 "
    "(pp=0) has most likely died, e.g. killed by a signal or the out-of-memory killer; no rank could record "
    "which action it was running."
)


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
