"""Text and trace views of a :class:`~lightning_pp.schedules.simulator.SimulationResult`.

* :func:`ascii_timeline` -- one text row per rank, for terminals and docstrings.
* :func:`stats_table` -- per-rank busy time, bubble and peak in-flight activations.
* :func:`chrome_trace` -- Chrome / Perfetto trace JSON (open in ``chrome://tracing`` or
  https://ui.perfetto.dev).

Pictures (matplotlib) are in :mod:`lightning_pp.schedules.plot`.
"""

from __future__ import annotations

import math
from typing import Optional

from lightning_pp.schedules.actions import BACKWARD, FORWARD, FORWARD_BACKWARD, WEIGHT_GRAD, Action
from lightning_pp.schedules.simulator import SimulationResult
from lightning_pp.schedules.tables import ScheduleConfig

DEFAULT_WIDTH = 100
# Wrap a full-detail timeline into at most this many blocks before switching to the scaled view.
_MAX_BLOCKS = 6
_ALLREDUCE_LABEL = "AR"
_SCALED_CHAR = {FORWARD: "F", BACKWARD: "B", FORWARD_BACKWARD: "X", WEIGHT_GRAD: "W"}


def action_label(action: Action, show_chunks: bool) -> str:
    """``F3`` / ``B3`` / ``F4+B1`` with one chunk per rank, ``F3.1`` ... with several."""
    if show_chunks:
        return action.describe()
    if action.kind == FORWARD_BACKWARD:
        return f"F{action.microbatch}+B{action.b_microbatch}"
    return f"{action.kind}{action.microbatch}"


def _uses_chunks(result: SimulationResult) -> bool:
    for _, action, _, _ in result.events:
        if action.chunk or (action.kind == FORWARD_BACKWARD and action.b_chunk):
            return True
    return False


def format_time(value: float) -> str:
    """A time in the cost model's unit, as the timelines and tables print it (6 significant digits)."""
    return f"{value:.6g}"


