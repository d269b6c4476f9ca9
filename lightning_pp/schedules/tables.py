"""Per-rank action tables for every schedule, and the rules that make a configuration valid.

This module is the one place that decides the order of compute on each pipeline rank. The runtime
executes these lists, the monitor compares measurements to their simulation, and the CLI prints
them; nothing else invents an order.

Schedules (``pp`` = pipeline ranks, ``vp`` = chunks per rank, ``m`` = microbatches):

``gpipe``
    All forwards, then all backwards. Baseline; holds every microbatch's activations.
``1f1b``
    ``vp == 1``. Rank ``r`` warms up with ``min(pp - r - 1, m)`` forwards, then alternates one
    forward and one backward, then drains the remaining backwards. Stage ``r`` keeps at most
    ``min(pp - r, m)`` microbatches in flight.
``interleaved``
    ``vp >= 2``. Megatron's interleaved 1F1B: microbatches are taken in groups of
    ``microbatch_group_size`` (default ``pp``), every microbatch of a group runs chunk 0, then chunk
    1, ...; backwards mirror this with the chunk order reversed. Warm-up on rank ``r`` is
    ``2 * (pp - r - 1) + (vp - 1) * group``.
``combined_1f1b``
    The interleaved warm-up (``2 * (pp - r - 1) + (vp - 1) * group``, also for ``vp == 1``) plus one
    extra forward, and every steady-state forward/backward pair merged into one ``FB`` action so
    that the forward of one microbatch can overlap the backward of another. The extra warm-up
    makes the two halves of each ``FB`` independent. It holds more activations than 1F1B: up to
    ``2 * (pp - r) `` microbatches on rank ``r`` with ``vp == 1``.
``zb1p``, ``zbv``, ``dualpipev``
    The zero-bubble schedules (backward split into ``B`` and a deferred ``W``): ZB-H1 (any ``vp``;
    interleaved for ``vp >= 2``), ZB-V and DeepSeek's DualPipeV (both ``vp == 2`` in a V, see
    :attr:`ScheduleConfig.placement`). Their tables and orders are in
    :mod:`lightning_pp.schedules.zero_bubble`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_pp.schedules.actions import (
    FORWARD,
    Action,
    backward,
    forward,
    forward_backward,
    stage_owner,
    virtual_stage,
)
from lightning_pp.schedules.actions import check_actions, check_complete, split_backwards
from lightning_pp.schedules.messages import Message, delivery_marks, send_order
from lightning_pp.schedules.registry import (
    ScheduleSpec,
    a_v,
    grouped_when_chunked,
    one_chunk,
    register_schedule,
    schedule_names,
    schedule_spec,
    two_chunks_or_more,
)
from lightning_pp.schedules.zero_bubble import dualpipev_actions, zb1p_actions, zbv_actions


@dataclass(frozen=True)
class ScheduleConfig:
    """A validated pipeline configuration. Build it with :func:`make_config` (or call
    :meth:`validate`) so that bad input is rejected with a message before anything runs."""

    schedule: str
    pp: int
    vp: int
    num_microbatches: int
    microbatch_group_size: Optional[int] = None  # interleaved grouping; None -> pp
    # The spec, taken from the registry once, when the configuration is made: a configuration
    # keeps meaning what it meant if the registry changes later.
    _spec: Optional[ScheduleSpec] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self._spec is None and isinstance(self.schedule, str) and self.schedule in schedule_names():
            object.__setattr__(self, "_spec", schedule_spec(self.schedule))

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's spec (:mod:`lightning_pp.schedules.registry`), as registered when this
        configuration was made."""
        return self._spec if self._spec is not None else schedule_spec(self.schedule)

    @property
    def group_size(self) -> int:
        return self.microbatch_group_size if self.microbatch_group_size is not None else self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.vp

    @property
    def placement(self) -> str:
        """Where virtual stages live. ``"loop"`` (Megatron's interleaved placement): local chunk
        ``c`` of rank ``r`` is stage ``c * pp + r``. ``"v"`` (the V-shaped schedules, two chunks per
        rank): chunk 0 of rank ``r`` is stage ``r`` and chunk 1 is stage ``2 * pp - 1 - r``, so rank
        0 holds the first and the last stage."""
        return self.spec.placement

    def stage_of(self, rank: int, chunk: int) -> int:
        """Global virtual stage of local ``chunk`` on pipeline ``rank``."""
        return virtual_stage(rank, chunk, self.pp, self.placement)

    def owner_of(self, stage: int) -> tuple[int, int]:
        """(pipeline rank, local chunk) that holds virtual ``stage``."""
        return stage_owner(stage, self.pp, self.placement)

    @property
    def last_stage_rank(self) -> int:
        """The pipeline rank that holds the last virtual stage (where the loss is computed)."""
        return self.owner_of(self.num_stages - 1)[0]

    @property
    def is_interleaved(self) -> bool:
        """Whether the table uses Megatron's grouped interleaved order."""
        return self.spec.interleaved(self.vp)

    def validate(self) -> "ScheduleConfig":
        _validate(self)
        return self


