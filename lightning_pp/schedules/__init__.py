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
from lightning_pp.schedules.actions import backward, forward, forward_backward, weight_grad
from lightning_pp.schedules.registry import (
    ScheduleSpec,
    register_schedule,
    schedule_names,
    schedule_spec,
    unregister_schedule,
)
from lightning_pp.schedules.tables import (
    ScheduleConfig,
    default_num_microbatches,
    all_rank_actions,
    config_for_batch,
    interleaved_table,
    make_config,
    RankPlan,
    rank_actions,
    rank_plan,
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
    "ScheduleSpec",
    "backward",
    "default_num_microbatches",
    "forward",
    "forward_backward",
    "register_schedule",
    "schedule_names",
    "schedule_spec",
    "unregister_schedule",
    "weight_grad",
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
    "RankPlan",
    "rank_actions",
    "rank_plan",
    "simulate",
    "stage_owner",
    "stats_table",
    "virtual_stage",
    "warmup_count",
]

#: Names derived from the registry when read (a schedule registered later is included).
_DERIVED = {
    "SCHEDULES": lambda spec: True,  # every schedule
    "V_SCHEDULES": lambda spec: spec.placement == "v",  # two chunks per rank in a V
    "FUSED_SCHEDULES": lambda spec: spec.fused,  # FB actions: chunks run through schedule plans
    "ZERO_BUBBLE_SCHEDULES": lambda spec: spec.splits_backward,  # B and W split
}


def __getattr__(name: str):
    if name in _DERIVED:
        return tuple(n for n in schedule_names() if _DERIVED[name](schedule_spec(n)))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
