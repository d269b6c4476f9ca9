"""Waiting for asynchronous collectives inside a pipelined step, and recording the waits.

The expert all-to-alls (and any collective a schedule node launches) are waited on through
:func:`wait_for`: inside a step each wait is bounded by the pipeline timeout and a failure names
the rank that failed first (the executor's waiter, from the microbatch context), and the timeline
shows each transfer from launch to completion (``a2a``) next to the time compute waited (``a2a_wait``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

from lightning_pp.runtime import context
from lightning_pp.runtime.timeline import SpanKind


class LaunchedWork:
    """An async collective and when it was launched (on the step's timeline clock), so the
    timeline can show each all-to-all from launch to completion (``a2a``) next to the time
    compute waited for it (``a2a_wait``).

    ``on_cpu``: the collective runs on a CPU backend (gloo), whose transfers progress on the
    process group's worker thread. With every core busy computing, that thread would wait for a
    scheduler tick before it picks the work up; yielding once right after the launch lets it
    start the transfer at once (on a 2-core machine this halves the wait at the far end). CUDA
    collectives progress on the device and need no help."""

    def __init__(self, work: Any, launched: Optional[float], delay: float = 0.0, on_cpu: bool = False) -> None:
        self.work = work
        self.launched = launched
        # An emulated slower link (benchmarks): complete no earlier than ``delay`` seconds after
        # launch; the wait sleeps, burning no CPU.
        self.ready_at = time.perf_counter() + delay if delay > 0 else 0.0
        # A gloo wait blocks the host anyway, so it may as well be bounded by the pipeline
        # timeout; a CUDA wait only orders streams, and bounding it would block the host (the
        # process group's own watchdog bounds it instead).
        self.host_blocking = on_cpu
        if on_cpu and work is not None:
            os.sched_yield()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self.work is not None:
            self.work.wait(*args, **kwargs)
        remaining = self.ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return True


def wait_for(works: Sequence[Any], timeline=None, microbatch: int = -1, chunk: int = -1) -> None:
    """Wait for ``works``, recording the wait (``a2a_wait``) and each launched transfer's span
    (``a2a``: from launch until it was seen complete) on ``timeline``. Inside a pipelined step
    each wait is bounded by the pipeline timeout, and a failed one names the rank that failed
    first (the executor's waiter, from the microbatch context)."""
    waiter = context.current().wait
    what = f"the expert all-to-all of microbatch {microbatch} (chunk {chunk})"
    recording = timeline is not None and timeline.enabled
    start = timeline.now() if recording else 0.0
    for work in works:
        before = timeline.now() if recording else 0.0
        if waiter is not None and getattr(work, "host_blocking", True):
            waiter(work, what)
        else:
            work.wait()
        if recording:
            after = timeline.now()
            launched = getattr(work, "launched", None)
            if launched is not None:
                # Already complete when the wait began: it finished at the latest then.
                timeline.add(SpanKind.A2A, microbatch, chunk, launched, after if after - before > 1e-5 else before)
    if recording:
        timeline.add(SpanKind.A2A_WAIT, microbatch, chunk, start, timeline.now())


class BoundedWait:
    """The one bounded wait of a step, shared by the stage-boundary transfers, the in-step
    collectives and the schedule nodes: waits for a work handle for at most ``timeout``, publishes
    what it waits for (``position.waiting``, read by the watchdog), and turns a failure or the
    timeout into a :class:`~lightning_pp.runtime.failure.PipelineCommError` that says what was
    waited for, on which rank, with which peer."""

    def __init__(self, timeout, describe, position=None) -> None:
        self.timeout = timeout
        self.describe = describe  # () -> "rank 1 (pp=1, dp=0, ep=0)"
        self.position = position

    def __call__(self, work: Any, what: str, peer: Optional[int] = None, with_peer: str = "") -> None:
        """Wait for ``work`` (``what``: the message part; ``peer``: the global rank on the other end,
        ``with_peer``: how the message names it)."""
        from lightning_pp.runtime.failure.errors import PipelineCommError, classify

        position = self.position
        if position is not None:
            position.waiting = (peer, what)
        seconds = self.timeout.total_seconds()
        try:
            ok = work.wait(timeout=self.timeout)
        except Exception as exc:  # the backend raises on a timeout and on a peer that went away
            reason = classify(exc)
            detail = f"timed out after {seconds:g}s" if reason == "timeout" else f"failed: {exc}"
            raise PipelineCommError(f"{self.describe()}: {what}{with_peer} {detail}", peer=peer, reason=reason) from exc
        finally:
            if position is not None:
                position.waiting = None
        if ok is False:
            raise PipelineCommError(f"{self.describe()}: {what}{with_peer} timed out after {seconds:g}s.",
                                    peer=peer, reason="timeout")
