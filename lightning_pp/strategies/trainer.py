"""``PipelineStrategy``: pipeline (and expert) parallelism for ``lightning.pytorch.Trainer``.

It subclasses Lightning's ``DDPStrategy`` so launchers, cluster environments (torchrun, SLURM,
multi-node) and the world-group collectives work as they do for DDP, and replaces the parts that
differ:

* ``setup`` cuts the LightningModule into this rank's pipeline chunks *before* the optimizers are
  built, so ``configure_optimizers`` sees only this rank's parameters (under global names);
* ``training_step`` runs every microbatch's forward and backward through the schedule. The
  automatic-optimization loop is told to skip its own backward and zero_grad (zero_grad would
  otherwise run after the step and wipe the pipeline's gradients); the strategy zeroes gradients
  itself at the start of each accumulation window, with the usual hooks. Optimizer and LR
  scheduler steps, ``accumulate_grad_batches``, ``on_before_optimizer_step`` and gradient clipping
  stay Lightning's; clipping by norm uses the global norm over all pipeline and expert ranks;
* ``validation_step`` / ``test_step`` / ``predict_step`` run the forward-only schedule: the user's
  own, as written for one device, where the module overrides them (``self(x)`` in them is the
  whole model, its outputs on every rank), else the batch loss of ``pipeline_loss`` (logged as
  ``val_loss`` / ``test_loss``) and the outputs of ``pipeline_predict``;
* the batch loss reaches every rank (so rank 0's loggers and progress bar show the real loss),
  and ``self.log`` calls made in ``pipeline_loss`` on the last stage are replayed on every rank;
* checkpoints are sharded DCP directories with global names (see ``checkpoint.py``).
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager
from typing import Any, Generator, Literal, Optional, Union

import torch
from typing_extensions import override
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pp.strategies import checkpoint as ckpt, data
from lightning_pp.runtime.step.microbatch import batch_size
from lightning_pp.runtime.config import (DEFAULT_TIMEOUT, BatchCheck, CheckpointPolicy, CompileOption, DataParallelSharding,
                                         Layout, NonFinitePolicy, PipelineConfig, WatchdogConfig, arguments_docstring)
from lightning_pp.strategies.core import LIGHTNING_ARGUMENTS, PipelineEngine, PipelineStrategyMixin
from lightning_pp.strategies.loops import (ALREADY_GLOBAL, lightning_hook_of, log_options, logging_as_one_device,
                                          overrides_step, say_what_the_summary_shows, use_pipeline_optimization,
                                          warn_unused_step_methods)
from lightning_pp.strategies.signals import PipelineSignalConnector, record_stop


class PipelineStrategy(PipelineStrategyMixin, DDPStrategy):
    """Pipeline-parallel training for the Lightning Trainer.

    The pipeline's arguments are the fields of :class:`~lightning_pp.runtime.config.PipelineConfig`
    (``timeout`` there is ``pipeline_timeout`` here, ``watchdog`` is ``pipeline_watchdog``), each
    described where it is declared; ``__init__``'s docstring, which LightningCLI's ``--help``
    shows, is made of those descriptions. The others are ``DDPStrategy``'s.
    """

    strategy_name = "pp_1f1b"

    def __init__(
        self,
        pipeline_parallel_size: Optional[int] = None,
        expert_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        virtual_pipeline_size: Optional[int] = None,
        num_microbatches: Optional[int] = None,
        schedule: str = "1f1b",
        layout: Layout = None,
        microbatch_group_size: Optional[int] = None,
        pipeline_timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        nonfinite: NonFinitePolicy = "raise",
        pipeline_watchdog: Union[bool, WatchdogConfig] = True,
        activation_checkpointing: CheckpointPolicy = False,
        static_shapes: bool = True,
        check_batches: BatchCheck = "raise",
        broadcast_batches: bool = False,
        data_parallel_sharding: DataParallelSharding = "none",
        compile: CompileOption = False,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[datetime.timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        config = PipelineConfig(  # every option by name, so a reader (or a tool) can follow each one
            pipeline_parallel_size=pipeline_parallel_size, expert_parallel_size=expert_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            virtual_pipeline_size=virtual_pipeline_size, num_microbatches=num_microbatches, schedule=schedule,
            layout=layout, microbatch_group_size=microbatch_group_size, timeout=pipeline_timeout, nonfinite=nonfinite,
            watchdog=pipeline_watchdog, activation_checkpointing=activation_checkpointing, static_shapes=static_shapes,
            check_batches=check_batches, broadcast_batches=broadcast_batches,
            data_parallel_sharding=data_parallel_sharding, compile=compile)
        self._engine = PipelineEngine(config)  # checked when made
        self._last_step_skipped = False

    # -- checkpoints are restored after setup, into the cut model -------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards are loaded into the cut model and its optimizers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # done in load_checkpoint

    # -- models larger than a host ---------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)``: modules are built on the meta device (no
        memory); after the cut each rank materialises and initialises only what it keeps (see
        ``lightning_pp.runtime.cut.meta``). Otherwise as ``DDPStrategy``."""
        if empty_init:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    # -- setup --------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.engine.forget_earlier_failure()  # a sweep's next trial starts clean
        self.engine.setup_topology(self.root_device.type)
        self._shard_data_over_data_parallel()
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self.engine.topology.mesh

    @override
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.engine.setup_module(self.lightning_module, self.root_device, example_batch=data.first_training_batch(trainer))
        # Again: what was materialised from the meta device after the cut (e.g. a rotary cache its
        # reset_parameters computes in float32) takes the precision's dtype, as on one device.
        self.precision_plugin.convert_module(self.model)
        warn_unused_step_methods(self.lightning_module, trainer.state.fn)
        say_what_the_summary_shows(trainer, self.engine)
        PipelineSignalConnector.install(trainer, self)  # signals act between training steps, every rank alike
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            use_pipeline_optimization(trainer)
            self.setup_optimizers(trainer)
            self._install_global_clipping()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _install_global_clipping(self) -> None:
        engine = self.engine

        def clip_grad_by_norm(optimizer, clip_val: Union[int, float]) -> None:
            engine.clip_grad_norm(float(clip_val))

        # The precision plugin's norm clipping is per rank; the pipeline's norm is global.
        self.precision_plugin.clip_grad_by_norm = clip_grad_by_norm

    # -- steps --------------------------------------------------------------------------------
    def _zero_grad(self, batch_idx: int) -> None:
        trainer = self.lightning_module.trainer
        if batch_idx % trainer.accumulate_grad_batches != 0:
            return
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        for optimizer in self.optimizers:
            loop._on_before_zero_grad(optimizer)
            loop._optimizer_zero_grad(batch_idx, optimizer)

    def pipeline_step(self, batch: Any, grad_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every microbatch of ``batch``; returns the batch loss (on every
        rank). Gradients are added to ``.grad``. For manual optimization, call this from
        ``training_step`` instead of ``self.manual_backward``."""
        with self.precision_plugin.train_step_context():
            result = self.engine.train_step(batch, grad_scale=grad_scale)
        self._last_step_skipped = result.skipped
        return result.loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        trainer = module.trainer
        if not module.automatic_optimization:
            # Manual optimization: the user's training_step calls self.pipeline_step(batch).
            return super().training_step(*args, **kwargs)
        batch, batch_idx = args[0], args[1]
        self._zero_grad(batch_idx)
        loss = self.pipeline_step(batch, grad_scale=1.0 / trainer.accumulate_grad_batches)
        # The backward already ran inside the schedule; the hooks are called once it is done,
        # so on_after_backward sees the final (reduced, normalised) gradients.
        call._call_callback_hooks(trainer, "on_before_backward", loss)
        call._call_lightning_module_hook(trainer, "on_before_backward", loss)
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
        user_logged = self._replay_logs(batch_size(batch))
        if not self._last_step_skipped:  # a skipped step's inf/nan would poison the epoch mean
            self._log_loss("train_loss", loss, user_logged, batch, on_step=True, on_epoch=True)
        return loss

    def _eval_step(self, batch: Any, name: str, precision_context) -> torch.Tensor:
        with precision_context():  # as Lightning's Strategy.validation_step/test_step (autocast under bf16-mixed)
            result = self.engine.executor.eval_step(batch, compute_loss=True)
        loss = result.loss
        user_logged = self._replay_logs(batch_size(batch))
        self._log_loss(name, loss, user_logged, batch)
        return loss

    def _log_loss(self, name: str, loss: torch.Tensor, user_logged: set, batch: Any, **kwargs: Any) -> None:
        """Log the batch loss as ``train_loss`` / ``val_loss`` / ``test_loss`` (what a one-device
        ``training_step`` usually logs, so ``ModelCheckpoint(monitor="val_loss")`` works), unless
        the user's ``pipeline_loss`` logged that name itself: theirs is kept, so the two never
        clash. The value is already the global batch loss on every rank, so Lightning's reduction
        is skipped (and with it its advice to pass ``sync_dist=True``, which the user could not
        follow): see :meth:`reduce`."""
        if name in user_logged:
            return
        self.lightning_module.log(name, loss, prog_bar=True, batch_size=batch_size(batch), sync_dist=True,
                                  sync_dist_group=ALREADY_GLOBAL, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """As ``DDPStrategy.reduce``, except for values the strategy logged that are already the same
        global value on every rank (``group=ALREADY_GLOBAL``): returned as they are."""
        if group is ALREADY_GLOBAL:
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if overrides_step(self.lightning_module, "validation_step"):
            return self._user_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)
        return self._eval_step(args[0], "val_loss", self.precision_plugin.val_step_context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if overrides_step(self.lightning_module, "test_step"):
            return self._user_step("test_step", self.precision_plugin.test_step_context, args, kwargs)
        return self._eval_step(args[0], "test_loss", self.precision_plugin.test_step_context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if overrides_step(self.lightning_module, "predict_step"):
            return self._user_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)
        with self.precision_plugin.predict_step_context():
            return self.pipeline_predict(args[0])

    def _user_step(self, name: str, precision_context, args: tuple, kwargs: dict) -> Any:
        """The user's own ``validation_step`` / ``test_step`` / ``predict_step``, run as written for
        one device on every rank: ``self(x)`` in it is the whole model, run through the forward-only
        schedule, its outputs on every rank (:meth:`PipelineEngine.forward`), so every rank computes
        the same metrics; what it logs is logged as one device logs it (``loops.log_options``)."""
        module = self.lightning_module
        with precision_context(), self.engine.module_forward(module), logging_as_one_device(module, self.engine.topology):
            return getattr(module, name)(*args, **kwargs)

    def pipeline_predict(self, batch: Any) -> Any:
        """Forward-only pass of ``batch`` through the pipeline; the last stage's outputs
        (concatenated over microbatches) on every rank. Collective: call it on every rank, e.g.
        in a generation loop after ``fit``."""
        with torch.no_grad():
            result = self.engine.executor.eval_step(batch, compute_loss=False, collect_outputs=True)
        return self.engine.gather_outputs(result.outputs)

    def _replay_logs(self, batch_size: Optional[int]) -> set:
        """Log on every rank what ``pipeline_loss`` logged on the last stage; the names logged."""
        from lightning.pytorch import LightningModule

        logs = self.engine.gather_logs()
        for name, (value, kwargs) in logs.items():
            kwargs = log_options(self.engine.topology, kwargs)
            kwargs.setdefault("batch_size", batch_size)
            LightningModule.log(self.lightning_module, name, torch.tensor(value, dtype=torch.float64), **kwargs)
        return set(logs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            "manual_backward cannot run under pipeline parallelism: the forward and backward of different "
            "microbatches interleave across ranks. In training_step call "
            "`loss = self.trainer.strategy.pipeline_step(batch)` (it runs forward and backward of every "
            "microbatch and returns the batch loss), then step your optimizers."
        )

    # -- checkpoints --------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return ckpt.optimizer_state(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("PipelineStrategy.save_checkpoint does not take storage_options (DCP writes the shards).")
        shards = {"model": checkpoint.pop("state_dict")}
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            shards[f"optimizer_{i}"] = state
        checkpoint[ckpt.LAYOUT_KEY] = ckpt.layout_of(self.engine.executor)
        ckpt.save(filepath, shards, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        module = self.lightning_module
        fitting = module.trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []
        if ckpt.find_checkpoint(checkpoint_path) is None:
            # A single file: a one-device Trainer's .ckpt or a consolidated pipeline checkpoint. Its
            # optimizer states are one-device state dicts; each rank takes its parameters' part.
            checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=bool(weights_only))
            ckpt.load_full_state_dict(module, checkpoint["state_dict"])
            if optimizers:
                states = checkpoint.get("optimizer_states")
                if states is None:
                    raise KeyError(
                        f"Trying to restore optimizer state but the checkpoint {checkpoint_path} contains only the "
                        f"model. This is probably due to `ModelCheckpoint.save_weights_only` being set to `True`."
                    )
                if len(states) != len(optimizers):
                    raise ValueError(f"the checkpoint {checkpoint_path} holds {len(states)} optimizer state(s) but "
                                     f"configure_optimizers returns {len(optimizers)} optimizer(s)")
                for i, (optimizer, state) in enumerate(zip(optimizers, states)):
                    ckpt.load_optimizer_state(module, optimizer, state, where=f"{checkpoint_path} (optimizer {i})")
            return checkpoint
        shards: dict[str, Any] = {"model": module.state_dict()}
        for i, optimizer in enumerate(optimizers):
            shards[f"optimizer_{i}"] = ckpt.OptimizerShard(module, optimizer)
        return ckpt.load(checkpoint_path, shards, layout=ckpt.layout_of(self.engine.executor))

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in load_checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(filepath)

    # -- failures outside the pipeline step ---------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Called by Lightning on a rank whose run ``exception`` ends, before teardown (after the
        callbacks' ``on_exception``). Makes every rank's error name the rank that failed first, as
        for failures inside the step (see ``lightning_pp.runtime.failure.explain_exception``):

        * raised here outside the pipeline step (a hook, the DataLoader, between steps): this rank
          goes on the job's failure board as ``rank 1 (pp=1, dp=0, ep=0) failed outside the
          pipeline step (in MyModule.on_train_batch_end): ValueError: ...``;
        * a communication error caused by a peer that failed (e.g. in Lightning's own barrier or
          broadcast, or the strategy's log broadcast): the peer's record is looked up (waiting up to
          2 s for it) and added to the exception as a note; this rank never blames itself;
        * a pipeline failure (``PipelineError``, ``NonFiniteError``, one the step recorded), a signal's stop: as is.
        """
        super().on_exception(exception)
        try:
            self._explain_exception(exception)
        except Exception:  # noqa: BLE001 - never replace the user's exception with ours
            pass

    def _explain_exception(self, exception: BaseException) -> None:
        from lightning_pp.runtime.failure.outside_step import explain_exception, locate

        found = self.engine.failure_context(self.global_rank)  # None: no process group (yet), the error stays local
        if found is not None and not record_stop(exception, found[0]):  # a signal's stop is recorded as it is
            board, me, diagnosis = found
            explain_exception(exception, board, me, where=locate(exception, lightning_hook_of), diagnosis=diagnosis)


PipelineStrategy.__init__.__doc__ = arguments_docstring("Pipeline parallelism for the Trainer.", LIGHTNING_ARGUMENTS)