def default_num_microbatches(pp: int) -> int:
    """The microbatch count when none is given: ``2 * pp``, enough to fill every schedule's
    pipeline (DualPipeV needs one per virtual stage) while keeping microbatches large."""
    return 2 * pp


def make_config(
    schedule: str,
    pp: int,
    vp: int = 1,
    num_microbatches: Optional[int] = None,
    microbatch_group_size: Optional[int] = None,
) -> ScheduleConfig:
    """Validated :class:`ScheduleConfig`; ``num_microbatches`` defaults to
    :func:`default_num_microbatches`."""
    if num_microbatches is None and isinstance(pp, int) and not isinstance(pp, bool):
        num_microbatches = default_num_microbatches(pp)
    return ScheduleConfig(schedule, pp, vp, num_microbatches, microbatch_group_size).validate()


def positive_int(name: str, value, hint: str) -> None:
    """Raise ``ValueError`` naming ``name``, the value, the rule and ``hint`` (the fix) unless
    ``value`` is an ``int`` >= 1 (``True`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer (>= 1). {hint}")


def _validate(cfg: ScheduleConfig) -> None:
    spec = schedule_spec(cfg.schedule)  # names the known schedules
    positive_int("pipeline_parallel_size (pp)", cfg.pp, "Use pp=1 for no pipelining.")
    positive_int("virtual_pipeline_size (vp)", cfg.vp, "Use vp=1 for one chunk per rank.")
    positive_int(
        "num_microbatches",
        cfg.num_microbatches,
        f"Use at least pp={cfg.pp if isinstance(cfg.pp, int) else '?'} microbatches, e.g. 2 * pp.",
    )
    reason = spec.chunks(cfg.vp)
    if reason is not None:
        raise ValueError(f"virtual_pipeline_size={cfg.vp} is invalid for schedule={cfg.schedule!r}: {reason}")
    if cfg.microbatch_group_size is not None:
        positive_int("microbatch_group_size", cfg.microbatch_group_size, f"Use the default (pp={cfg.pp}).")
        if not cfg.is_interleaved:
            raise ValueError(
                f"microbatch_group_size={cfg.microbatch_group_size} only applies to interleaved "
                f"schedules (vp >= 2), not schedule={cfg.schedule!r} with vp={cfg.vp}. Leave it unset."
            )
    if spec.rule is not None:
        reason = spec.rule(cfg)
        if reason is not None:
            raise ValueError(reason)
    if cfg.is_interleaved:
        _validate_interleaved(cfg)
    if spec.check_tables:
        tables = [spec.actions(cfg, rank) for rank in range(cfg.pp)]
        check_actions(cfg, tables)
        check_complete(cfg, tables)


def _validate_interleaved(cfg: ScheduleConfig) -> None:
    """Megatron's grouping rules, for every schedule with the grouped interleaved order."""
    m, p, n = cfg.num_microbatches, cfg.pp, cfg.group_size
    if n < p:
        raise ValueError(
            f"microbatch_group_size={n} is invalid for pp={p}: an interleaved group must hold at "
            f"least pp microbatches (group >= pp) or the ring of stages stalls. Use "
            f"microbatch_group_size={p}."
        )
    if m < p:
        raise ValueError(
            f"num_microbatches={m} is invalid for schedule={cfg.schedule!r} with pp={p}, vp={cfg.vp}: "
            f"interleaving needs num_microbatches >= pp. Use num_microbatches={p} (or {2 * p})."
        )
    if cfg.microbatch_group_size is not None and n > m:
        raise ValueError(
            f"microbatch_group_size={n} is larger than num_microbatches={m}: a group cannot hold "
            f"more microbatches than the step has. Use microbatch_group_size<={m}, e.g. {p}."
        )
    n = min(n, m)
    remainder = m % n
    if remainder != 0 and remainder < p:
        fix_up = m + (p - remainder)
        fix_down = m - remainder
        raise ValueError(
            f"num_microbatches={m} is invalid for schedule={cfg.schedule!r} with pp={p}, "
            f"microbatch_group_size={n}: the last group would hold {remainder} microbatches, and a "
            f"partial group must hold 0 or at least pp={p} (num_microbatches % group in "
            f"{{0}} or [{p}, {n})). Use num_microbatches={fix_down} or {fix_up}."
        )


