"""``PipelineMonitor``: the measured schedule of every rank, next to the planned one, in the
Trainer's loggers, progress bar and log directory.

Every ``every_n_steps`` training batches all ranks gather the batch's timeline spans (one
``all_gather_object``; the spans are recorded by the runtime anyway), and every rank runs the same
analysis on the same data (:func:`~lightning_pp.callbacks.analysis.analyze`), so the values are
identical everywhere and logging them can never wait on a rank that does not log. Global rank 0
sends them to the loggers and writes the trace and picture of ``trace_step``.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from typing_extensions import override
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pp.callbacks.analysis import PipelineStats, analyze
from lightning_pp.callbacks.export import export_png, export_trace, step_file_names
from lightning_pp.callbacks.records import RankTimeline, gather_spans
from lightning_pp.runtime.build import find_executor
from lightning_pp.runtime.measure import parameter_bytes
from lightning_pp.schedules.auto_layout import LayerCosts
from lightning_pp.runtime.step.microbatch import batch_size, first_tensor
from lightning_pp.runtime.timeline import SpanKind


class PipelineMonitor(Callback):
    """Measured bubble, per-action costs, the simulator's ideal, hidden all-to-all and throughput
    of the pipeline, plus a plan-vs-measurement trace and picture of one step.

    Logged to every logger of the Trainer (by global rank 0, at ``trainer.global_step``), with the
    prefix ``pipeline/``: ``bubble`` and ``bubble_rank{r}`` (measured), ``ideal_bubble`` and
    ``ideal_bubble_rank{r}`` (simulator, same configuration, measured action costs),
    ``forward_ms`` / ``backward_ms`` (/ ``forward_backward_ms``) mean action costs, ``step_ms``
    (compute window), ``recv_wait_ms`` (mean per rank), ``optimizer_ms``, ``a2a_hidden`` (the share
    of expert all-to-all time hidden under compute, where the model has any), ``samples_per_s`` and
    ``tokens_per_s``. The progress bar shows ``pp_bubble`` and ``pp_ideal``. Definitions: :mod:`lightning_pp.callbacks.analysis`.

    Args:
        every_n_steps: analyse every n-th training batch (1-based: batches n, 2n, ...). Every rank
            takes part in a gather on those batches; nothing is gathered in between.
        trace_step: 0-based index of the training batch (counted over the whole fit) whose trace
            and picture are written; default: the first analysed batch (``every_n_steps - 1``).
        write_trace: write ``pipeline_trace_step{k}.json`` (Chrome / Perfetto).
        write_png: write ``pipeline_timeline_step{k}.png``. It needs matplotlib (the ``plot`` extra,
            ``pip install lightning_pp[plot]``); without it the monitor warns once at setup and writes
            the trace and logs the metrics as usual.
        tokens_per_sample: tokens in one sample, or a function ``batch -> tokens`` of a batch, for
            ``tokens_per_s``. Default: the element count of the batch's first tensor when it holds
            integer token ids with a sequence dimension; otherwise tokens/s is not logged.
        dirpath: where the files go; default ``trainer.log_dir`` (the first logger's directory).
        prog_bar: show ``pp_bubble`` / ``pp_ideal`` in the progress bar.
        prefix: prefix of the logged metric names.
        alignment: how ranks' clocks are aligned (see :func:`~lightning_pp.callbacks.analysis.clock_offsets`).
        history_size: how many analysed batches :attr:`history` keeps.
        write_costs: also write ``pipeline_costs_step{k}.json`` for ``trace_step``: each virtual
            stage's measured mean forward, backward and weight-gradient times and the bytes its
            parameters, gradients and optimizer state hold, with the layout they were measured at,
            in the cost-file form the schedule CLI reads back
            (``python -m lightning_pp.schedules --pp P --costs pipeline_costs_step{k}.json --layout auto``:
            the layout the simulator predicts fastest, each stage's time spread over its layers).

    Throughput counts the time from the end of one training batch to the end of the next (so data
    loading is included), without validation, epoch boundaries or the monitor's own gathers.
    The optimizer step is timed from ``on_before_optimizer_step`` (gradient clipping included) to
    the end of the optimizer's ``step`` and recorded into the executor's timeline as an
    ``optimizer`` span (with CUDA events on CUDA).

    Set ``enabled = False`` (on every rank) to pause it. Nothing is gathered while the executor's
    timeline is off (``executor.timeline.enabled = False``).

    The files are optional output: one that cannot be written (a missing optional dependency, a
    directory that cannot be created, a full disk) is reported in a warning and training goes on.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        trace_step: Optional[int] = None,
        write_trace: bool = True,
        write_png: bool = True,
        tokens_per_sample: Union[None, int, Callable[[Any], int]] = None,
        dirpath: Optional[Union[str, Path]] = None,
        prog_bar: bool = True,
        prefix: str = "pipeline/",
        alignment: str = "auto",
        history_size: int = 1000,
        write_costs: bool = False,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} is invalid: it must be an integer >= 1.")
        if trace_step is not None and (isinstance(trace_step, bool) or not isinstance(trace_step, int) or trace_step < 0):
            raise ValueError(f"trace_step={trace_step!r} is invalid: give a batch index >= 0, or None.")
        if tokens_per_sample is not None and not callable(tokens_per_sample) and (
            isinstance(tokens_per_sample, bool) or not isinstance(tokens_per_sample, int) or tokens_per_sample < 1
        ):
            raise ValueError(
                f"tokens_per_sample={tokens_per_sample!r} is invalid: give a positive integer, a function of "
                f"the batch, or None."
            )
        self.every_n_steps = every_n_steps
        self.trace_step = every_n_steps - 1 if trace_step is None else trace_step
        self.write_trace = write_trace
        self.write_png = write_png
        self.write_costs = write_costs
        self.tokens_per_sample = tokens_per_sample
        self.dirpath = dirpath
        self.prog_bar = prog_bar
        self.prefix = prefix
        self.alignment = alignment
        self.enabled = True
        #: ``{"step": batch index, **metrics}`` of the latest analysed batches (all ranks).
        self.history: deque = deque(maxlen=history_size)
        self.last_stats: Optional[PipelineStats] = None
        self.last_records: Optional[list[RankTimeline]] = None
        self.last_step: Optional[int] = None
        #: Files written (global rank 0 only).
        self.written: list[Path] = []
        self._executor = None
        self._png_unavailable: Optional[str] = None  # why the picture cannot be drawn (checked at setup)
        self._hooks: list = []
        self._batch_index = -1
        self._reset_window()
        self._opt_start = self._opt_end = None
        self._clock = time.perf_counter()

    # -- state ----------------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._samples = 0
        self._tokens: Optional[int] = 0
        self._seconds = 0.0

    def _find_executor(self, trainer, pl_module):
        executor = find_executor(pl_module)
        if executor is None:
            engine = getattr(trainer.strategy, "engine", None)
            executor = getattr(engine, "executor", None)
        return executor

    def _count(self, batch: Any) -> None:
        samples = batch_size(batch) or 0
        self._samples += samples
        if self._tokens is None:
            return
        if callable(self.tokens_per_sample):
            self._tokens += int(self.tokens_per_sample(batch))
        elif self.tokens_per_sample is not None:
            self._tokens += samples * self.tokens_per_sample
        else:
            ids = first_tensor(batch)
            if ids is not None and ids.dim() >= 2 and not ids.dtype.is_floating_point and not ids.dtype.is_complex \
                    and ids.dtype != torch.bool:
                self._tokens += ids.numel()
            else:
                self._tokens = None  # no token count for this data

    # -- hooks ----------------------------------------------------------------------------------
    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.write_png or self._png_unavailable is not None or not trainer.is_global_zero:
            return  # only global rank 0 draws
        from lightning_pp.schedules.plot import require_matplotlib

        try:
            require_matplotlib("PipelineMonitor(write_png=True)")
        except ImportError as err:
            self._png_unavailable = str(err)
            rank_zero_warn(
                "PipelineMonitor cannot draw the timeline picture (pipeline_timeline_step*.png): matplotlib is "
                "not installed. Install the `plot` extra (`pip install lightning_pp[plot]`) to get it, or pass "
                "write_png=False to silence this warning. Training goes on; the Chrome trace and the pipeline "
                "metrics are written as usual."
            )

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._executor = self._find_executor(trainer, pl_module)
        if self._executor is None:
            rank_zero_warn(
                "PipelineMonitor found no pipeline executor: it only works with lightning_pp's "
                "PipelineStrategy (e.g. Trainer(strategy='pp_1f1b')). It will do nothing."
            )
            return
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        self._reset_window()
        self._clock = time.perf_counter()

    @override
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._clock = time.perf_counter()

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        self._clock = time.perf_counter()  # validation inside fit does not count as training time

    @override
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._batch_index += 1
        self._opt_start = self._opt_end = None
        if self._executor is not None and self.enabled:
            self._count(batch)

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._executor is not None and self.enabled and self._opt_start is None:
            self._opt_start = self._executor.timeline.mark()

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._executor is not None and self.enabled and self._opt_start is not None:
            self._opt_end = self._executor.timeline.mark()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        executor = self._executor
        if executor is None or not self.enabled:
            return
        self._seconds += elapsed
        timeline = executor.timeline
        if self._opt_start is not None:
            end = self._opt_end if self._opt_end is not None else timeline.mark()
            timeline.add_between(SpanKind.OPTIMIZER, -1, -1, self._opt_start, end)
            self._opt_start = self._opt_end = None
        index = self._batch_index
        if not timeline.enabled:
            return
        if (index + 1) % self.every_n_steps == 0 or index == self.trace_step:
            self._capture(trainer, pl_module, index)
            self._clock = time.perf_counter()  # the gather is not training time

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        self._remove_hooks()

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- one analysed batch ---------------------------------------------------------------------
    def _capture(self, trainer, pl_module, index: int) -> None:
        executor = self._executor
        extra = {"samples": self._samples, "tokens": self._tokens, "seconds": self._seconds}
        if self.write_costs:  # what each of this rank's stages holds, for the cost file
            extra["stage_static_bytes"] = {chunk.stage: parameter_bytes(chunk.parameters())
                                           for chunk in executor.partition.chunks}
        records = gather_spans(executor.timeline, topology=executor.topology, extra=extra)
        stats = analyze(records, executor.step_schedule, alignment=self.alignment)
        self._reset_window()
        metrics = stats.metrics(self.prefix)
        metrics.update(self._throughput(records))
        if executor.compile_watch is not None:  # compile=: compilations, recompilations, graph breaks
            metrics.update(executor.compile_watch.metrics(self.prefix))
        self.history.append({"step": index, **metrics})
        self.last_stats, self.last_records, self.last_step = stats, records, index

        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self.prog_bar:
            # The same values on every rank, logged by every rank: no rank-dependent call.
            for name, value in (("pp_bubble", stats.bubble_fraction), ("pp_ideal", stats.ideal_bubble)):
                pl_module.log(name, float(value), prog_bar=True, logger=False, on_step=True, on_epoch=False,
                              batch_size=1)
        if index == self.trace_step and (self.write_trace or self.write_png or self.write_costs):
            dirpath = self.dirpath if self.dirpath is not None else trainer.log_dir  # collective: every rank
            if trainer.is_global_zero:
                self._write_files(records, executor.step_schedule, Path(dirpath or "."), index, stats)

    def _write_files(self, records, config, dirpath: Path, index: int, stats: PipelineStats) -> None:
        """The trace and the picture of batch ``index``, each optional: a file that cannot be
        written is reported in a warning (training goes on) and left out of :attr:`written`."""
        trace_name, png_name = step_file_names(index)
        outputs = []
        if self.write_trace:
            outputs.append(("Chrome trace", dirpath / trace_name, export_trace))
        if self.write_png and self._png_unavailable is None:
            outputs.append(("timeline picture", dirpath / png_name, export_png))
        if self.write_costs:
            layout = list(self._executor.partition.layout)
            outputs.append(("cost file", dirpath / f"pipeline_costs_step{index}.json",
                            lambda records, config, path, step, stats: stage_cost_file(stats, layout).save(path)))
        if not outputs:
            return
        try:
            dirpath.mkdir(parents=True, exist_ok=True)
        except Exception as err:  # noqa: BLE001 - optional output never ends a run
            rank_zero_warn(f"PipelineMonitor cannot create its directory {str(dirpath)!r} ({type(err).__name__}: "
                           f"{err}), so it writes no trace or picture of batch {index}. Training goes on; pass a "
                           f"writable `dirpath`.")
            return
        for what, path, export in outputs:
            try:
                export(records, config, path, step=index, stats=stats)
            except Exception as err:  # noqa: BLE001 - optional output never ends a run
                rank_zero_warn(f"PipelineMonitor could not write its {what} {str(path)!r} ({type(err).__name__}: "
                               f"{err}). Training goes on.")
                continue
            self.written.append(path)

    def _throughput(self, records: list[RankTimeline]) -> dict:
        """Samples (and tokens) per second over the batches since the last analysis: every
        pipeline's first-stage rank counts its (data-parallel) share; time is the slowest rank's."""
        seconds = max(float(r.extra.get("seconds", 0.0)) for r in records)
        if seconds <= 0:
            return {}
        first = [r for r in records if (r.pp_rank or 0) == 0]
        out = {f"{self.prefix}samples_per_s": sum(int(r.extra.get("samples", 0)) for r in first) / seconds}
        tokens = [r.extra.get("tokens") for r in first]
        if tokens and all(t is not None for t in tokens):
            out[f"{self.prefix}tokens_per_s"] = sum(tokens) / seconds
        return out


def stage_cost_file(stats: PipelineStats, layout: list[int]) -> LayerCosts:
    """The per-stage measurements of one analysed step as a cost file (:class:`LayerCosts`, per
    stage, spread over the stages' layers): mean ``F`` / ``B`` / ``W`` compute seconds of each
    virtual stage and, where the ranks reported them, the bytes of its parameters, gradients and
    optimizer state (activations are not measured here: 0)."""
    static: dict = {}
    for extra in stats.extra:
        static.update({int(stage): float(size) for stage, size in extra.get("stage_static_bytes", {}).items()})
    cfg = stats.config
    return LayerCosts.from_stages(stats.stage_costs, layout, [static.get(s, 0.0) for s in range(len(layout))],
                                  unit="s", note=f"PipelineMonitor: {cfg.schedule} pp={cfg.pp} vp={cfg.vp} "
                                  f"microbatches={cfg.num_microbatches}, per-stage means of one step")


__all__ = ["PipelineMonitor", "stage_cost_file"]
