"""Pictures of one measured step next to its plan: a Chrome/Perfetto trace and a PNG timeline.

Both take the spans of every rank (what :func:`~lightning_pp.callbacks.records.gather_spans`
returns) and the :class:`ScheduleConfig`, and show for each rank two rows: the **planned** step
(the simulator run with this step's measured mean action costs, see
:func:`~lightning_pp.callbacks.analysis.analyze`) and the **measured** one. Time zero is the start
of the step's first action on any rank. The planned rows are drawn with the schedule renderers
(:func:`~lightning_pp.schedules.chrome_trace`, :func:`~lightning_pp.schedules.plot.draw_actions`).

From Fabric or a plain loop, after a training step (collective: every rank calls it)::

    from lightning_pp.callbacks import capture_step
    stats = capture_step(executor, "runs/pipeline", step=step)   # files written by global rank 0
    print(stats.summary())
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from lightning_pp.callbacks.analysis import (
    A2A,
    A2A_WAIT,
    OPTIMIZER,
    RECV_WAIT,
    PipelineStats,
    analyze,
    compute_busy,
    match_actions,
    merge_intervals,
    span_action,
)
from lightning_pp.callbacks.records import RankTimeline, as_records, gather_spans
from lightning_pp.schedules import ScheduleConfig, chrome_trace
from lightning_pp.schedules.render import CATEGORY

PathLike = Union[str, "os.PathLike[str]"]

PLANNED_TID, MEASURED_TID, WAITS_TID, A2A_TID = 0, 1, 2, 3
_TRACK_NAMES = {
    PLANNED_TID: "planned (simulator, measured costs)",
    MEASURED_TID: "measured",
    WAITS_TID: "waits (p2p receive, all-to-all)",
}
_WAIT_KINDS = (RECV_WAIT, A2A_WAIT)


def _lanes(spans: list) -> list[int]:
    """Lane of each span (in the given order) such that spans in one lane never overlap: trace
    viewers draw a thread's events as a stack and garble partial overlaps. All-to-alls of
    different microbatches can be in flight together."""
    lane_end: list = []
    out = [0] * len(spans)
    for index in sorted(range(len(spans)), key=lambda i: (spans[i].start, spans[i].end)):
        span = spans[index]
        lane = next((k for k, end in enumerate(lane_end) if end <= span.start), len(lane_end))
        if lane == len(lane_end):
            lane_end.append(span.end)
        else:
            lane_end[lane] = span.end
        out[index] = lane
    return out


def _prepare(spans_per_rank: Sequence[Any], config: ScheduleConfig, alignment: str,
             stats: Optional[PipelineStats]):
    records = as_records(spans_per_rank)
    if stats is None:
        stats = analyze(records, config, alignment=alignment)
    return records, stats


def merged_trace(spans_per_rank: Sequence[Any], config: ScheduleConfig, step: Optional[int] = None,
                 alignment: str = "auto", stats: Optional[PipelineStats] = None) -> dict:
    """The Chrome/Perfetto trace dict: one process per rank with a planned track, a measured
    track (compute actions and the optimizer step), a waits track (``recv_wait``, ``a2a_wait``)
    and, with expert parallelism, tracks of the all-to-alls in flight (``a2a``, launch to
    completion). Every event's ``args`` says its track, microbatch and chunk."""
    records, stats = _prepare(spans_per_rank, config, alignment, stats)
    events: list = []
    for index, record in enumerate(records):
        events.extend(_process_metadata(record, stats.pp_ranks[index]))
    events.extend(_planned_events(records, stats, config))
    for index, record in enumerate(records):
        events.extend(_measured_events(record, stats, config, index))
        events.extend(_wait_and_transfer_events(record, stats.offsets[index] - stats.window[0]))
    other = {
        "schedule": config.schedule,
        "pp": config.pp,
        "vp": config.vp,
        "microbatches": config.num_microbatches,
        "step": step,
        "alignment": stats.alignment,
        "ranks": stats.ranks,
        "bubble_fraction": stats.bubble_fraction,
        "rank_bubble": stats.rank_bubble,
        "ideal_bubble_fraction": stats.ideal_bubble,
        "ideal_rank_bubble": stats.ideal_rank_bubble,
        "step_ms": stats.step_time * 1e3,
        "action_ms": {str(kind): cost * 1e3 for kind, cost in stats.costs.items()},
        "a2a_hidden": stats.a2a_hidden,
        "summary": stats.summary(),
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


_US = 1e6  # trace time unit: microseconds


def _thread_metadata(pid: int, tid: int, name: str) -> list:
    return [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}]


