"""How a model is pipelined: one frozen, typed configuration, the one declaration of every option.

The strategies' typed constructor arguments (which LightningCLI reads) mirror these fields, held to
them by a test (names, defaults, annotations); ``build_pipeline`` takes them by name. A
configuration that cannot work fails when it is made, before any process group exists; the checks
that need the world size run in :meth:`PipelineConfig.resolve`, which gives the
:class:`ResolvedPipeline` (the sizes and the validated schedule) that the runtime takes whole.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Literal, Optional, Union

from lightning_pp.runtime.compile.layers import CompileOption, check_compile_option
from lightning_pp.runtime.cut.layout import AutoLayout, Layout, auto_layout_of, check_layout_option
from lightning_pp.runtime.failure.watchdog import WatchdogConfig
from lightning_pp.runtime.layer import CheckpointPolicy, checkpointed_layers
from lightning_pp.runtime.dp.sharding import DataParallelSharding, check_sharding_mode
from lightning_pp.runtime.topology import ParallelDims
from lightning_pp.schedules import ScheduleConfig, default_num_microbatches, make_config, schedule_spec
from lightning_pp.schedules.tables import positive_int

# Every option's type is importable from here (tests/test_options.py), with the configuration.
__all__ = [
    "AutoLayout", "BatchCheck", "CheckpointPolicy", "CompileOption", "DataParallelSharding", "DEFAULT_TIMEOUT",
    "Layout", "NonFinitePolicy", "ParallelDims", "PipelineConfig", "ResolvedPipeline", "STRATEGY_NAMES",
    "WatchdogConfig", "arguments_docstring", "option_descriptions",
]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=600)
NonFinitePolicy = Literal["raise", "skip", "ignore"]
NONFINITE_POLICIES: tuple = NonFinitePolicy.__args__
BatchCheck = Literal["raise", "warn", "off"]
BATCH_CHECKS: tuple = BatchCheck.__args__
#: Strategy constructor arguments whose PipelineConfig field has another name (the strategies'
#: own ``timeout`` is the process group's, as in Lightning's DDP strategy).
STRATEGY_NAMES = {"timeout": "pipeline_timeout", "watchdog": "pipeline_watchdog"}


def check_nonfinite_policy(nonfinite: str) -> None:
    """Raise ``ValueError`` unless ``nonfinite`` is one of :data:`NONFINITE_POLICIES`."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r} is invalid: choose one of {', '.join(map(repr, NONFINITE_POLICIES))}.")


