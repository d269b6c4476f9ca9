"""Every rank's spans of one step, and putting them on one time axis.

:class:`RankTimeline` is one rank's spans of a step with what is needed to place them next to
other ranks' (its step origin on two clocks, its host, its pipeline coordinates);
:func:`gather_spans` collects them from every rank (collective), :func:`as_records` normalises
whatever callers pass as "the spans of every rank", and :func:`clock_offsets` aligns them.

Aligning ranks (no barrier): every step notes its origin on the host's monotonic clock
(``time.perf_counter``, which is ``CLOCK_MONOTONIC`` on Linux and system-wide on every platform
Python supports) and on the wall clock. Ranks on one host (same host name and boot id) are aligned
with the monotonic origins, which is exact; ranks on several hosts with the wall-clock origins,
which is as good as the hosts' clock synchronisation (NTP/PTP: typically well under a millisecond).
``alignment="none"`` instead treats every rank's step start as simultaneous.

No Lightning here.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_pp.runtime.timeline import Span

ALIGNMENTS = ("auto", "monotonic", "wall", "none")

_HOST_ID: Optional[str] = None


def host_id() -> str:
    """This machine: host name plus the kernel's boot id where there is one, so two machines that
    share a host name (containers) are not taken for one."""
    global _HOST_ID
    if _HOST_ID is None:
        boot = ""
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            pass
        _HOST_ID = f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()
    return _HOST_ID


@dataclass
class RankTimeline:
    """One rank's spans of one step, with what is needed to place them next to other ranks'.

    ``origin`` / ``origin_unix``: the step's start on the host's monotonic clock and on the wall
    clock; ``host``: :func:`host_id` (empty when unknown). ``extra`` carries whatever the caller
    gathers along (the monitor sends its sample and token counts)."""

    rank: int
    pp_rank: Optional[int] = None
    dp_rank: Optional[int] = None
    spans: list = field(default_factory=list)
    origin: float = 0.0
    origin_unix: float = 0.0
    host: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_timeline(cls, timeline, rank: int = 0, pp_rank: Optional[int] = None, dp_rank: Optional[int] = None,
                      extra: Optional[dict] = None) -> "RankTimeline":
        spans = timeline.resolve() if hasattr(timeline, "resolve") else timeline.spans
        return cls(
            rank=rank,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
            spans=list(spans),
            origin=float(getattr(timeline, "origin", 0.0)),
            origin_unix=float(getattr(timeline, "origin_unix", 0.0)),
            host=host_id(),
            extra=dict(extra or {}),
        )

    def to_dict(self) -> dict:
        """Plain types only (spans as 5-tuples): small and safe to pickle across processes."""
        return {
            "rank": self.rank,
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            # str(): a kind enum's value ("F", "recv_wait", ...), so the record unpickles anywhere
            "spans": [(str(s.kind), s.microbatch, s.chunk, s.start, s.end) for s in self.spans],
            "origin": self.origin,
            "origin_unix": self.origin_unix,
            "host": self.host,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "RankTimeline":
        return cls(
            rank=int(data["rank"]),
            pp_rank=data.get("pp_rank"),
            dp_rank=data.get("dp_rank"),
            spans=[as_span(s) for s in data.get("spans", ())],
            origin=float(data.get("origin", 0.0)),
            origin_unix=float(data.get("origin_unix", 0.0)),
            host=str(data.get("host", "")),
            extra=dict(data.get("extra") or {}),
        )


def as_span(value: Any) -> Span:
    """A :class:`Span` from a Span, a dict with its fields, or a ``(kind, microbatch, chunk, start,
    end)`` tuple (kinds become plain strings)."""
    if isinstance(value, Span):
        return value
    if isinstance(value, dict):
        return Span(str(value["kind"]), int(value["microbatch"]), int(value["chunk"]),
                    float(value["start"]), float(value["end"]))
    kind, microbatch, chunk, start, end = value
    return Span(str(kind), int(microbatch), int(chunk), float(start), float(end))


def as_records(spans_per_rank: Sequence[Any]) -> list[RankTimeline]:
    """Normalise what callers pass as "the spans of every rank": :class:`RankTimeline` objects (as
    :func:`gather_spans` returns), their ``to_dict()`` form, ``Timeline`` objects, or plain lists of
    spans (then item ``i`` is global rank ``i`` and nothing is known about its clock)."""
    records = []
    for index, item in enumerate(spans_per_rank):
        if isinstance(item, RankTimeline):
            records.append(item)
        elif isinstance(item, dict) and "spans" in item:
            records.append(RankTimeline.from_dict(item))
        elif hasattr(item, "spans") and hasattr(item, "begin_step"):  # a Timeline
            records.append(RankTimeline.from_timeline(item, rank=index))
        else:
            records.append(RankTimeline(rank=index, spans=[as_span(s) for s in item]))
    return records


def gather_spans(timeline, group=None, topology=None, extra: Optional[dict] = None) -> list[RankTimeline]:
    """Every rank's :class:`RankTimeline` of the current step, on every rank of ``group``.

    Collective: all ranks of ``group`` (default: the world) must call it for the same step. With
    ``topology`` (the executor's) each record carries its pipeline and data-parallel coordinates;
    without, they are derived from the rank order when the step is analysed. Without an
    initialised process group it returns this process's record alone."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialised else 0
    pp_rank = topology.pp_rank if topology is not None else None
    dp_rank = topology.dp_rank if topology is not None else None
    record = RankTimeline.from_timeline(timeline, rank=rank, pp_rank=pp_rank, dp_rank=dp_rank, extra=extra)
    if not initialised:
        return [record]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, record.to_dict(), group=group)
    return [RankTimeline.from_dict(item) for item in gathered]


def clock_offsets(records: Sequence[RankTimeline], alignment: str = "auto") -> tuple[list[float], str]:
    """Seconds to add to each record's span times to put every rank on one axis (zero = the
    earliest step start), and the method used (``auto`` resolves to one of the others)."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment={alignment!r} is not one of {', '.join(ALIGNMENTS)}.")
    if alignment == "auto":
        hosts = {r.host for r in records}
        if len(hosts) == 1 and "" not in hosts and all(r.origin > 0 for r in records):
            alignment = "monotonic"
        elif all(r.origin_unix > 0 for r in records):
            alignment = "wall"
        else:
            alignment = "none"
    if alignment == "none":
        return [0.0] * len(records), alignment
    bases = [r.origin if alignment == "monotonic" else r.origin_unix for r in records]
    zero = min(bases, default=0.0)
    return [b - zero for b in bases], alignment


__all__ = ["ALIGNMENTS", "RankTimeline", "as_records", "as_span", "clock_offsets", "gather_spans", "host_id"]
