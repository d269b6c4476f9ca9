"""What the runtime asks of the modules it runs, declared.

The runtime calls these methods where a module has them (``isinstance`` against the
``runtime_checkable`` protocols below, which look at the methods only). Nothing else is duck-typed.

* :class:`PipelineModel`: the user's module (two required methods, and the optional ones).
* :class:`OwnsSchedulePlan`: a layer (or a one-layer chunk) that brings its own fine-grained
  plan class (:mod:`lightning_pp.runtime.plans.plan`).
* :class:`ProvidesScheduleNodes`: a layer that communicates inside its forward (an
  expert-parallel MoE layer) and gives the runtime's chunk plan its five nodes.
* :class:`ExpertParallelLayer`: a layer that keeps only its expert-parallel rank's experts.
* :class:`StepObserver`: a layer told when a training step ends.
* :class:`HoldsResources`: a layer with resources to release when the pipeline closes.

Attribute markers the runtime reads (set by it or by the layers it knows): ``param._lpp_expert``
(an expert parameter, reduced over the expert-data-parallel group: exactly the parameters of the
expert-parallel layers' ``expert_list()``), ``param._lpp_stacked`` (a parameter holding its rank's
rows of stacked experts: :mod:`lightning_pp.runtime.cut.stacked`), ``module._lpp_executor`` (the
module's executor: use :func:`lightning_pp.runtime.executor_of`). Everything else the package
knows about users' objects (which layers are recomputed in backward or compiled) is a fact in
:mod:`lightning_pp.runtime.process`'s table, not an attribute. What the runtime tells layers about the microbatch being
run (its loss weight for auxiliary losses, the timeline, the bounded wait) is
:func:`lightning_pp.runtime.context.current`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class PipelineModel(Protocol):
    """A module the pipeline can cut and run. Optional: ``pipeline_inputs(batch)`` (the first
    stage's input, default ``batch[0]``), ``pipeline_predict(output, batch)`` (post-processing of
    the last stage's output in prediction), ``pipeline_init_weights(module)`` (initialises a module
    materialised from the meta device, after its ``reset_parameters``)."""

    def pipeline_layers(self) -> list[nn.Module]:
        """The ordered layers: layer i's output is layer i+1's input."""

    def pipeline_loss(self, output: Any, batch: Any) -> Any:
        """The last stage's loss of one microbatch: a mean, or a ``(loss_sum, count)`` pair."""


@runtime_checkable
class OwnsSchedulePlan(Protocol):
    def build_schedule_plan(self, *inputs: Any) -> Any:
        """An :class:`~lightning_pp.runtime.plans.plan.AbstractSchedulePlan` for one microbatch."""


@runtime_checkable
class ProvidesScheduleNodes(Protocol):
    def schedule_nodes(self, event: Any) -> Any:
        """The five :class:`~lightning_pp.runtime.plans.plan.ScheduleNode` s (attn, dispatch, mlp,
        combine, post) of one microbatch, ordered by ``event``."""


@runtime_checkable
class ExpertParallelLayer(Protocol):
    def expert_list(self) -> nn.ModuleList:
        """Every expert, expert e at index e: their parameters are the expert parameters."""

    def setup_expert_parallel(self, group: Any, ep_rank: int, ep_size: int, device: torch.device) -> None:
        """Keep only expert-parallel rank ``ep_rank``'s experts (called after the cut) and mark the
        kept experts' parameters ``_lpp_expert``."""


@runtime_checkable
class StepObserver(Protocol):
    def pipeline_step_end(self, step: int) -> None:
        """Called after every training step with the number of steps done."""


@runtime_checkable
class HoldsResources(Protocol):
    def pipeline_teardown(self) -> None:
        """Called once when the executor closes (collectively: release shared buffers)."""
