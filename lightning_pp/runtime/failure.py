"""Making one rank's failure every rank's clear error.

The failing rank writes a description of itself (rank, pp/dp/ep coordinates, action,
microbatch, the error) to the job's key-value store before it raises. Peers blocked on it then
fail in their own communication (a closed connection or a timeout) and look the description up,
so every rank's error names the rank that actually failed, not just its neighbour.
"""

from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

FAILURE_KEY = "lightning_pp/failure"


class FailureBoard:
    """First-writer-wins failure record in the default process group's store."""

    def __init__(self, store=None) -> None:
        if store is None and dist.is_available() and dist.is_initialized():
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:  # a process group without a store (rare): degrade to local errors
                store = None
        self.store = store

    def report(self, message: str) -> None:
        if self.store is None:
            return
        try:
            self.store.compare_set(FAILURE_KEY, "", message)
        except Exception:
            pass  # the store's host may be the rank that died; the local error still stands

    def read(self, wait_seconds: float = 0.0) -> Optional[str]:
        """The recorded failure, polling up to ``wait_seconds`` for it to appear."""
        if self.store is None:
            return None
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                if self.store.check([FAILURE_KEY]):
                    return self.store.get(FAILURE_KEY).decode()
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def clear(self) -> None:
        if self.store is not None:
            try:
                self.store.delete_key(FAILURE_KEY)
            except Exception:
                pass


class PipelineError(RuntimeError):
    """A pipelined step failed; the message names the rank that failed first."""


def add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
