"""Pure pipeline schedules: per-rank action tables, validation and a simulator.

No torch and no torch.distributed here: everything is plain Python so it can be exhaustively
tested and used to plan a run before any process group exists.
"""

from lightning_pp.schedules.actions import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    WEIGHT_GRAD,
    Action,
    stage_owner,
    virtual_stage,
)
from lightning_pp.schedules.tables import (
    SCHEDULES,
    ScheduleConfig,
    all_rank_actions,
    interleaved_table,
    make_config,
    rank_actions,
    warmup_count,
)

__all__ = [
    "Action",
    "BACKWARD",
    "FORWARD",
    "FORWARD_BACKWARD",
    "WEIGHT_GRAD",
    "SCHEDULES",
    "ScheduleConfig",
    "all_rank_actions",
    "interleaved_table",
    "make_config",
    "rank_actions",
    "stage_owner",
    "virtual_stage",
    "warmup_count",
]