def ascii_timeline(result: SimulationResult, pp: int, width: Optional[int] = None) -> str:
    """Text timeline: one row per rank, time running left to right.

    Time is quantised to the shortest action (or an integer fraction of it if that makes every
    start and end land on a cell boundary): one cell per quantum, each action written as its
    label (``F3``, ``B3``; ``F3.1`` = microbatch 3 on local chunk 1 when ``vp > 1``; ``F4+B1`` a
    combined action; ``AR`` the DP gradient all-reduce) followed by ``-`` for as long as it runs,
    and ``.`` marks an idle cell. If that is wider than ``width`` columns (default 100) the rows
    wrap into a few blocks; if even that would be too long, each column covers a fixed slice of
    time and shows one letter (``F``, ``B``, ``X`` = combined, ``W``, ``A`` = all-reduce, ``.``).
    """
    width = DEFAULT_WIDTH if width is None else width
    if width < 20:
        raise ValueError(f"width={width} is too small for a timeline: use at least 20 columns.")
    rows = _row_spans(result, pp)
    durations = [end - start for _, _, start, end in result.events if end > start]
    if not durations:
        return "(no action takes any time: nothing to draw)"
    quantum = _quantum(rows, min(durations))
    show_chunks = _uses_chunks(result)
    prefix_width = len(f"rank {pp - 1} |")

    # Per rank: (first cell, end cell (exclusive), label, kind). Rounding can make neighbours
    # overlap by a cell when times are not multiples of the quantum; keep each row in order.
    cell_rows = []
    cell_width = 2
    total_cells = 0
    for spans in rows:
        cells = []
        previous_end = 0
        for start, end, kind, action in spans:
            first = max(int(round(start / quantum)), previous_end)
            last = max(int(round(end / quantum)), first + 1)
            label = _ALLREDUCE_LABEL if action is None else action_label(action, show_chunks)
            cells.append((first, last, label, kind))
            # The label and one separating space must fit in the action's cells.
            cell_width = max(cell_width, math.ceil((len(label) + 1) / (last - first)))
            previous_end = last
        cell_rows.append(cells)
        total_cells = max(total_cells, previous_end)

    body_width = width - prefix_width
    blocks = math.ceil(total_cells / max(1, body_width // cell_width))
    if blocks > _MAX_BLOCKS:
        return _scaled_timeline(rows, pp, body_width, prefix_width)
    cells_per_block = math.ceil(total_cells / blocks)  # balanced blocks, no stub of one cell

    lines = [f"1 cell = {format_time(quantum)} time units; '.' = idle"]
    for block in range(blocks):
        lo = block * cells_per_block
        hi = min(total_cells, lo + cells_per_block)
        if block:
            lines.append("")
        lines.append(" " * prefix_width + _time_axis(lo, hi, cell_width, quantum))
        for rank, cells in enumerate(cell_rows):
            lines.append(f"rank {rank:>{len(str(pp - 1))}} |" + _render_cells(cells, lo, hi, cell_width))
    return "\n".join(line.rstrip() for line in lines)


def _quantum(rows: list, smallest: float) -> float:
    """The shortest action's duration, or an integer fraction of it when that puts every start and
    end on a cell boundary (forward 2 and backward 3 give a quantum of 1, not 2 with rounding)."""
    # Compute actions only: an odd-sized all-reduce is rounded rather than refining the grid for it.
    boundaries = [t for spans in rows for span in spans if span[3] is not None for t in span[:2]]
    if len(boundaries) > 20_000:  # far too long for full detail anyway: skip the search
        return smallest
    for divisor in (1, 2, 3, 4, 5, 6, 8, 10):
        quantum = smallest / divisor
        if all(abs(t / quantum - round(t / quantum)) < 1e-6 for t in boundaries):
            return quantum
    return smallest


def _row_spans(result: SimulationResult, pp: int) -> list:
    """Per rank: [(start, end, kind, action or None for the all-reduce)] in time order."""
    rows: list = [[] for _ in range(pp)]
    for rank, action, start, end in result.events:
        if end > start:
            rows[rank].append((start, end, action.kind, action))
    if result.allreduce_time > 0:
        for rank, rank_end in enumerate(result.rank_end):
            rows[rank].append((rank_end, rank_end + result.allreduce_time, "AR", None))
    return rows


def _time_axis(lo: int, hi: int, cell_width: int, quantum: float) -> str:
    """Tick labels above the cells of one block, spaced so they never collide."""
    chars = [" "] * ((hi - lo) * cell_width)
    step = max(1, math.ceil(8 / cell_width))
    cell = lo + (-lo) % step  # first multiple of step at or after lo
    last_written = -1
    while cell < hi:
        text = format_time(cell * quantum)
        pos = (cell - lo) * cell_width
        if pos > last_written and pos + len(text) <= len(chars):
            chars[pos : pos + len(text)] = text
            last_written = pos + len(text)
        cell += step
    return "".join(chars)


def _render_cells(cells: list, lo: int, hi: int, cell_width: int) -> str:
    chars = (".".ljust(cell_width)) * (hi - lo)
    out = list(chars)
    for first, last, label, _ in cells:
        if last <= lo or first >= hi:
            continue
        a, b = max(first, lo), min(last, hi)
        span = (b - a) * cell_width
        text = label[: max(span - 1, 1)]
        text = text + "-" * (span - 1 - len(text))
        text = text[:span].ljust(span)
        pos = (a - lo) * cell_width
        out[pos : pos + span] = text
    return "".join(out)


def _scaled_timeline(rows: list, pp: int, body_width: int, prefix_width: int) -> str:
    """One letter per column; each column covers ``makespan / columns`` time."""
    makespan = max((spans[-1][1] for spans in rows if spans), default=0.0)
    columns = body_width
    per_column = makespan / columns
    lines = [
        f"1 column = {format_time(per_column)} time units (scaled to fit); "
        "F forward, B backward, X combined F+B, W weight-grad, A DP all-reduce, . idle"
    ]
    rank_width = len(str(pp - 1))
    for rank, spans in enumerate(rows):
        out = []
        k = 0
        for column in range(columns):
            mid = (column + 0.5) * per_column
            while k < len(spans) and spans[k][1] <= mid:
                k += 1
            if k < len(spans) and spans[k][0] <= mid:
                kind = spans[k][2]
                out.append("A" if kind == "AR" else _SCALED_CHAR.get(kind, "?"))
            else:
                out.append(".")
        lines.append(f"rank {rank:>{rank_width}} |" + "".join(out).rstrip("."))
    return "\n".join(lines)


def stats_table(result: SimulationResult) -> str:
    """Per-rank busy time, bubble, peak in-flight activations and exposed all-to-all, then totals."""
    header = f"{'rank':>4}  {'busy':>10}  {'bubble':>7}  {'peak in-flight':>14}  {'exposed a2a':>11}"
    lines = [header, "-" * len(header)]
    for rank in range(result.pp):
        lines.append(
            f"{rank:>4}  {format_time(result.busy[rank]):>10}  {result.rank_bubble[rank]:>7.1%}  "
            f"{result.peak_inflight[rank]:>14}  {format_time(result.exposed_a2a[rank]):>11}"
        )
    lines.append("-" * len(header))
    lines.append(f"bubble fraction: {result.bubble_fraction:.2%}")
    lines.append(f"pipeline makespan: {format_time(result.pipeline_makespan)}")
    if result.allreduce_algorithm == "none":
        lines.append(f"makespan: {format_time(result.makespan)}")
    else:
        lines.append(
            f"makespan: {format_time(result.makespan)} (incl. DP all-reduce "
            f"{format_time(result.allreduce_time)}, {result.allreduce_algorithm})"
        )
    return "\n".join(lines)


def _action_args(action: Action, cfg: ScheduleConfig, rank: int) -> dict:
    """Trace arguments of one action; stages follow the schedule's placement (loop or V)."""
    if action.kind == FORWARD_BACKWARD:
        return {
            "f_microbatch": action.microbatch,
            "f_chunk": action.chunk,
            "f_stage": cfg.stage_of(rank, action.chunk),
            "b_microbatch": action.b_microbatch,
            "b_chunk": action.b_chunk,
            "b_stage": cfg.stage_of(rank, action.b_chunk),
        }
    return {"microbatch": action.microbatch, "chunk": action.chunk, "stage": cfg.stage_of(rank, action.chunk)}


#: The Chrome-trace category of each action kind (the measured traces of the monitor use it too).
CATEGORY = {FORWARD: "forward", BACKWARD: "backward", FORWARD_BACKWARD: "forward_backward", WEIGHT_GRAD: "weight_grad"}


def chrome_trace(result: SimulationResult, cfg: ScheduleConfig, us_per_unit: float = 1000.0) -> dict:
    """Chrome / Perfetto trace: one process track per rank, one complete (``"X"``) event per action.

    Cost-model time units become ``us_per_unit`` microseconds (default: 1 unit = 1 ms), so a
    unit-cost schedule reads naturally in the viewer. The DP all-reduce, if any, is a second
    thread of each rank.
    """
    events: list = []
    for rank in range(cfg.pp):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"pp rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}})
    for rank, action, start, end in result.events:
        events.append(
            {
                "name": action.describe(),
                "cat": CATEGORY.get(action.kind, action.kind),
                "ph": "X",
                "ts": start * us_per_unit,
                "dur": (end - start) * us_per_unit,
                "pid": rank,
                "tid": 0,
                "args": _action_args(action, cfg, rank),
            }
        )
    if result.allreduce_time > 0:
        for rank, rank_end in enumerate(result.rank_end):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "dp all-reduce"}})
            events.append(
                {
                    "name": f"all-reduce ({result.allreduce_algorithm})",
                    "cat": "allreduce",
                    "ph": "X",
                    "ts": rank_end * us_per_unit,
                    "dur": result.allreduce_time * us_per_unit,
                    "pid": rank,
                    "tid": 1,
                    "args": {"algorithm": result.allreduce_algorithm},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": cfg.schedule,
            "pp": cfg.pp,
            "vp": cfg.vp,
            "microbatches": cfg.num_microbatches,
            "placement": cfg.placement,
            "bubble_fraction": result.bubble_fraction,
            "makespan": result.makespan,
            "us_per_unit": us_per_unit,
        },
    }


__all__ = ["action_label", "ascii_timeline", "chrome_trace", "format_time", "stats_table"]
