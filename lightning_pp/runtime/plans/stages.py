"""Where a stage is: Megatron's neighbour questions (``is_pp_first_stage``, ``get_pp_next_rank``,
...), part of the schedule-plan contract (a plan's hooks may ask them).

Without ``config`` they are Megatron's pipeline-rank questions (the pipeline as a ring of ranks).
With the schedule's ``config`` (a :class:`~lightning_pp.schedules.ScheduleConfig`) and a local chunk
``vp_stage`` they ask about that chunk's virtual stage under the schedule's placement: in a V (zbv,
dualpipev) rank 0 holds the first and the last stage, and the stage after rank r's second chunk is
on rank r - 1.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist


def _group_rank(pp_group) -> tuple[int, int]:
    return dist.get_rank(pp_group), dist.get_world_size(pp_group)


def _virtual_stage(pp_group, vp_stage: Optional[int], config) -> Optional[int]:
    if config is None or vp_stage is None:
        return None
    return config.stage_of(dist.get_rank(pp_group), vp_stage)


def is_pp_first_stage(pp_group, vp_stage: Optional[int] = None, config=None) -> bool:
    """Whether this rank is the first of its pipeline group (with ``config``: whether its chunk
    ``vp_stage`` is the model's first virtual stage)."""
    stage = _virtual_stage(pp_group, vp_stage, config)
    return _group_rank(pp_group)[0] == 0 if stage is None else stage == 0


def is_pp_last_stage(pp_group, vp_stage: Optional[int] = None, config=None) -> bool:
    """Whether this rank is the last of its pipeline group (with ``config``: whether its chunk
    ``vp_stage`` is the model's last virtual stage, where the loss is computed)."""
    stage = _virtual_stage(pp_group, vp_stage, config)
    if stage is None:
        rank, size = _group_rank(pp_group)
        return rank == size - 1
    return stage == config.num_stages - 1


def is_vp_first_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    """Whether ``vp_stage`` is a rank's first chunk (always, without virtual stages)."""
    return vp_size is None or vp_size <= 1 or vp_stage == 0


def is_vp_last_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    """Whether ``vp_stage`` is a rank's last chunk (always, without virtual stages)."""
    return vp_size is None or vp_size <= 1 or vp_stage == vp_size - 1


def _pp_global_rank(pp_group, group_rank: int) -> int:
    return dist.get_global_rank(pp_group, group_rank % dist.get_world_size(pp_group))


def get_pp_first_rank(pp_group) -> int:
    """Global rank of the first stage of this rank's pipeline."""
    return _pp_global_rank(pp_group, 0)


def get_pp_last_rank(pp_group, config=None) -> int:
    """Global rank of the last stage of this rank's pipeline (with ``config``: of the rank that
    holds the last virtual stage, rank 0 in a V)."""
    if config is not None:
        return _pp_global_rank(pp_group, config.last_stage_rank)
    return _pp_global_rank(pp_group, dist.get_world_size(pp_group) - 1)


def _neighbour(pp_group, vp_stage: Optional[int], config, step: int) -> Optional[int]:
    stage = _virtual_stage(pp_group, vp_stage, config)
    if stage is None:  # the ring of pipeline ranks
        return _pp_global_rank(pp_group, dist.get_rank(pp_group) + step)
    if not 0 <= stage + step < config.num_stages:
        return None
    return _pp_global_rank(pp_group, config.owner_of(stage + step)[0])


def get_pp_next_rank(pp_group, vp_stage: Optional[int] = None, config=None) -> Optional[int]:
    """Global rank of the next stage (a ring: the last stage's next is the first). With ``config``:
    the rank holding the virtual stage after this rank's chunk ``vp_stage``, ``None`` after the last."""
    return _neighbour(pp_group, vp_stage, config, 1)


def get_pp_prev_rank(pp_group, vp_stage: Optional[int] = None, config=None) -> Optional[int]:
    """Global rank of the previous stage (ring). With ``config``: the rank holding the virtual stage
    before this rank's chunk ``vp_stage``, ``None`` before the first."""
    return _neighbour(pp_group, vp_stage, config, -1)


__all__ = [
    "get_pp_first_rank", "get_pp_last_rank", "get_pp_next_rank", "get_pp_prev_rank", "is_pp_first_stage",
    "is_pp_last_stage", "is_vp_first_stage", "is_vp_last_stage",
]
