"""Seeing the pipeline: per-step analysis of the runtime's timeline (bubble, per-action costs, the
simulator's ideal, hidden all-to-all), merged plan-vs-measurement traces and pictures, and the
``PipelineMonitor`` Trainer callback.

``records``, ``analysis`` and ``export`` need no Lightning (use them from Fabric or a plain loop);
``PipelineMonitor`` is imported on first access, so importing this package stays Lightning-free.
"""

from typing import Any

from lightning_pp.callbacks.analysis import PipelineStats, analyze
from lightning_pp.callbacks.export import capture_step, export_png, export_trace, merged_trace
from lightning_pp.callbacks.records import RankTimeline, gather_spans

__all__ = [
    "PipelineMonitor",
    "PipelineStats",
    "RankTimeline",
    "analyze",
    "capture_step",
    "export_png",
    "export_trace",
    "gather_spans",
    "merged_trace",
]


def __getattr__(name: str) -> Any:
    if name == "PipelineMonitor":
        from lightning_pp.callbacks.monitor import PipelineMonitor

        return PipelineMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
