"""Naming the rank to blame when a wait of this rank failed and no rank has reported a failure.

:class:`Diagnosis` reads the positions every rank's watchdog publishes on the failure board
(:mod:`lightning_pp.runtime.failure.board`). A rank whose connection to a peer closed names that peer and
its last published action; a rank whose wait timed out follows the "waiting for" chain of
published positions to the rank that is not waiting (computing for too long, outside the step, or
silent) and names that one. A chain that comes back to where it started is a deadlock, which is
reported as a bug.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from lightning_pp.runtime.failure.board import STORE_GONE, FailureBoard
from lightning_pp.runtime.failure.errors import PipelineCommError
from lightning_pp.runtime.failure.watchdog import WatchdogConfig


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
