"""The schedules, one spec each, in one registry: everything the package decides per schedule
(placement of the chunks, which chunk counts it runs, whether its tables fuse F&B or split B/W,
its own rules, the schedule a too-short batch falls back to, the table function) is read from
here, by the validator, the tables, the runtime, the simulator, the CLI and the strategies.

A schedule of your own is one :class:`ScheduleSpec` and one call::

    from lightning_pp.schedules import ScheduleSpec, register_schedule, forward, backward

    def gpipe_lifo(cfg, rank):
        # every forward, then the backwards newest first
        order = [(mb, chunk) for chunk in range(cfg.vp) for mb in range(cfg.num_microbatches)]
        return [forward(*f) for f in order] + [backward(mb, cfg.vp - 1 - c) for mb, c in reversed(order)]

    register_schedule(ScheduleSpec("gpipe_lifo", gpipe_lifo, description="GPipe, backwards newest first"))

after which ``schedule="gpipe_lifo"`` works in ``make_config``, the simulator, the CLI
(``python -m lightning_pp.schedules``, in the process that registered it), ``build_pipeline`` and
both strategies. The table is checked (:func:`~lightning_pp.schedules.actions.check_actions`)
when the configuration is made.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

# (The registry imports nothing of the package: tables.py, which defines ScheduleConfig and the
# built-in specs, imports it.)
#: A rank's training actions for a configuration: ``actions(cfg, rank) -> list[Action]``, ``cfg``
#: a :class:`~lightning_pp.schedules.tables.ScheduleConfig`.
TableFunction = Callable[[Any, int], list]
#: A rule of a schedule's own: the reason (and the fix) a configuration is invalid, or ``None``.
Rule = Callable[[Any], Optional[str]]


# Ready-made ``chunks`` rules (the reason a chunk count is invalid, or None) and ``interleaved``
# predicates for specs; the built-in schedules use them (tables.py).
def any_chunks(vp: int) -> Optional[str]:
    return None


def one_chunk(vp: int) -> Optional[str]:
    if vp == 1:
        return None
    return f"1F1B runs one chunk per rank (vp=1). Use schedule='interleaved' for vp={vp}, or set vp=1."


def two_chunks_or_more(vp: int) -> Optional[str]:
    if vp >= 2:
        return None
    return "interleaving needs at least 2 chunks per rank. Use vp=2, or schedule='1f1b' for vp=1."


def a_v(vp: int) -> Optional[str]:
    if vp == 2:
        return None
    return (f"a V schedule runs exactly 2 chunks per rank (stages r and 2 * pp - 1 - r). Use vp=2, or "
            f"schedule='zb1p' for vp={vp}.")


def grouped_when_chunked(vp: int) -> bool:
    return vp > 1


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule.

    Args:
        name: what users pass as ``schedule=``.
        actions: the table function, ``actions(cfg, rank)``: the rank's training actions (forward
            ``F``, backward ``B``, fused ``FB``, weight gradient ``W``) in order; the evaluation
            order is its forwards, in order.
        description: one line, shown by the CLI and the strategies' registrations.
        placement: ``"loop"`` (local chunk ``c`` of rank ``r`` is stage ``c * pp + r``) or ``"v"``
            (two chunks: stages ``r`` and ``2 * pp - 1 - r``).
        chunks: the reason a chunk count ``vp`` cannot run, with the fix, or ``None`` if it can.
        fused: the tables hold ``FB`` actions; the runtime runs the chunks through their schedule
            plans so one microbatch's forward overlaps another's backward.
        splits_backward: the tables split backwards into ``B`` and ``W``.
        interleaved: whether a chunk count uses Megatron's grouped interleaved order (whose rules
            on ``microbatch_group_size`` and the microbatch count then apply).
        rule: a further rule of the schedule's own (see :data:`Rule`).
        fallback: the schedule a batch with too few samples for this one runs instead (on the same
            chunks, so with the same placement); ``None``: ``"gpipe"`` for the loop placement,
            ``"zbv"`` for the V.
        default_vp: the chunks per rank its strategy name (``pp_<name>``) and the CLI default to.
        warmup: forwards before the first non-forward of ``rank`` (``None``: counted in the table).
        check_tables: check every rank's table (:func:`~lightning_pp.schedules.actions.check_actions`:
            kinds, ids in range, each ``W`` after its ``B``) whenever a configuration is made; the
            built-ins, checked exhaustively by the tests, skip it.
    """

    name: str
    actions: TableFunction
    description: str = ""
    placement: str = "loop"
    chunks: Callable[[int], Optional[str]] = any_chunks
    fused: bool = False
    splits_backward: bool = False
    interleaved: Callable[[int], bool] = lambda vp: False
    rule: Optional[Rule] = None
    fallback: Optional[str] = None
    default_vp: int = 1
    warmup: Optional[Callable[[Any, int], int]] = None
    check_tables: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_]+", self.name):
            raise ValueError(f"ScheduleSpec name={self.name!r} is invalid: use letters, digits and '_', e.g. "
                             f"'my_1f1b' (it also names the strategy 'pp_<name>').")
        if self.placement not in ("loop", "v"):
            raise ValueError(f"ScheduleSpec placement={self.placement!r} is invalid: use 'loop' or 'v'.")
        if not callable(self.actions):
            raise ValueError(f"ScheduleSpec actions={self.actions!r} is invalid: give a function (cfg, rank) -> actions.")

    @property
    def fallback_name(self) -> str:
        if self.fallback is not None:
            return self.fallback
        return "zbv" if self.placement == "v" else "gpipe"

    def __reduce__(self):
        # Pickled by name (a spec's functions may be lambdas): a configuration sent to another
        # process (a spawned launcher) finds the spec registered under that name there.
        return schedule_spec, (self.name,)


_REGISTRY: dict[str, ScheduleSpec] = {}
#: Called as ``listener(name, spec)`` after every registration and as ``listener(name, None)`` after
#: every removal: how the strategies keep ``pp_<name>`` in step with the registry, whether Lightning
#: was imported before or after a schedule was registered (this module imports nothing above it).
_LISTENERS: list[Callable[[str, Optional["ScheduleSpec"]], None]] = []


def watch_registry(listener: Callable[[str, Optional["ScheduleSpec"]], None]) -> None:
    """Call ``listener(name, spec)`` after each :func:`register_schedule` and ``listener(name, None)``
    after each :func:`unregister_schedule` (once per listener, however often it is passed)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def register_schedule(spec: ScheduleSpec, replace: bool = False) -> ScheduleSpec:
    """Add ``spec`` to the registry (``replace=True`` to redefine a name). Returns it."""
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"register_schedule takes a ScheduleSpec, not {type(spec).__name__}.")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"schedule {spec.name!r} is already registered: pick another name, or pass replace=True.")
    _REGISTRY[spec.name] = spec
    for listener in _LISTENERS:
        listener(spec.name, spec)
    return spec


def unregister_schedule(name: str) -> None:
    """Remove a schedule registered with :func:`register_schedule`."""
    if _REGISTRY.pop(name, None) is not None:
        for listener in _LISTENERS:
            listener(name, None)


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule ``name``; ``ValueError`` naming the known ones otherwise."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"schedule={name!r} is not a known schedule: choose one of {', '.join(_REGISTRY)}.")
    return spec


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule, in registration order (the built-ins first)."""
    return tuple(_REGISTRY)
