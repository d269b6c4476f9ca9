"""Low-cost recording of what each rank spends its step on.

A ``Timeline`` collects spans ``(kind, microbatch, chunk, start, end)`` in seconds since the start of
the step: compute actions (``F``, ``B``, ``FB``), waits on stage-boundary receives (``recv_wait``),
waits on expert all-to-all (``a2a_wait``) and whatever the caller adds (``optimizer``); for a
``recv_wait`` the ``chunk`` field holds the virtual stage that consumes the message. On the CPU the
times are ``time.perf_counter``; on CUDA compute spans are bracketed by CUDA events and resolved
once per step, so recording adds no host synchronisation inside the step.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass
class Span:
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float

    def to_dict(self) -> dict:
        return {"kind": self.kind, "microbatch": self.microbatch, "chunk": self.chunk, "start": self.start, "end": self.end}


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

    def begin_step(self) -> None:
        self.spans = []
        self._pending = []
        self._origin = time.perf_counter()
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

    def total(self, kind: str) -> float:
        return sum(s.end - s.start for s in self.spans if s.kind == kind)