def config_for_batch(cfg: ScheduleConfig, batch_size: int) -> ScheduleConfig:
    """The configuration a step whose batch holds ``batch_size`` samples runs.

    ``cfg`` itself when the batch has at least ``cfg.num_microbatches`` samples. A smaller batch
    (the last batch of an epoch with ``drop_last=False``) runs the same schedule with the most
    microbatches it allows (at most one sample each), or, where that schedule cannot run so few
    (interleaving needs at least ``pp``), its spec's fallback over the same chunks: GPipe for the
    loop placement, ZB-V for the V (DualPipeV needs ``2 * pp``; ZB-V keeps the V and runs any
    count). Gradients are those of the whole batch either way: only the order, the bubble and the
    activation memory differ."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"a batch of size {batch_size!r} cannot be run: a step needs at least one sample.")
    if batch_size >= cfg.num_microbatches:
        return cfg
    for count in range(batch_size, 0, -1):
        group = cfg.microbatch_group_size
        if group is not None:
            group = max(min(group, count), cfg.pp)
        try:
            return ScheduleConfig(cfg.schedule, cfg.pp, cfg.vp, count, group, cfg.spec).validate()
        except ValueError:
            continue
    # The fallback must keep the placement: the model's chunks are already built for it.
    return ScheduleConfig(cfg.spec.fallback_name, cfg.pp, cfg.vp, batch_size).validate()


def interleaved_table(microbatches: int, vp: int, group_size: int) -> list[tuple[int, int]]:
    """Megatron's forward order of (microbatch, chunk) for one rank: groups of ``group_size``
    microbatches; inside a group every microbatch on chunk 0, then on chunk 1, ..."""
    table = []
    for start in range(0, microbatches, group_size):
        group = range(start, min(start + group_size, microbatches))
        for chunk in range(vp):
            table.extend((mb, chunk) for mb in group)
    return table


def warmup_count(cfg: ScheduleConfig, rank: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (before the steady state)."""
    spec = cfg.spec
    if spec.warmup is not None:
        return spec.warmup(cfg, rank)
    actions = rank_actions(cfg, rank)
    return next((i for i, a in enumerate(actions) if a.kind != FORWARD), len(actions))