def _process_metadata(record: RankTimeline, pp_rank: int) -> list:
    """The process (rank) name and its fixed tracks."""
    pid = record.rank
    dp = f", dp {record.dp_rank}" if record.dp_rank else ""
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
               "args": {"name": f"rank {record.rank} (pp {pp_rank}{dp})"}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": record.rank}}]
    for tid, name in _TRACK_NAMES.items():
        events.extend(_thread_metadata(pid, tid, name))
    return events


def _planned_events(records: list, stats: PipelineStats, config: ScheduleConfig) -> list:
    """The schedule renderer's trace of the simulation (1 cost unit = 1 s), one copy per
    data-parallel pipeline, moved onto each rank's planned track."""
    planned = chrome_trace(stats.ideal, config, us_per_unit=_US)
    events = []
    for index, record in enumerate(records):
        for event in planned["traceEvents"]:
            if event["ph"] == "X" and event["pid"] == stats.pp_ranks[index]:
                events.append(dict(event, pid=record.rank, tid=PLANNED_TID,
                                   args=dict(event.get("args", {}), track="planned")))
    return events


def _measured_events(record: RankTimeline, stats: PipelineStats, config: ScheduleConfig, index: int) -> list:
    """One event per compute action, with its busy time and the receive wait inside it."""
    shift = stats.offsets[index] - stats.window[0]
    busy = {id(span): (b, w) for span, b, w in compute_busy(record.spans)}
    events = []
    for span, action in match_actions(record, config, stats.pp_ranks[index]):
        action = span_action(span, action)
        b, w = busy[id(span)]
        args = dict(action.to_dict(), track="measured", busy_ms=b * 1e3, recv_wait_ms=w * 1e3)
        events.append({
            "name": action.describe(), "cat": CATEGORY.get(span.kind, str(span.kind)), "ph": "X",
            "ts": (span.start + shift) * _US, "dur": (span.end - span.start) * _US,
            "pid": record.rank, "tid": MEASURED_TID, "args": args,
        })
    return events


def _wait_and_transfer_events(record: RankTimeline, shift: float) -> list:
    """Waits, all-to-alls in flight (one lane per concurrent transfer) and the optimizer step."""
    pid = record.rank
    transfers = [span for span in record.spans if span.kind == A2A]
    lanes = _lanes(transfers)
    events = []
    for lane in range(max(lanes, default=-1) + 1):
        events.extend(_thread_metadata(pid, A2A_TID + lane, f"all-to-all in flight ({lane + 1})"))
    lane_of = {id(span): lane for span, lane in zip(transfers, lanes)}
    for span in record.spans:
        if span.kind in _WAIT_KINDS:
            tid, label = WAITS_TID, f"{span.kind} mb{span.microbatch}"
            args = {"track": "waits", "microbatch": span.microbatch,
                    ("stage" if span.kind == RECV_WAIT else "chunk"): span.chunk}
        elif span.kind == A2A:
            tid, label = A2A_TID + lane_of[id(span)], f"a2a mb{span.microbatch}"
            args = {"track": "a2a", "microbatch": span.microbatch, "chunk": span.chunk}
        elif span.kind == OPTIMIZER:
            tid, label, args = MEASURED_TID, "optimizer", {"track": "measured"}
        else:
            continue
        events.append({
            "name": label, "cat": str(span.kind), "ph": "X", "ts": (span.start + shift) * _US,
            "dur": (span.end - span.start) * _US, "pid": pid, "tid": tid, "args": args,
        })
    return events


