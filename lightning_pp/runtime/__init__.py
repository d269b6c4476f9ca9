"""Distributed pipeline runtime: topology, model cutting, stage boundaries, executor.

Knows torch and torch.distributed, never Lightning. Its rooms, bottom up (a room imports only its
own floor and the ones below; tests/test_imports.py holds the order):

* the ground: :mod:`~lightning_pp.runtime.protocols` (what the runtime asks of modules),
  :mod:`~lightning_pp.runtime.process` (the per-process facts), :mod:`~lightning_pp.runtime.topology`
  (process groups), :mod:`~lightning_pp.runtime.timeline` (what a step recorded),
  :mod:`~lightning_pp.runtime.context` (what a layer may ask about the microbatch being run),
  :mod:`~lightning_pp.runtime.dtensors`, :mod:`~lightning_pp.runtime.layer` (how one layer runs);
* ``failure/`` (one rank's failure made every rank's clear error), ``transport/`` (stage-boundary
  transfers, bounded waits), ``plans/`` (fine-grained schedule plans), ``cut/`` (cutting a model
  into chunks), ``tp/`` (which DTensors are tensor-parallel), ``dp/`` (gradient reductions,
  sharding, the norm), ``compile/`` (``compile=``);
* :mod:`~lightning_pp.runtime.config` (``PipelineConfig``), ``step/`` (the step loop and what one
  action does), :mod:`~lightning_pp.runtime.measure` (``layout="auto"``),
  :mod:`~lightning_pp.runtime.build` (``build_pipeline``, which assembles the executor's parts).

What is importable from here is the runtime's public API, for scripts without Lightning.
"""

from lightning_pp.runtime.build import build_pipeline, executor_of, find_executor
from lightning_pp.runtime.config import PipelineConfig
from lightning_pp.runtime.cut.layout import AutoLayout
from lightning_pp.runtime.failure.errors import BatchMismatchError, NonFiniteError, PipelineCommError, PipelineError
from lightning_pp.runtime.failure.watchdog import WATCHDOG_EXIT_CODE, WatchdogConfig
from lightning_pp.runtime.step.executor import PipelineExecutor, StepResult
from lightning_pp.runtime.dp.grads import ParametersChangedError
from lightning_pp.runtime.transport.p2p import StageBoundaryError
from lightning_pp.runtime.topology import ParallelDims, Topology, build_topology

__all__ = [
    "AutoLayout",
    "BatchMismatchError",
    "NonFiniteError",
    "ParallelDims",
    "ParametersChangedError",
    "PipelineCommError",
    "PipelineConfig",
    "PipelineError",
    "PipelineExecutor",
    "StageBoundaryError",
    "StepResult",
    "Topology",
    "WATCHDOG_EXIT_CODE",
    "WatchdogConfig",
    "build_pipeline",
    "build_topology",
    "executor_of",
    "find_executor",
]