def _one_f_one_b_warmup(cfg: ScheduleConfig, rank: int) -> int:
    """The warm-up of the 1F1B family (1f1b, interleaved, combined_1f1b, gpipe) and of ZB-H1."""
    total = cfg.num_microbatches * cfg.vp
    if cfg.schedule == "gpipe":
        return total
    if cfg.schedule == "zb1p":
        # Interleaved warm-up with one hop per rank (torch's InterleavedZeroBubble): the B that
        # follows is only the input gradient, so it comes back faster than a full backward.
        warmup = cfg.pp - rank - 1 + (cfg.vp - 1) * min(cfg.group_size, cfg.num_microbatches)
    elif cfg.is_interleaved or cfg.schedule == "combined_1f1b":
        # Combined 1F1B uses the interleaved warm-up even with one chunk per rank: with plain
        # 1F1B's (pp - r - 1) + 1, every rank's FB at step k would wait for its neighbour's FB of
        # the same step and the ranks would take turns (measured in the simulator: pp=4, m=8
        # takes 51 units instead of 33). The factor 2 lets B(k) arrive one step early.
        warmup = 2 * (cfg.pp - rank - 1) + (cfg.vp - 1) * min(cfg.group_size, cfg.num_microbatches)
    else:
        warmup = cfg.pp - rank - 1
    if cfg.schedule == "combined_1f1b":
        warmup += 1
    return min(warmup, total)


def _forward_order(cfg: ScheduleConfig) -> list[tuple[int, int]]:
    if cfg.is_interleaved:
        return interleaved_table(cfg.num_microbatches, cfg.vp, min(cfg.group_size, cfg.num_microbatches))
    # Chunk-major: every microbatch through chunk 0, then chunk 1, ... (vp == 1 for 1f1b).
    return [(mb, chunk) for chunk in range(cfg.vp) for mb in range(cfg.num_microbatches)]


def _one_f_one_b_actions(cfg: ScheduleConfig, rank: int) -> list[Action]:
    """Warm-up forwards, then one forward and one backward (fused into ``FB`` for combined 1F1B),
    then the remaining backwards; the backward order mirrors the forward order with the chunk
    order reversed."""
    fwd = _forward_order(cfg)
    bwd = [(mb, cfg.vp - 1 - chunk) for mb, chunk in fwd]
    total = len(fwd)
    warmup = _one_f_one_b_warmup(cfg, rank)
    actions = [forward(*fwd[k]) for k in range(warmup)]
    steady = total - warmup
    for k in range(steady):
        if cfg.schedule == "combined_1f1b":
            actions.append(forward_backward(fwd[k + warmup], bwd[k]))
        else:
            actions.append(forward(*fwd[k + warmup]))
            actions.append(backward(*bwd[k]))
    actions.extend(backward(*bwd[k]) for k in range(steady, total))
    return actions


def _zb1p_actions(cfg: ScheduleConfig, rank: int) -> list[Action]:
    # ZB-H1: rank r holds r weight gradients back (the paper's "W lag"), rank 0 none.
    return zb1p_actions(_forward_order(cfg), _one_f_one_b_warmup(cfg, rank), lag=rank)


def rank_actions(cfg: ScheduleConfig, rank: int, forward_only: bool = False) -> list[Action]:
    """The ordered actions of pipeline rank ``rank`` (the schedule spec's table function).

    ``forward_only`` gives the evaluation/prediction order: every forward in the schedule's
    forward order and nothing else.
    """
    if not 0 <= rank < cfg.pp:
        raise ValueError(f"rank={rank} is out of range for pp={cfg.pp}: use 0 <= rank < {cfg.pp}.")
    actions = cfg.spec.actions(cfg, rank)
    if forward_only:
        return [forward(*a.forward_part()) for a in actions if a.forward_part() is not None]
    return actions


def all_rank_actions(cfg: ScheduleConfig, forward_only: bool = False) -> list[list[Action]]:
    """Action lists of every pipeline rank, index = rank."""
    return [rank_actions(cfg, rank, forward_only) for rank in range(cfg.pp)]