def check_batch_policy(check_batches: str, broadcast_batches: bool) -> None:
    """Raise ``ValueError`` unless the batch options are valid."""
    if check_batches not in BATCH_CHECKS:
        raise ValueError(f"check_batches={check_batches!r} is invalid: choose one of {', '.join(map(repr, BATCH_CHECKS))}.")
    if not isinstance(broadcast_batches, bool):
        raise ValueError(f"broadcast_batches={broadcast_batches!r} is invalid: pass True or False.")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Every option of a pipeline (see ``build_pipeline`` and the strategies for the prose)."""

    pipeline_parallel_size: Optional[int] = None
    """Pipeline stages; default: the world size divided by ``expert_parallel_size``."""
    expert_parallel_size: int = 1
    """Ranks per expert-parallel group (inside one stage)."""
    tensor_parallel_size: int = 1
    """Ranks per tensor-parallel group (inside one stage, consecutive ranks): the world is
    pipeline x data x tensor parallel. The layers are split by the user's ``parallelize_module``
    calls over ``self.device_mesh["tensor_parallel"]`` in ``configure_model`` (``docs/tensor_parallel.md``)."""
    virtual_pipeline_size: Optional[int] = None
    """Model chunks per rank; default: the schedule's own (2 for ``interleaved``, ``zbv`` and
    ``dualpipev``, whose stages sit in a V; 1 for the others)."""
    num_microbatches: Optional[int] = None
    """Microbatches per batch; default: twice the pipeline size."""
    schedule: str = "1f1b"
    """``"1f1b"``, ``"interleaved"``, ``"combined_1f1b"``, ``"gpipe"``, or a zero-bubble schedule:
    ``"zb1p"`` (ZB-H1), ``"zbv"`` or ``"dualpipev"`` (two chunks per rank, stages in a V); or one
    registered with ``lightning_pp.schedules.register_schedule``."""
    layout: Layout = None
    """Layers per virtual stage: a list or a Megatron-style string; default: balanced; ``"auto"`` (or an
    :class:`~lightning_pp.runtime.cut.layout.AutoLayout` with a memory budget): chosen from each layer's
    measured costs and memory by the schedule's simulator (see :mod:`lightning_pp.runtime.measure`)."""
    microbatch_group_size: Optional[int] = None
    """Interleaved grouping of microbatches; default: the pipeline size."""
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    """How long any wait of a step (a stage-boundary transfer or an in-step collective) may last
    before the step fails, naming the rank that stalled. Keep it well above the longest legitimate
    wait (about one step) and below the process group's ``timeout``."""
    nonfinite: NonFinitePolicy = "raise"
    """What a step whose loss or gradients hold inf/nan does, decided alike on every rank:
    ``"raise"`` (``NonFiniteError`` at that step), ``"skip"`` (its gradients are dropped so the
    optimizer step changes nothing; a warning says so) or ``"ignore"``."""
    watchdog: Union[bool, WatchdogConfig] = True
    """Run the per-process watchdog thread that publishes this rank's position (so peers can name a
    killed or stuck rank) and ends the process if it stays blocked after another rank failed (see
    ``lightning_pp.runtime.failure``); or a ``WatchdogConfig``."""
    activation_checkpointing: CheckpointPolicy = False
    """Pipeline layers that keep only their inputs and recompute their forward during backward:
    ``True`` (every layer except those that communicate, such as MoE blocks), ``False``, or a list
    of layer classes, e.g. ``[TransformerBlock]``."""
    static_shapes: bool = True
    """``True`` when what crosses a stage boundary has shapes that follow from the batch's shapes,
    so a step that repeats the previous step's batch shapes sends no shape headers; ``False`` for
    layers whose output shapes depend on the data."""
    check_batches: BatchCheck = "raise"
    """Compare, every step, a fingerprint of the batch each stage of a pipeline loaded (it rides on
    the loss all-reduce): ``"raise"``, ``"warn"`` or ``"off"``. Stages given different batches
    (rank-dependent randomness in the data pipeline) would pair one sample's inputs with another's
    targets."""
    broadcast_batches: bool = False
    """Use pipeline rank 0's batch on every stage (one broadcast per step), for data pipelines that
    cannot give every stage the same batch."""
    data_parallel_sharding: DataParallelSharding = "none"
    """``"full"``: each stage's parameters, gradients and optimizer state sharded over its
    data-parallel replicas with FSDP2 (experts over the expert-data-parallel ones; ``docs/sharding.md``);
    ``"none"``: whole."""
    compile: CompileOption = False
    """Compile each pipeline layer in place with ``torch.compile``: ``True`` (inductor), ``False``, or
    ``torch.compile``'s keyword arguments, e.g. ``{"mode": "max-autotune"}``; backward split for the
    zero-bubble schedules (``docs/compile.md``)."""

    def __post_init__(self) -> None:
        check_nonfinite_policy(self.nonfinite)
        check_batch_policy(self.check_batches, self.broadcast_batches)
        check_sharding_mode(self.data_parallel_sharding)
        check_compile_option(self.compile)
        check_layout_option(self.layout)
        schedule_spec(self.schedule)  # a known schedule (names them otherwise)
        if not isinstance(self.static_shapes, bool):
            raise ValueError(f"static_shapes={self.static_shapes!r} is invalid: pass True or False.")
        if not isinstance(self.timeout, datetime.timedelta) or self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={self.timeout!r} is invalid: give a positive datetime.timedelta, "
                             f"e.g. datetime.timedelta(minutes=10).")
        if not isinstance(self.watchdog, (bool, WatchdogConfig)):
            raise ValueError(f"watchdog={self.watchdog!r} is invalid: pass True, False or a WatchdogConfig.")
        checkpointed_layers([], self.activation_checkpointing)  # the policy's form; its layers at the cut
        positive_int("tensor_parallel_size", self.tensor_parallel_size, "Use 1 for no tensor parallelism.")
        if self.pipeline_parallel_size is not None:
            self._schedule(self.pipeline_parallel_size)  # validates the schedule with its sizes
        else:  # the sizes that need no pipeline size; the rest when the world size is known (resolve)
            fixes = {"expert_parallel_size": "1 for no expert parallelism",
                     "tensor_parallel_size": "1 for no tensor parallelism",
                     "virtual_pipeline_size": "None (the schedule's own chunk count)",
                     "num_microbatches": "2 * pipeline_parallel_size", "microbatch_group_size": "None (the pipeline size)"}
            for name, fix in fixes.items():
                value = getattr(self, name)
                if value is not None:
                    positive_int(name, value, f"Use e.g. {fix}.")

    def _refuse_with_tensor_parallel(self) -> None:
        """The options that do not combine with ``tensor_parallel_size > 1`` yet (issue 37)."""
        if self.tensor_parallel_size == 1:
            return
        combos = {"data_parallel_sharding": (self.data_parallel_sharding != "none", "'none'"),
                  "expert_parallel_size": (self.expert_parallel_size != 1, "1"),
                  "compile": (self.compile is not False, "False"),
                  "layout": (auto_layout_of(self.layout) is not None, "a list or None")}
        for name, (given, fix) in combos.items():
            if given:
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} with {name}={getattr(self, name)!r} is not "
                    f"supported yet: tensor parallelism inside pipeline stages does not combine with it. Use "
                    f"{name}={fix}, or tensor_parallel_size=1.")

    @classmethod
    def with_options(cls, config: Optional["PipelineConfig"], options: dict) -> "PipelineConfig":
        """``config`` (or the defaults) with ``options`` (field names) set; an unknown name is a
        ``TypeError`` that lists the options."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown pipeline option(s) {', '.join(unknown)}: the options are {', '.join(sorted(names))} "
                            f"(the fields of lightning_pp.runtime.config.PipelineConfig).")
        if config is None:
            return cls(**options)
        return dataclasses.replace(config, **options) if options else config

    @property
    def watchdog_config(self) -> WatchdogConfig:
        return self.watchdog if isinstance(self.watchdog, WatchdogConfig) else WatchdogConfig(enabled=self.watchdog)

    def _schedule(self, pp: int) -> ScheduleConfig:
        num_microbatches = self.num_microbatches if self.num_microbatches is not None else default_num_microbatches(pp)
        return make_config(self.schedule, pp, self.chunks_per_rank, num_microbatches, self.microbatch_group_size)

    @property
    def chunks_per_rank(self) -> int:
        """``virtual_pipeline_size``, or the schedule's own chunk count where it is not given."""
        if self.virtual_pipeline_size is not None:
            return self.virtual_pipeline_size
        return schedule_spec(self.schedule).default_vp

    def dims(self, world_size: int) -> ParallelDims:
        """The parallel sizes for ``world_size`` ranks (checked)."""
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        if self.pipeline_parallel_size is None:
            ParallelDims(world_size, 1, ep, tp).check()
            return ParallelDims(world_size, world_size // (ep * tp), ep, tp).check()
        return ParallelDims(world_size, self.pipeline_parallel_size, ep, tp).check()

    def resolve(self, world_size: int) -> "ResolvedPipeline":
        """This configuration for ``world_size`` ranks: the sizes, the pipeline size and the
        microbatch count filled in, and the schedule validated with them, made once."""
        self._refuse_with_tensor_parallel()
        dims = self.dims(world_size)
        schedule = self._schedule(dims.pp)
        config = dataclasses.replace(self, pipeline_parallel_size=dims.pp, virtual_pipeline_size=schedule.vp,
                                     num_microbatches=schedule.num_microbatches)
        return ResolvedPipeline(config, schedule, dims)


@dataclass(frozen=True)
class ResolvedPipeline:
    """A :class:`PipelineConfig` for a world size, what the runtime takes whole: ``config`` with
    the pipeline size and microbatch count filled in, ``schedule`` its validated
    :class:`~lightning_pp.schedules.ScheduleConfig`, ``dims`` the parallel sizes."""

    config: PipelineConfig
    schedule: ScheduleConfig
    dims: ParallelDims


def option_descriptions() -> dict[str, str]:
    """Each option's description, by the strategies' argument name (:data:`STRATEGY_NAMES`): the
    docstring under its field above, read from this module's source, the one place options are
    described. The strategies' ``__init__`` docstrings are made of them (:func:`arguments_docstring`),
    which is what LightningCLI's ``--help`` shows. Empty where the source is not available."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(PipelineConfig))
    except (OSError, TypeError):  # no source (e.g. a bytecode-only install)
        return {}
    body = tree.body[0].body
    descriptions = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            name = node.target.id
            descriptions[STRATEGY_NAMES.get(name, name)] = " ".join(inspect.cleandoc(following.value.value).split())
    return descriptions


def arguments_docstring(summary: str, others: dict[str, str]) -> str:
    """A Google-style docstring: ``summary``, then ``Args:`` with every option
    (:func:`option_descriptions`) followed by ``others`` (the strategy's Lightning arguments)."""
    import textwrap

    lines = [summary, "", "Args:"]
    for name, description in {**option_descriptions(), **others}.items():
        lines += textwrap.wrap(f"{name}: {description}", width=100, initial_indent="    ",
                               subsequent_indent="        ", break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines) + "\n"
