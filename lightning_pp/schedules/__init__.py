"""Pure pipeline schedules: per-rank action tables, validation, a simulator, renderers and a CLI
(``python -m lightning_pp.schedules``).

No torch and no torch.distributed here: everything is plain Python so it can be exhaustively
tested and used to plan a run before any process group exists.
"""

from lightning_pp.schedules.actions import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    WEIGHT_GRAD,
    Action,
    ActionKind,
    check_actions,
    split_backwards,
    stage_owner,
    virtual_stage,
)
from lightning_pp.schedules.costs import CostModel, StageCost, allreduce_time
from lightning_pp.schedules.plot import plot_timeline
from lightning_pp.schedules.render import ascii_timeline, chrome_trace, stats_table
from lightning_pp.schedules.simulator import SimulationResult, simulate
from lightning_pp.schedules.tables import (
    SCHEDULES,
    FUSED_SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    ScheduleConfig,
    all_rank_actions,
    config_for_batch,
    interleaved_table,
    make_config,
    rank_actions,
    warmup_count,
)

__all__ = [
    "Action",
    "ActionKind",
    "CostModel",
    "StageCost",
    "SimulationResult",
    "BACKWARD",
    "FORWARD",
    "FORWARD_BACKWARD",
    "WEIGHT_GRAD",
    "SCHEDULES",
    "FUSED_SCHEDULES",
    "V_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "ScheduleConfig",
    "check_actions",
    "split_backwards",
    "all_rank_actions",
    "config_for_batch",
    "allreduce_time",
    "ascii_timeline",
    "chrome_trace",
    "interleaved_table",
    "make_config",
    "plot_timeline",
    "rank_actions",
    "simulate",
    "stage_owner",
    "stats_table",
    "virtual_stage",
    "warmup_count",
]
