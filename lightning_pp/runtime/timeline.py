"""Low-cost recording of what each rank spends its step on.

A ``Timeline`` collects spans ``(kind, microbatch, chunk, start, end)`` in seconds since the start of
the step; the kinds are the :class:`SpanKind` values: compute actions (``F``, ``B``, ``FB``, ``W``,
recorded with their action's kind), waits on stage-boundary receives (``recv_wait``), expert
all-to-alls from launch to known completion (``a2a``) and the waits on them (``a2a_wait``), and what
the caller adds (``optimizer``); for a ``recv_wait`` the ``chunk`` field holds the virtual stage
that consumes the message. On the CPU the times are ``time.perf_counter``; on CUDA compute spans
are bracketed by CUDA events and resolved once per step, so recording adds no host
synchronisation inside the step.

Spans that start and end in different places of the caller's code (the optimizer step, timed by the
monitor callback from one Lightning hook to another) are recorded with :meth:`Timeline.mark` and
:meth:`Timeline.add_between`; they may be added after ``end_step`` and are resolved by
:meth:`Timeline.resolve`. Each step also notes its origin on the host's monotonic clock and on the
wall clock (:attr:`Timeline.origin`, :attr:`Timeline.origin_unix`), which is how ranks' timelines
are put on one time axis without a barrier (see ``lightning_pp.callbacks.records``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Iterator, Optional

import torch


class SpanKind(str, Enum):
    """What a span records. A ``str`` enum: each member equals (and hashes like) its value, so
    consumers may compare with the plain strings, and a compute span recorded with its action's
    :class:`~lightning_pp.schedules.actions.ActionKind` (same values) is the same kind."""

    FORWARD = "F"
    BACKWARD = "B"
    FORWARD_BACKWARD = "FB"
    WEIGHT_GRAD = "W"
    RECV_WAIT = "recv_wait"  # blocked on a stage-boundary receive, inside the action that needs it
    A2A = "a2a"  # an expert all-to-all, from launch until it is known complete
    A2A_WAIT = "a2a_wait"  # blocked on an expert all-to-all
    OPTIMIZER = "optimizer"  # the optimizer step (recorded by the monitor callback)
    GATHER = "gather"  # a sharded chunk's parameter all-gather, from posted to waited for
    GATHER_WAIT = "gather_wait"  # blocked on it, before the chunk's first action
    REDUCE_SCATTER = "reduce_scatter"  # a sharded chunk's gradient reduce-scatter, posted to waited for
    REDUCE_SCATTER_WAIT = "reduce_scatter_wait"  # blocked on it, at the end of the step

    def __str__(self) -> str:
        # The value, as the plain strings printed (not Enum's "SpanKind.RECV_WAIT").
        return self.value


COMPUTE_SPAN_KINDS = (SpanKind.FORWARD, SpanKind.BACKWARD, SpanKind.FORWARD_BACKWARD, SpanKind.WEIGHT_GRAD)


@dataclass
class Span:
    kind: str  # a SpanKind (an ActionKind for compute spans), or its plain value
    microbatch: int
    chunk: int
    start: float
    end: float


class Timeline:
    """Spans of the current step; ``enabled=False`` makes every call a no-op."""

    def __init__(self, enabled: bool = True, device: Optional[torch.device] = None) -> None:
        self.enabled = enabled
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.spans: list[Span] = []
        self._pending: list[tuple[str, int, int, object, object]] = []
        self._origin = time.perf_counter()
        self._origin_event = None
        self.step_seconds = 0.0
        self.origin_unix = time.time()

    def begin_step(self) -> None:
        self.spans = []
        self._pending = []
        self._origin = time.perf_counter()
        self.origin_unix = time.time()
        if self.cuda and self.enabled:
            self._origin_event = torch.cuda.Event(enable_timing=True)
            self._origin_event.record()

    def end_step(self) -> None:
        """Resolve CUDA spans (one synchronisation per step) and note the step's wall time."""
        if self._pending:
            torch.cuda.current_stream().synchronize()
            for kind, mb, chunk, start, end in self._pending:
                self.spans.append(Span(kind, mb, chunk, self._origin_event.elapsed_time(start) / 1e3,
                                       self._origin_event.elapsed_time(end) / 1e3))
            self._pending = []
        self.step_seconds = time.perf_counter() - self._origin

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def add(self, kind: str, microbatch: int, chunk: int, start: float, end: float) -> None:
        if self.enabled:
            self.spans.append(Span(kind, microbatch, chunk, start, end))

    @contextmanager
    def span(self, kind: str, microbatch: int = -1, chunk: int = -1, device_side: bool = False) -> Iterator[None]:
        """Record the body as one span. ``device_side`` spans (compute) use CUDA events on CUDA."""
        if not self.enabled:
            yield
            return
        if device_side and self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((kind, microbatch, chunk, start, end))
            return
        start_t = self.now()
        try:
            yield
        finally:
            self.spans.append(Span(kind, microbatch, chunk, start_t, self.now()))

    # -- additions for spans recorded outside the executor (e.g. the optimizer step) -----------
    @property
    def origin(self) -> float:
        """``time.perf_counter()`` when the step began: the zero of every span of the step. On one
        host this clock (``CLOCK_MONOTONIC`` on Linux) is shared by every process, so two ranks'
        origins give the offset between their timelines exactly, with no synchronisation."""
        return self._origin

    def mark(self) -> object:
        """The current time, as one end of a span for :meth:`add_between`: seconds since the step
        began on the CPU, a recorded CUDA event (no host synchronisation) on CUDA, ``None`` when
        recording is off."""
        if not self.enabled:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.now()

    def add_between(self, kind: str, microbatch: int, chunk: int, start: object, end: object) -> None:
        """Add a span between two :meth:`mark` values of the current step. CUDA spans wait in the
        pending list until ``end_step`` or :meth:`resolve`; either mark being ``None`` adds nothing."""
        if not self.enabled or start is None or end is None:
            return
        if isinstance(start, float) and isinstance(end, float):
            self.spans.append(Span(kind, microbatch, chunk, start, end))
        else:
            self._pending.append((kind, microbatch, chunk, start, end))

    def resolve(self) -> list[Span]:
        """Turn pending CUDA spans (those added after ``end_step``) into times (one synchronisation,
        only if any are pending) and return the step's spans."""
        if self._pending:
            pending, self._pending = self._pending, []
            if self._origin_event is not None:
                torch.cuda.current_stream().synchronize()
                for kind, mb, chunk, start, end in pending:
                    self.spans.append(Span(kind, mb, chunk, self._origin_event.elapsed_time(start) / 1e3,
                                           self._origin_event.elapsed_time(end) / 1e3))
        return self.spans
