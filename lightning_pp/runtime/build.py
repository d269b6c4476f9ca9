"""``build_pipeline``: from a module and a configuration to this rank's executor (validate, build
the groups, cut, shard the experts, materialise, then the executor), and the handle on a pipelined
module's executor."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_pp.runtime.compile.layers import compile_pipeline_layers
from lightning_pp.runtime.compile.watch import CompileWatch
from lightning_pp.runtime.config import PipelineConfig, ResolvedPipeline
from lightning_pp.runtime.cut.layout import auto_layout_of
from lightning_pp.runtime.cut.meta import has_meta_tensors, materialize
from lightning_pp.runtime.cut.partition import (
    Partition,
    add_frozen_stage_placeholder,
    check_protocol,
    cut_model,
    default_pipeline_inputs,
    layer_list,
    resolve_layout,
)
from lightning_pp.runtime.dp.grads import GradientSync
from lightning_pp.runtime.dp.sharding import StageSharding, adopt_user_sharding, shard_stage
from lightning_pp.runtime.failure.board import FailureBoard, Position
from lightning_pp.runtime.failure.diagnosis import Diagnosis
from lightning_pp.runtime.failure.guard import StepGuard
from lightning_pp.runtime.failure.watchdog import watchdog_for
from lightning_pp.runtime.layer import checkpointed_layers
from lightning_pp.runtime.measure import batch_to_measure, decide_layout
from lightning_pp.runtime.plans.plan import set_streams
from lightning_pp.runtime.process import CHECKPOINT, COMPILED, fact, facts
from lightning_pp.runtime.protocols import ExpertParallelLayer, HoldsResources, StepObserver
from lightning_pp.runtime.step.executor import PipelineExecutor, StepParts
from lightning_pp.runtime.step.loss import StepEnd
from lightning_pp.runtime.step.rng import StageRNG
from lightning_pp.runtime.step.stage import StageRunner
from lightning_pp.runtime.timeline import Timeline
from lightning_pp.runtime.topology import Topology, build_topology
from lightning_pp.runtime.tp.params import check_tensor_parallel_model
from lightning_pp.runtime.transport.p2p import PointToPoint
from lightning_pp.runtime.transport.waits import BoundedWait
from lightning_pp.schedules.tables import rank_plan


def build_pipeline(
    module: nn.Module,
    config: Union[PipelineConfig, ResolvedPipeline, None] = None,
    *,
    device: torch.device = torch.device("cpu"),
    topology: Optional[Topology] = None,
    example_batch: Any = None,
    **options: Any,
) -> PipelineExecutor:
    """Validate the configuration, build the groups, cut ``module`` in place and return the
    executor for this rank. Every check that can fail does so before any group is created.

    ``options`` are :class:`~lightning_pp.runtime.config.PipelineConfig`'s fields, by name (or pass
    a ``config``; options given as well override its fields; the strategies pass the
    :class:`~lightning_pp.runtime.config.ResolvedPipeline` they resolved, with the ``topology``
    they built from it): ``timeout`` bounds every wait of a step (a peer that
    makes no progress for that long is named as stuck); ``nonfinite`` is what a step with inf/nan
    loss or gradients does (``"raise"``, ``"skip"`` or ``"ignore"``, decided alike on every rank);
    ``watchdog`` configures (or, with ``False``, disables) the thread that publishes this rank's
    position and ends it if it stays blocked after a peer failed (see
    :mod:`lightning_pp.runtime.failure`). ``activation_checkpointing``: layers that keep only their
    inputs and recompute their forward in backward (``True``: every layer except those that
    communicate, such as MoE blocks; or a list of layer classes). ``check_batches`` compares, every
    step, a fingerprint of the batch each stage of a pipeline was given (``"raise"``, ``"warn"`` or
    ``"off"``; it rides on the loss all-reduce); ``broadcast_batches=True`` instead uses pipeline
    rank 0's batch on every stage (one broadcast per step), for data pipelines that cannot give
    every stage the same batch. A module built on the meta device is materialised after the cut,
    only what this rank keeps, with the seed ``torch.initial_seed()`` (see
    :mod:`lightning_pp.runtime.cut.meta`). ``compile`` compiles this rank's layers in place, last
    (see :mod:`lightning_pp.runtime.compile.layers`). ``layout="auto"`` measures every pipeline layer on one
    microbatch of ``example_batch`` (a training batch, or a function returning one; default: the
    module's ``pipeline_example_batch()``) on every rank at once (rank 0 chooses) and cuts at the layout the simulator
    predicts fastest, the same on every rank (see :mod:`lightning_pp.runtime.measure`); the choice
    is ``executor.layout_choice``."""
    resolved = config if isinstance(config, ResolvedPipeline) else None
    if resolved is not None and options:
        raise TypeError(f"build_pipeline got options {sorted(options)} with an already resolved pipeline: set them "
                        f"on its PipelineConfig before resolving it.")
    config = resolved.config if resolved is not None else PipelineConfig.with_options(config, options)
    check_protocol(module)
    layers = layer_list(module)  # once: pipeline_layers() may build new adapter objects every call
    check_expert_placement(module, layers)
    recomputed = set(checkpointed_layers(layers, config.activation_checkpointing))
    if resolved is None:
        world_size = topology.dims.world_size if topology is not None else torch.distributed.get_world_size()
        resolved = config.resolve(world_size)
    schedule = resolved.schedule
    auto = auto_layout_of(config.layout)
    if auto is not None:  # checked before any group exists
        example_batch = batch_to_measure(module, config.layout, len(layers), schedule.num_stages, example_batch)
    elif topology is None:
        resolve_layout(config.layout, len(layers), schedule.num_stages)  # before any group exists
    if topology is None:
        topology = build_topology(schedule.pp, config.expert_parallel_size, device.type, config.tensor_parallel_size)
    for i in recomputed:
        facts(layers[i])[CHECKPOINT] = True  # read by run_layer; kept with the layer if it stays here
    choice = None if auto is None else decide_layout(
        module, layers, schedule, example_batch, device, auto.memory_budget, auto.repeats,
        topology.dp if config.data_parallel_sharding == "full" else 1)
    layout = config.layout if choice is None else choice.layout
    check_tensor_parallel_model(module, topology)  # the whole model, alike on every rank
    partition = cut_model(module, schedule.pp, schedule.vp, topology.pp_rank, layout, layers=layers,
                          placement=schedule.placement)
    setup_expert_parallel(partition, topology, device)
    sharding = None
    if has_meta_tensors(module):  # built on the meta device: only what stays here gets memory
        init_fn, seed = getattr(module, "pipeline_init_weights", None), torch.initial_seed()
        if config.data_parallel_sharding == "full" and topology.dp > 1:  # each layer sharded once made
            sharding = shard_stage(module, partition, topology,
                                   prepare=lambda layer: materialize(module, device, seed, init_fn, within=layer))
        partition.follow(materialize(module, device, seed, init_fn))
    partition.forget_freed(module)  # before anything new is made: a new object may reuse a freed id
    add_frozen_stage_placeholder(module, partition)
    module.to(device)
    compile_pipeline_layers([layer for chunk in partition.chunks for layer in chunk.layers], config.compile,
                            schedule.spec.splits_backward)
    executor = PipelineExecutor(resolved, assemble_step_parts(module, partition, topology, resolved, device, sharding))
    executor.layout_choice = choice  # layout="auto": what was chosen and why (None otherwise)
    module._lpp_executor = executor  # not a submodule: a plain attribute (see executor_of)
    return executor


def assemble_step_parts(module: nn.Module, partition: Partition, topology: Topology, pipeline: ResolvedPipeline,
                        device: torch.device, sharding: Optional[StageSharding] = None) -> StepParts:
    """Make and wire the executor's collaborators for this rank. Runs collectives: the replicas take
    data-parallel rank 0's parameters, then the stage is sharded. Sharding is decided here and only
    here: ``sharding`` (the layers sharded as they were materialised from the meta device), else
    the user's own ``fully_shard`` units adopted as they are, else (``data_parallel_sharding="full"``)
    the layers sharded after the broadcast (a sharded parameter's shards are its only copy)."""
    options, schedule = pipeline.config, pipeline.schedule
    actions = rank_plan(schedule, topology.pp_rank).actions
    timeline = Timeline(enabled=True, device=device)
    if device.type == "cuda":
        set_streams(high_priority=True)  # the process's comm stream (runtime.plans.plan)
    position, board = Position(), FailureBoard()
    rng = StageRNG([chunk.stage for chunk in partition.chunks], topology.dp_rank, device)
    p2p = PointToPoint(topology.pp_group, topology.global_rank, device, options.timeout, topology.describe,
                       timeline=timeline, position=position)
    wait_collective = BoundedWait(options.timeout, topology.describe, position)
    sharding = sharding or adopt_user_sharding(module, partition, topology, options.data_parallel_sharding)
    grad_sync = GradientSync(partition, topology, actions, module, sharding=sharding)
    grad_sync.broadcast_parameters()
    if options.data_parallel_sharding == "full" and sharding is None:
        sharding = shard_stage(module, partition, topology)
        grad_sync.adopt_sharding(sharding)
    if sharding is not None:
        sharding.timeline = timeline
    watchdog = options.watchdog_config
    diagnosis = Diagnosis(board, topology.dims.world_size, topology.describe, watchdog, options.timeout.total_seconds())
    watchdog = watchdog_for(board, topology.rank, topology.dims.world_size, watchdog)

    def abort() -> None:  # drop a failed step's transfer and reduction state
        p2p.reset()
        grad_sync.abandon()
        if sharding is not None:
            sharding.abandon()

    guard = StepGuard(position, board, diagnosis, watchdog, topology.describe, schedule.stage_of, topology.pp_rank,
                      on_abort=abort)
    # Schedules with FB actions (combined 1F1B, DualPipeV) run chunks through their schedule plans
    # (runtime/plans) so that an FB overlaps one microbatch's forward with another's backward.
    stage = StageRunner(partition, p2p, schedule, topology.pp_rank, rng, timeline, wait_collective, topology.describe,
                        schedule.spec.fused, module.pipeline_loss,
                        getattr(module, "pipeline_inputs", None) or default_pipeline_inputs,
                        getattr(module, "pipeline_predict", None))  # where a predict_step's work goes
    stage.tensor_parallel = topology.tp > 1
    subs = [sub for chunk in partition.chunks for layer in chunk.layers for sub in layer.modules()]
    hooks = [sub.pipeline_step_end for sub in subs if isinstance(sub, StepObserver)]
    # compile=: torch.compile's recompilations and graph breaks, counted per step
    watch = CompileWatch() if any(fact(sub, COMPILED, False) for sub in subs) else None
    return StepParts(module, partition, topology, device, timeline, rng, position, p2p, wait_collective,
                     sharding, grad_sync, board, diagnosis, watchdog, guard, stage, StepEnd(schedule, topology, device),
                     hooks + ([watch.pipeline_step_end] if watch is not None else []),
                     [sub for sub in subs if isinstance(sub, HoldsResources)], watch)


def setup_expert_parallel(partition: Partition, topology: Topology, device: torch.device) -> None:
    """Give every expert-parallel layer of this rank's chunks its group (``setup_expert_parallel``
    on any submodule that has it), so it keeps only this rank's experts."""
    for chunk in partition.chunks:
        for layer in chunk.layers:
            for sub in layer.modules():
                if isinstance(sub, ExpertParallelLayer):
                    sub.setup_expert_parallel(topology.ep_group, topology.ep_rank, topology.ep, device)


def check_expert_placement(module: nn.Module, layers: list[nn.Module]) -> None:
    """Every parameter of the layers is an expert's (in an expert-parallel layer's
    ``expert_list()``) or dense, never both, and no parameter outside every ``expert_list()`` is
    marked as an expert's: each kind is reduced over its own group, so a parameter whose placement
    cannot be told is an error naming it. Run on the whole model before the cut, so every rank
    decides alike."""
    experts: list[nn.Module] = []
    for sub in (sub for layer in layers for sub in layer.modules() if isinstance(sub, ExpertParallelLayer)):
        listed, count = sub.expert_list(), getattr(sub, "num_experts", None)
        if getattr(sub, "stacked_experts", False):
            _check_stacked(sub, listed, count)
        elif not isinstance(listed, nn.ModuleList) or (count is not None and len(listed) != count):
            what = f"a ModuleList of {len(listed)}" if isinstance(listed, nn.ModuleList) else type(listed).__name__
            raise ValueError(
                f"{type(sub).__name__}.expert_list() returned {what}: it must return the nn.ModuleList of all "
                f"{count} experts, expert e at index e (registered in the module, so each expert-parallel rank "
                f"can keep its share and replace the others by placeholders).")
        experts.extend(listed)
    expert_ids = {id(m) for m in experts}
    expert_params = {id(p) for m in experts for p in m.parameters()}
    dense: dict[int, nn.Parameter] = {}
    stack = list(layers)
    while stack:  # every module of the layers but the experts' subtrees
        sub = stack.pop()
        if id(sub) not in expert_ids:
            dense.update((id(p), p) for p in sub.parameters(recurse=False))
            stack.extend(sub.children())
    names = {id(p): name for name, p in module.named_parameters()}
    shared = sorted(names.get(pid, "?") for pid in dense if pid in expert_params)
    if shared:
        raise ValueError(
            f"parameter(s) {', '.join(shared[:6])} belong both to an expert (in expert_list()) and to a module "
            f"outside the experts: an expert's parameters live on one expert-parallel rank and are reduced over "
            f"the expert-data-parallel group, a dense parameter's on every rank. Give each expert its own "
            f"parameters, or move the shared module out of the experts.")
    marked = sorted(names.get(pid, "?") for pid, p in dense.items() if getattr(p, "_lpp_expert", False))
    if marked:
        raise ValueError(
            f"parameter(s) {', '.join(marked[:6])} are marked as expert parameters (mark_expert_parameters) but "
            f"are in no expert-parallel layer's expert_list(), so it cannot be told which expert-parallel rank "
            f"holds them. Return their modules from the layer's expert_list() (subclass "
            f"lightning_pp.moe.ExpertParallelMoE), or do not mark them (dense parameters need no marking).")


def _check_stacked(sub: nn.Module, listed: Any, count: Optional[int]) -> None:
    """A layer with stacked experts lists one module, every parameter of which stacks ``count``
    experts along dim 0 (each expert-parallel rank keeps its rows)."""
    name = type(sub).__name__
    if not isinstance(listed, nn.ModuleList) or len(listed) != 1:
        raise ValueError(f"{name} has stacked_experts=True, so its expert_list() must be a ModuleList holding the one "
                         f"module whose parameters stack every expert along dim 0; it returned {type(listed).__name__}"
                         f"{f' of {len(listed)}' if isinstance(listed, nn.ModuleList) else ''}.")
    wrong = [f"{n} {tuple(p.shape)}" for n, p in listed[0].named_parameters() if p.dim() == 0 or p.shape[0] != count]
    if wrong:
        raise ValueError(f"{name}'s stacked experts hold parameter(s) {', '.join(wrong[:4])} whose dim 0 is not the "
                         f"{count} experts: each expert-parallel rank keeps its rows of dim 0, so every parameter of "
                         f"the stacked module must have one row per expert.")


def find_executor(module: nn.Module) -> Optional[PipelineExecutor]:
    """The executor that runs ``module`` on this rank, or ``None`` if it is not pipelined (a
    Fabric-wrapped module is looked through)."""
    return getattr(module, "_forward_module", module).__dict__.get("_lpp_executor")


def executor_of(module: nn.Module) -> PipelineExecutor:
    """The executor that runs ``module`` on this rank (after ``build_pipeline``, or a strategy's
    setup), e.g. for ``capture_step`` or ``executor.timeline``."""
    executor = find_executor(module)
    if executor is None:
        raise ValueError(f"{type(module).__name__} is not pipelined on this rank: build_pipeline (or the "
                         f"strategy's setup) has not run on it.")
    return executor