@dataclass(frozen=True)
class RankPlan:
    """What pipeline rank ``rank`` runs for one configuration: the table the runtime executes."""

    config: ScheduleConfig
    actions: list[Action]  # training actions, in order
    eval_actions: list[Action]  # forward-only actions, in order
    expected: dict[bool, dict[int, list[Message]]]  # forward_only -> {neighbour pipeline rank: its send order here}
    deferred: frozenset[tuple[int, int]]  # (microbatch, chunk) whose weight gradient is a W action
    marks: dict[bool, tuple[dict, dict]]  # forward_only -> messages.delivery_marks


def rank_plan(cfg: ScheduleConfig, rank: int) -> RankPlan:
    """Rank ``rank``'s actions for ``cfg``, training and forward-only, with the order in which each
    other rank sends to it (:mod:`lightning_pp.schedules.messages`)."""
    expected, marks = {}, {}
    for forward_only in (False, True):  # every other rank that sends here, and its order
        tables = all_rank_actions(cfg, forward_only)
        orders = {src: send_order(cfg, src, tables[src], rank) for src in range(cfg.pp) if src != rank}
        expected[forward_only] = {src: order for src, order in orders.items() if order}
        marks[forward_only] = delivery_marks(cfg, rank, tables)
    actions = rank_actions(cfg, rank)
    return RankPlan(cfg, actions, rank_actions(cfg, rank, forward_only=True), expected,
                    frozenset(split_backwards(actions)), marks)


# -- the built-in schedules ------------------------------------------------------------------------
def _fills_its_v(cfg: ScheduleConfig) -> Optional[str]:
    if cfg.num_microbatches >= 2 * cfg.pp:
        return None
    return (f"num_microbatches={cfg.num_microbatches} is invalid for schedule='dualpipev' with pp={cfg.pp}: "
            f"DualPipeV needs num_microbatches >= 2 * pp = {2 * cfg.pp} (one per virtual stage) to fill its V. "
            f"Use num_microbatches={2 * cfg.pp}, or schedule='zbv' for fewer.")


for _spec in (
    ScheduleSpec("1f1b", _one_f_one_b_actions, "1F1B: warm-up forwards, then one forward and one backward",
                 chunks=one_chunk, warmup=_one_f_one_b_warmup, check_tables=False),
    ScheduleSpec("interleaved", _one_f_one_b_actions, "Megatron's interleaved 1F1B (vp >= 2)",
                 chunks=two_chunks_or_more, interleaved=lambda vp: True, default_vp=2, warmup=_one_f_one_b_warmup,
                 check_tables=False),
    ScheduleSpec("combined_1f1b", _one_f_one_b_actions,
                 "combined 1F1B: one microbatch's forward fused with another's backward (FB)", fused=True,
                 interleaved=grouped_when_chunked, warmup=_one_f_one_b_warmup, check_tables=False),
    ScheduleSpec("gpipe", _one_f_one_b_actions, "GPipe: all forwards, then all backwards", warmup=_one_f_one_b_warmup,
                 check_tables=False),
    ScheduleSpec("zb1p", _zb1p_actions, "ZB-H1: backward split into B and a deferred W", splits_backward=True,
                 interleaved=grouped_when_chunked, warmup=_one_f_one_b_warmup, check_tables=False),
    ScheduleSpec("zbv", lambda cfg, rank: zbv_actions(cfg.pp, rank, cfg.num_microbatches),
                 "ZB-V: zero-bubble in a V (vp = 2)", placement="v", chunks=a_v, splits_backward=True, default_vp=2,
                 check_tables=False),
    ScheduleSpec("dualpipev", lambda cfg, rank: dualpipev_actions(cfg.pp, rank, cfg.num_microbatches),
                 "DualPipeV: fused F&B in a V with split backwards (vp = 2)", placement="v", chunks=a_v, fused=True,
                 splits_backward=True, rule=_fills_its_v, default_vp=2, check_tables=False),
):
    register_schedule(_spec)
