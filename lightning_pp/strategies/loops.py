"""How the pipeline strategy fits Lightning's loops: the automatic-optimization loop without its own
backward, the step methods the pipeline calls as written and the one it does not (and where its
work goes), logging from them as one device logs, what the model summary shows, and Lightning's
hook names for failure messages; the recorder of what pipeline_loss logs on the last stage, replayed
on every rank after the step."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional

import torch
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.trainer.states import TrainerFn
from lightning_pp.runtime.process import state


class _PipelineAutomaticOptimization(_AutomaticOptimization):
    """Lightning's automatic optimization with backward and zero_grad always skipped: the
    pipeline step computes the gradients inside ``training_step``. (A flag on the stock loop could
    be reset by other code, e.g. the SWA callback; this loop's cannot.)"""

    @property
    def _skip_backward(self) -> bool:
        return True

    @_skip_backward.setter
    def _skip_backward(self, value: bool) -> None:
        pass


def lightning_hook_of(frame) -> Optional[str]:
    """``MyModule.on_train_batch_end`` for a frame of Lightning's hook dispatch (``trainer/call.py``)."""
    import os

    code = frame.f_code
    if not code.co_filename.endswith(os.path.join("trainer", "call.py")):
        return None
    hook = frame.f_locals.get("hook_name")
    if not isinstance(hook, str):
        return None
    owner = {
        "_call_callback_hooks": "callback",
        "_call_lightning_module_hook": "pl_module",
    }.get(code.co_name)
    if owner is not None and frame.f_locals.get(owner) is not None:
        return f"{type(frame.f_locals[owner]).__name__}.{hook}"
    return hook


_STEP_METHODS = {
    TrainerFn.FITTING: ("training_step",),
}
_STEP_ADVICE = {
    "training_step": "the loss comes from pipeline_loss, run on the last stage for every microbatch (the "
                     "strategy logs it as train_loss); log training metrics there with self.log "
                     "(self.training is True)",
}


def overrides_step(module: Any, name: str) -> bool:
    """Whether the user's class defines its own ``name`` (e.g. ``validation_step``). The one-device
    steps of this package's ready modules (``integrations``: they call the wrapped model directly)
    are not the user's: under the pipeline those modules keep the pipeline's own evaluation."""
    from lightning.pytorch import LightningModule

    for cls in type(module).__mro__:
        if name in vars(cls):
            return cls is not LightningModule and not cls.__module__.startswith("lightning_pp.")
    return False


def warn_unused_step_methods(module: Any, fn: Any) -> None:
    """Warn once per class when ``module`` overrides ``training_step``, which the pipeline does not
    call under automatic optimization (the schedule runs forward and backward itself, stage by
    stage). The evaluation steps are called as written (``PipelineStrategy._user_step``)."""
    from lightning.pytorch.utilities import rank_zero_warn

    for name in _STEP_METHODS.get(fn, ()):
        if name == "training_step" and not module.automatic_optimization:
            continue  # manual optimization: training_step is called (it calls pipeline_step)
        if not overrides_step(module, name) or (type(module), name) in state().warned_step_methods:
            continue
        state().warned_step_methods.add((type(module), name))
        rank_zero_warn(
            f"{type(module).__name__}.{name} is not called under pipeline parallelism (lightning_pp): the "
            f"pipeline runs the model's layers itself, stage by stage, so anything else it does (logging, "
            f"post-processing) does not happen. Instead: {_STEP_ADVICE[name]}."
        )


# ``sync_dist_group`` of the values the strategy logs that every rank already holds alike.
ALREADY_GLOBAL = "lightning_pp:already-global"


def log_options(topology: Any, options: dict) -> dict:
    """``self.log``'s options for a value that every stage of one pipeline holds alike (what the
    user's evaluation steps and ``pipeline_loss`` log), so that it is what one device logs for the
    whole batch: with one data-parallel replica there is nothing to reduce, so no reduction runs (nor
    Lightning's advice to pass ``sync_dist=True``); with several, the value is reduced over the
    stage's replicas (``sync_dist`` implied: one device sees every replica's samples), never over
    the whole world, which would count each value once per stage (a ``"sum"`` ``pp`` times). A
    ``sync_dist_group`` the user gives is kept."""
    options = dict(options)
    if topology is None or options.get("sync_dist_group") is not None:
        return options
    group = ALREADY_GLOBAL if topology.dp == 1 else topology.dp_group
    options.update(sync_dist=True, sync_dist_group=group)
    return options


@contextmanager
def logging_as_one_device(module: Any, topology: Any) -> Generator[None, None, None]:
    """Within: ``module.log`` (and ``log_dict``, which calls it) logs with :func:`log_options`."""
    import inspect

    from lightning.pytorch import LightningModule

    signature = inspect.signature(LightningModule.log)

    def log(*args: Any, **kwargs: Any) -> None:
        arguments = dict(signature.bind(module, *args, **kwargs).arguments)
        arguments.pop("self")
        name, value = arguments.pop("name"), arguments.pop("value")
        LightningModule.log(module, name, value, **log_options(topology, arguments))

    module.__dict__["log"] = log
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


def say_what_the_summary_shows(trainer: Any, engine: Any) -> None:
    """Lightning's model summary (printed by rank 0 as fit starts) sees rank 0's stage only: the
    layers of other stages are ``NotOnThisStage`` placeholders without parameters. Say so just
    before it, with the whole model's size."""
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.utilities import rank_zero_info

    if trainer.state.fn == TrainerFn.FITTING and any(isinstance(c, ModelSummary) for c in trainer.callbacks):
        rank_zero_info(f"lightning_pp: the model summary below shows this rank's pipeline stage only: "
                       f"{engine.describe_stage()}; the layers of other stages appear as NotOnThisStage with no "
                       f"parameters.")


def use_pipeline_optimization(trainer) -> None:
    """Give the fit loop the pipeline's automatic optimization (once), keeping its progress."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not isinstance(epoch_loop.automatic_optimization, _PipelineAutomaticOptimization):
        replacement = _PipelineAutomaticOptimization(trainer)
        replacement.optim_progress = epoch_loop.automatic_optimization.optim_progress
        epoch_loop.automatic_optimization = replacement


class LogRecorder:
    """Collects ``self.log`` calls made inside ``pipeline_loss`` on the last stage, so they can be
    replayed on every rank once the step is done (a ``sync_dist`` collective must run everywhere).
    Values are averaged over microbatches, weighted by their sample count; a torchmetrics
    ``Metric`` contributes the value of its latest ``forward``."""

    def __init__(self) -> None:
        self.entries: dict[str, list] = {}
        self.weight = 1.0

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("inside pipeline_loss, pass self.log options by keyword (e.g. prog_bar=True)")
        value = getattr(value, "_forward_cache", value)  # torchmetrics Metric -> its step value
        if value is None:
            return
        value = torch.as_tensor(value).detach().to("cpu", torch.float64)
        if value.numel() != 1:
            raise ValueError(f"self.log({name!r}, ...) inside pipeline_loss needs a scalar, got shape {tuple(value.shape)}")
        entry = self.entries.setdefault(name, [0.0, 0.0, kwargs])
        entry[0] += float(value) * self.weight
        entry[1] += self.weight

    def log_dict(self, dictionary: dict, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    def take(self) -> dict[str, tuple[float, dict]]:
        out = {name: (total / weight, kwargs) for name, (total, weight, kwargs) in self.entries.items() if weight > 0}
        self.entries = {}
        return out
