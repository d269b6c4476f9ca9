"""How the pipeline strategy fits Lightning's loops: the automatic-optimization loop without its own
backward, the step methods the pipeline does not call (and where their work goes), and Lightning's
hook names for failure messages."""

from __future__ import annotations

from typing import Any, Optional

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
    TrainerFn.FITTING: ("training_step", "validation_step"),
    TrainerFn.VALIDATING: ("validation_step",),
    TrainerFn.TESTING: ("test_step",),
    TrainerFn.PREDICTING: ("predict_step",),
}
_STEP_ADVICE = {
    "training_step": "the loss comes from pipeline_loss, run on the last stage for every microbatch (the "
                     "strategy logs it as train_loss); log training metrics there with self.log "
                     "(self.training is True)",
    "validation_step": "the loss comes from pipeline_loss (logged as val_loss); log validation metrics "
                       "there with self.log (self.training is False, self.trainer.validating is True), e.g. "
                       "for EarlyStopping or ModelCheckpoint to monitor",
    "test_step": "the loss comes from pipeline_loss (logged as test_loss); log test metrics there with "
                 "self.log (self.training is False, self.trainer.testing is True)",
    "predict_step": "predictions are the last layer's outputs; post-process them (argmax, decoding) in "
                    "pipeline_predict(self, output, batch), which the last stage calls for every microbatch",
}


def warn_unused_step_methods(module: Any, fn: Any) -> None:
    """Warn once per class and method when ``module`` overrides a step method that the pipeline
    does not call for ``fn`` (the pipeline runs the layers itself, stage by stage)."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities import rank_zero_warn

    for name in _STEP_METHODS.get(fn, ()):
        if name == "training_step" and not module.automatic_optimization:
            continue  # manual optimization: training_step is called (it calls pipeline_step)
        own = getattr(type(module), name, None)
        if own is None or own is getattr(LightningModule, name) or (type(module), name) in state().warned_step_methods:
            continue
        state().warned_step_methods.add((type(module), name))
        rank_zero_warn(
            f"{type(module).__name__}.{name} is not called under pipeline parallelism (lightning_pp): the "
            f"pipeline runs the model's layers itself, stage by stage, so anything else it does (logging, "
            f"post-processing) does not happen. Instead: {_STEP_ADVICE[name]}."
        )


def use_pipeline_optimization(trainer) -> None:
    """Give the fit loop the pipeline's automatic optimization (once), keeping its progress."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not isinstance(epoch_loop.automatic_optimization, _PipelineAutomaticOptimization):
        replacement = _PipelineAutomaticOptimization(trainer)
        replacement.optim_progress = epoch_loop.automatic_optimization.optim_progress
        epoch_loop.automatic_optimization = replacement
