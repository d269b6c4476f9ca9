"""Pictures of a pipeline schedule, with matplotlib (imported only here and only when called:
``pip install lightning_pp[plot]``).

* :func:`plot_timeline` -- the classic pipeline diagram of a
  :class:`~lightning_pp.schedules.simulator.SimulationResult` as an image.
* :func:`draw_actions` -- the same bars on any matplotlib axes (the pipeline monitor uses it for
  planned and measured rows side by side), coloured by :func:`action_colour`.
* :func:`require_matplotlib` -- matplotlib, or an ImportError saying how to install it.

The text and trace views (ASCII timeline, stats table, Chrome trace) are in
:mod:`lightning_pp.schedules.render`.
"""

from __future__ import annotations

import functools

from lightning_pp.schedules.actions import BACKWARD, FORWARD, FORWARD_BACKWARD, WEIGHT_GRAD
from lightning_pp.schedules.render import action_label, format_time
from lightning_pp.schedules.simulator import SimulationResult
from lightning_pp.schedules.tables import ScheduleConfig


#: Colour of weight-gradient (``W``) bars: grey, whatever the microbatch.
WEIGHT_GRAD_COLOUR = (0.6, 0.6, 0.6)


def _mix(rgb, other, weight: float) -> tuple:
    return tuple(weight * a + (1.0 - weight) * b for a, b in zip(rgb, other))


def require_matplotlib(what: str):
    """(matplotlib, Figure, FigureCanvasAgg), or an ImportError saying how to install the extra."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            f"{what} needs matplotlib, which is not installed: run `pip install lightning_pp[plot]`."
        ) from err
    return matplotlib, Figure, FigureCanvasAgg


@functools.lru_cache(maxsize=4096)
def action_colour(microbatch: int, microbatches: int, backward: bool) -> tuple:
    """RGB of an action in the timeline pictures: one hue per microbatch (``tab10`` for up to 10
    microbatches, ``turbo`` beyond), forwards lighter and backwards darker."""
    matplotlib, _, _ = require_matplotlib("action_colour")
    if microbatches <= 10:
        base = matplotlib.colormaps["tab10"](microbatch % 10)[:3]
    else:
        base = matplotlib.colormaps["turbo"](microbatch / max(microbatches - 1, 1))[:3]
    if backward:
        return _mix(base, (0.0, 0.0, 0.0), 0.7)
    return _mix(base, (1.0, 1.0, 1.0), 0.55)


def draw_actions(ax, events, microbatches: int, show_chunks: bool, points_per_unit: float, height: float = 0.8,
                 max_labels: int = 400) -> None:
    """Draw placed actions ``(row, action, start, end)`` as bars on the matplotlib axes ``ax``, row
    ``r`` centred on ``y = r``: coloured by :func:`action_colour`, a combined ``FB`` split
    horizontally with its forward half on top, a ``W`` grey. Up to ``max_labels`` actions are
    labelled (``F3``, ``B3``, ``F3.1`` with chunks) where the label fits at 7 pt, given
    ``points_per_unit`` (points per time unit on the x axis)."""
    # One broken_barh (one collection) per row and half, so large tables stay fast to draw.
    bars: dict = {}
    labels = []
    for row, action, start, end in events:
        span = (start, end - start)
        if action.kind == FORWARD_BACKWARD:
            bars.setdefault((row, "top"), []).append((span, action_colour(action.microbatch, microbatches, False)))
            bars.setdefault((row, "bottom"), []).append((span, action_colour(action.b_microbatch, microbatches, True)))
        elif action.kind in (FORWARD, BACKWARD):
            colour = action_colour(action.microbatch, microbatches, action.kind == BACKWARD)
            bars.setdefault((row, "full"), []).append((span, colour))
        else:
            bars.setdefault((row, "full"), []).append((span, WEIGHT_GRAD_COLOUR))
        labels.append((row, action, start, end))

    for (row, part), items in bars.items():
        y = row - height / 2
        y0, h = {"full": (y, height), "top": (y, height / 2), "bottom": (y + height / 2, height / 2)}[part]
        ax.broken_barh([b[0] for b in items], (y0, h), facecolors=[b[1] for b in items], edgecolor="white",
                       linewidth=0.4)

    if len(labels) > max_labels:
        return
    for row, action, start, end in labels:
        if action.kind == FORWARD_BACKWARD:
            texts = [(row - height / 4, f"F{action.microbatch}" + (f".{action.chunk}" if show_chunks else "")),
                     (row + height / 4, f"B{action.b_microbatch}" + (f".{action.b_chunk}" if show_chunks else ""))]
        else:
            texts = [(row, action_label(action, show_chunks))]
        for y, text in texts:
            if (end - start) * points_per_unit < 4.5 * len(text):
                continue  # would not fit inside the bar at 7 pt
            ax.text((start + end) / 2, y, text, ha="center", va="center", fontsize=7)


def plot_timeline(result: SimulationResult, cfg: ScheduleConfig, path) -> None:
    """Save the classic pipeline diagram to ``path`` (format from the extension, e.g. ``.png``).

    Rows are ranks (rank 0 on top), one colour per microbatch, forwards lighter and backwards
    darker; a combined ``FB`` action is split horizontally, its forward half on top, and a
    weight-gradient ``W`` is grey. With the V placement the title says so. Uses the Agg
    canvas directly, so it never touches pyplot's global state or the user's backend.
    """
    _, Figure, FigureCanvasAgg = require_matplotlib("plot_timeline")
    from matplotlib.patches import Patch

    makespan = max(result.makespan, 1e-12)
    fig = Figure(figsize=(min(max(8.0, makespan * 0.2), 32.0), min(1.2 + 0.45 * cfg.pp, 40.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    height = 0.8
    points_per_unit = fig.get_figwidth() * 72 * 0.85 / makespan  # roughly: axes span ~85% of the figure
    draw_actions(ax, result.events, cfg.num_microbatches, cfg.vp > 1, points_per_unit, height)
    if result.allreduce_time > 0:
        for rank in range(cfg.pp):
            ax.broken_barh(
                [(result.rank_end[rank], result.allreduce_time)], (rank - height / 2, height),
                facecolors="lightgrey", edgecolor="grey", hatch="//", linewidth=0.4,
            )

    ax.set_ylim(cfg.pp - 0.5, -0.5)
    ax.set_yticks(range(cfg.pp))
    ax.set_yticklabels([f"rank {r}" for r in range(cfg.pp)])
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time (cost-model units)")
    ax.set_title(
        f"{cfg.schedule}  pp={cfg.pp} vp={cfg.vp} microbatches={cfg.num_microbatches}"
        + ("  (V placement)" if cfg.placement == "v" else "")
        + "  "
        f"bubble {result.bubble_fraction:.1%}  makespan {format_time(result.makespan)}"
    )
    handles = [
        Patch(facecolor=action_colour(0, cfg.num_microbatches, False), label="forward (lighter)"),
        Patch(facecolor=action_colour(0, cfg.num_microbatches, True), label="backward (darker)"),
    ]
    if any(action.kind == WEIGHT_GRAD for _, action, _, _ in result.events):
        handles.append(Patch(facecolor=WEIGHT_GRAD_COLOUR, label="weight grad W"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["action_colour", "draw_actions", "plot_timeline", "require_matplotlib"]