def export_trace(spans_per_rank: Sequence[Any], config: ScheduleConfig, path: PathLike,
                 step: Optional[int] = None, alignment: str = "auto", stats: Optional[PipelineStats] = None) -> dict:
    """Write :func:`merged_trace` as JSON to ``path`` (open it in https://ui.perfetto.dev or
    ``chrome://tracing``) and return it."""
    trace = merged_trace(spans_per_rank, config, step=step, alignment=alignment, stats=stats)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace


def export_png(spans_per_rank: Sequence[Any], config: ScheduleConfig, path: PathLike,
               step: Optional[int] = None, alignment: str = "auto", stats: Optional[PipelineStats] = None,
               dpi: int = 110) -> Path:
    """Save the step as a timeline picture (format from the extension). Needs matplotlib, the
    ``plot`` extra (``pip install lightning_pp[plot]``): without it this raises ``ImportError``
    saying so; a path that cannot be written raises ``OSError``. Two rows per rank, the plan (on a
    grey band) above the measurement; time in milliseconds from the step's first action. In
    measured rows hatched white marks the part of an action spent waiting for a neighbour's
    activation or gradient (``recv_wait``), red hatching exposed all-to-all waits, and a grey bar
    the optimizer step."""
    from lightning_pp.schedules.plot import draw_actions, require_matplotlib

    _, Figure, FigureCanvasAgg = require_matplotlib("export_png")

    records, stats = _prepare(spans_per_rank, config, alignment, stats)
    zero, ms = stats.window[0], 1e3
    n = len(records)
    ends = [stats.ideal.pipeline_makespan * ms]
    for record, offset in zip(records, stats.offsets):
        ends += [(s.end + offset - zero) * ms for s in record.spans]
    right = max(ends + [1e-9])

    fig = Figure(figsize=(12.0, min(1.6 + 0.5 * 2 * n, 40.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    points_per_ms = fig.get_figwidth() * 72 * 0.8 / right
    height = 0.8
    show_chunks = config.vp > 1

    planned, measured = [], []
    for index, record in enumerate(records):
        planned_row, measured_row = 2 * index, 2 * index + 1
        ax.axhspan(planned_row - 0.5, planned_row + 0.5, color=(0.94, 0.94, 0.94), zorder=0)
        for _, action, start, end in stats.ideal.rank_events(stats.pp_ranks[index]):
            planned.append((planned_row, action, start * ms, end * ms))
        shift = stats.offsets[index] - zero
        for span, action in match_actions(record, config, stats.pp_ranks[index]):
            measured.append((measured_row, span_action(span, action), (span.start + shift) * ms, (span.end + shift) * ms))
        _draw_overlays(ax, record, shift, measured_row - height / 2, height, right)
    draw_actions(ax, planned, config.num_microbatches, show_chunks, points_per_ms, height)
    draw_actions(ax, measured, config.num_microbatches, show_chunks, points_per_ms, height)

    _label_axes(ax, records, config, stats, step, right)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path



def _label_axes(ax, records: list, config: ScheduleConfig, stats: PipelineStats, step: Optional[int],
                right: float) -> None:
    """Row labels, title and legend of :func:`export_png`."""
    from matplotlib.patches import Patch

    from lightning_pp.schedules.plot import action_colour

    n = len(records)
    ax.set_ylim(2 * n - 0.5, -0.5)
    ax.set_yticks(range(2 * n))
    labels = []
    for record in records:
        labels += [f"rank {record.rank} plan", f"rank {record.rank} measured"]
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlim(0, right)
    ax.set_xlabel("time since the step's first action (ms)")
    at = "" if step is None else f"step {step}: "
    ax.set_title(
        f"{config.schedule} pp={config.pp} vp={config.vp} microbatches={config.num_microbatches}  {at}"
        f"bubble {stats.bubble_fraction:.1%} measured, {stats.ideal_bubble:.1%} planned; "
        f"compute window {stats.step_time * 1e3:.1f} ms",
        fontsize=9,
    )
    kinds = {s.kind for record in records for s in record.spans}
    handles = [
        Patch(facecolor=action_colour(0, config.num_microbatches, False), label="forward (lighter)"),
        Patch(facecolor=action_colour(0, config.num_microbatches, True), label="backward (darker)"),
        Patch(facecolor="white", edgecolor="grey", hatch="////", label="waiting for neighbour"),
    ]
    if A2A_WAIT in kinds:
        handles.append(Patch(facecolor="white", edgecolor="red", hatch="xx", label="all-to-all wait"))
    if OPTIMIZER in kinds:
        handles.append(Patch(facecolor=(0.55, 0.55, 0.55), label="optimizer step"))
    handles.append(Patch(facecolor=(0.94, 0.94, 0.94), label="plan (simulator)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)


def _draw_overlays(ax, record: RankTimeline, shift: float, y: float, height: float, right: float) -> None:
    """Receive waits (hatched white), exposed all-to-all waits (red hatching) and the optimizer
    step (grey) over one measured row; back-to-back waits (a header, then its tensors) are drawn
    as one patch."""
    ms = 1e3
    overlays = {}
    for kind in (RECV_WAIT, A2A_WAIT, OPTIMIZER):
        intervals = merge_intervals([((s.start + shift) * ms, (s.end + shift) * ms)
                                     for s in record.spans if s.kind == kind and s.end > s.start], gap=right * 0.002)
        overlays[kind] = [(start, end - start) for start, end in intervals]
    if overlays[RECV_WAIT]:
        ax.broken_barh(overlays[RECV_WAIT], (y, height), facecolors=(1, 1, 1, 0.7), edgecolor="grey",
                       hatch="////", linewidth=0, zorder=3)
    if overlays[A2A_WAIT]:
        ax.broken_barh(overlays[A2A_WAIT], (y, height), facecolors=(1, 1, 1, 0.3), edgecolor="red",
                       hatch="xx", linewidth=0, zorder=3)
    if overlays[OPTIMIZER]:
        ax.broken_barh(overlays[OPTIMIZER], (y, height), facecolors=(0.55, 0.55, 0.55), edgecolor="white",
                       linewidth=0.4, zorder=2)


def capture_step(executor, dirpath: Optional[PathLike] = None, step: Optional[int] = None, write_trace: bool = True,
                 write_png: bool = True, group=None, alignment: str = "auto") -> PipelineStats:
    """Gather the executor's last step from every rank, analyse it and (on global rank 0, when
    ``dirpath`` is given) write ``pipeline_trace_step{step}.json`` and
    ``pipeline_timeline_step{step}.png`` there. Collective: call it on every rank after the same
    ``train_step`` (and after the optimizer step if you timed it into ``executor.timeline``).
    Returns the same :class:`PipelineStats` on every rank.

    The files are an explicit request, so a failure to write them raises on global rank 0 (the
    only rank that writes, after the gather): ``write_png`` needs matplotlib, the ``plot`` extra
    (``pip install lightning_pp[plot]``; else ``ImportError``; pass ``write_png=False`` without it),
    and ``dirpath`` must be creatable and writable (else ``OSError``). ``PipelineMonitor`` instead
    warns and goes on."""
    import torch.distributed as dist

    records = gather_spans(executor.timeline, group=group, topology=executor.topology)
    stats = analyze(records, executor.step_schedule, alignment=alignment)
    is_zero = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if dirpath is not None and is_zero:
        write_step_files(records, executor.step_schedule, dirpath, step, stats, write_trace, write_png)
    return stats


def step_file_names(step: Optional[int]) -> tuple[str, str]:
    suffix = "" if step is None else f"_step{step}"
    return f"pipeline_trace{suffix}.json", f"pipeline_timeline{suffix}.png"


def write_step_files(records, config: ScheduleConfig, dirpath: PathLike, step: Optional[int],
                     stats: PipelineStats, write_trace: bool = True, write_png: bool = True) -> list[Path]:
    """Write the trace and/or the picture of one step into ``dirpath``; returns the paths."""
    trace_name, png_name = step_file_names(step)
    written = []
    if write_trace:
        export_trace(records, config, Path(dirpath) / trace_name, step=step, stats=stats)
        written.append(Path(dirpath) / trace_name)
    if write_png:
        written.append(export_png(records, config, Path(dirpath) / png_name, step=step, stats=stats))
    return written


__all__ = ["capture_step", "export_png", "export_trace", "merged_trace", "step_file_names", "write_step_files"]
