"""``FabricPipelineStrategy``: pipeline (and expert) parallelism for ``lightning.fabric.Fabric``.

Usage::

    fabric = Fabric(strategy="pp_1f1b", devices=2)          # or FabricPipelineStrategy(...)
    fabric.launch()
    model = fabric.setup_module(MyModel())                   # cuts the model for this rank
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    for batch in loader:
        optimizer.zero_grad()
        loss = fabric.strategy.pipeline_step(model, batch)   # forward + backward, all microbatches
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # global norm
        optimizer.step()
"""

from __future__ import annotations

import datetime
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Callable, Literal, Optional, Union

import torch
from typing_extensions import override
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

from lightning_pp.runtime.build import executor_of, find_executor
from lightning_pp.runtime.cut.meta import has_meta_tensors
from lightning_pp.strategies import checkpoint as ckpt
from lightning_pp.runtime.config import (DEFAULT_TIMEOUT, BatchCheck, CheckpointPolicy, CompileOption, DataParallelSharding,
                                         Layout, NonFinitePolicy, PipelineConfig, WatchdogConfig, arguments_docstring)
from lightning_pp.strategies.core import LIGHTNING_ARGUMENTS, PipelineEngine, PipelineStrategyMixin



@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _widened(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating tensor narrower than ``dtype`` cast to it (bfloat16 outputs
    to float32, as Fabric's ``convert_output``), wider ones left as they are."""
    bits = torch.finfo(dtype).bits

    def widen(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and torch.finfo(tensor.dtype).bits < bits:
            return tensor.to(dtype)
        return tensor

    return apply_to_collection(data, torch.Tensor, widen)


def _unwrap(module: Any) -> nn.Module:
    return getattr(module, "_forward_module", module)  # _FabricModule -> the user's module


class FabricPipelineStrategy(PipelineStrategyMixin, DDPStrategy):
    """Pipeline-parallel strategy for Fabric; the constructor mirrors ``PipelineStrategy`` (see its
    docstring for every argument).

    With ``nonfinite="skip"``, a skipped step leaves ``.grad`` as it was before the step (``None``
    after ``optimizer.zero_grad()``), so the ``optimizer.step()`` that follows changes nothing;
    :attr:`skipped_steps` counts them.
    """

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
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[datetime.timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
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
        self._backward_sync_control = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.engine.setup_topology(self.root_device.type)
        self._shard_data_over_data_parallel()
        self._install_excepthook()

    @property
    def device_mesh(self):
        """The ("pp", "edp", "ep", "tp") device mesh (after setup), as Lightning's
        ``ModelParallelStrategy.device_mesh``: ``["tensor_parallel"]`` and ``["data_parallel"]`` name
        its tensor- and data-parallel groups, for ``parallelize_module`` before ``setup_module``."""
        return self.engine.topology.mesh if self.engine.topology is not None else None

    def _install_excepthook(self) -> None:
        """Fabric has no ``on_exception`` hook: an exception that ends the program (uncaught, so
        ``sys.excepthook`` runs) is recorded on the job's failure board, or, if it is a communication
        error caused by a peer, annotated with the peer's record, as the Trainer strategy's
        ``on_exception`` does. Installed once per process, chained to the previous hook; it follows
        the most recently set-up strategy. An exception the user catches is the user's to report."""
        import weakref

        from lightning_pp.runtime.failure.outside_step import install_excepthook

        strategy = weakref.ref(self)

        def context():
            current = strategy()
            found = current.engine.failure_context(current.global_rank) if current is not None else None
            return (*found, None) if found is not None else None

        install_excepthook(context)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: modules are built on the meta device (no
        memory); ``setup_module`` materialises and initialises only what this rank keeps after the
        cut (see ``lightning_pp.runtime.cut.meta``). Otherwise as ``DDPStrategy``."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    # -- modules and optimizers ---------------------------------------------------------------
    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None):
        if optimizers:
            raise RuntimeError(
                "FabricPipelineStrategy cuts the model into pipeline stages, which frees the parameters of "
                "other ranks: an optimizer created before the cut would hold them. Call "
                "`model = fabric.setup_module(model)` first, then create the optimizer from "
                "`model.parameters()` and call `fabric.setup_optimizers(optimizer)`."
            )
        return self.setup_module(module), [], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        already_cut = find_executor(module) is not None  # set up before: its functions are wrapped already
        executor = self.engine.setup_module(module, self.root_device)
        if not already_cut:
            self._apply_precision_at_the_model_boundary(executor)
            self._forward_through_the_pipeline(module)
        # What was materialised from the meta device after the cut takes the precision's dtype, as
        # Fabric converted the rest before (a no-op otherwise).
        return self.precision.convert_module(module)

    def _forward_through_the_pipeline(self, module: nn.Module) -> None:
        """``model(x)`` (under ``torch.no_grad()``, as evaluation code written for one device calls
        it) runs the whole model through the forward-only schedule and returns the last layer's
        outputs on every rank (``PipelineEngine.forward_of``); Fabric's wrapper converts its input
        and output for the precision as on one device. With gradients on it raises, naming
        ``pipeline_step``."""
        engine = self.engine

        def forward(*args: Any, **kwargs: Any) -> Any:
            return engine.forward_of(executor_of(module), args, kwargs)

        module.__dict__["forward"] = forward

    def _apply_precision_at_the_model_boundary(self, executor) -> None:
        """What Fabric's module wrapper does on one device, at the pipeline's ends: the model's
        inputs (``pipeline_inputs(batch)``, not the targets) go through ``precision.convert_input``;
        the last stage's output is converted to the default dtype (as ``precision.convert_output``
        does) before ``pipeline_loss``, which runs outside the precision's forward context
        (autocast off, the default dtype as outside the step), as a loss written after
        ``output = model(x)`` does. The layers run inside it (``pipeline_step`` and
        ``pipeline_eval`` enter it). One difference, on purpose: an output wider than the default
        dtype (``64-true``) is not narrowed, so float64 runs stay exact in float64 (Fabric's
        wrapper would hand the loss a float32 copy)."""
        precision, device_type = self.precision, self.root_device.type
        inputs_fn, loss_fn = executor.inputs_fn, executor.loss_fn
        outside = self._outside_forward_context

        def converted_inputs(batch):
            return precision.convert_input(inputs_fn(batch))

        def loss_outside_forward_context(output, batch):
            with torch.autocast(device_type, enabled=False), _default_dtype(outside["dtype"]):
                return loss_fn(_widened(output, outside["dtype"]), batch)

        executor.inputs_fn, executor.loss_fn = converted_inputs, loss_outside_forward_context

    @property
    def _outside_forward_context(self) -> dict:
        if not hasattr(self, "_outside"):
            self._outside = {"dtype": torch.get_default_dtype()}
        return self._outside

    @contextmanager
    def _forward_context(self):
        self._outside_forward_context["dtype"] = torch.get_default_dtype()
        with self.precision.forward_context():
            yield

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta_tensors(module):  # a meta module is materialised on the device by setup_module
            module.to(self.root_device)

    def pipeline_step(self, module: nn.Module, batch: Any) -> torch.Tensor:
        """Forward and backward of every microbatch of ``batch`` through the pipeline; gradients are
        added to ``.grad`` (zero them yourself, as with ``loss.backward()``). Returns the batch loss
        on every rank."""
        executor = executor_of(module)
        self.engine.executor = executor
        with self._forward_context():
            result = self.engine.train_step(batch)
        self.engine.recorder.take()  # Fabric has no logger hook in the step: drop recorded logs
        return result.loss

    def pipeline_eval(self, module: nn.Module, batch: Any, collect_outputs: bool = False) -> Any:
        """Forward-only pass of every microbatch (no gradients): the batch loss on every rank, or
        (with ``collect_outputs``) the last stage's outputs (``pipeline_predict``'s where the module
        has it), joined over microbatches, on every rank, converted as Fabric converts a module's
        outputs. Collective: call it on every rank, e.g. for validation or generation."""
        executor = executor_of(module)
        with torch.no_grad(), self._forward_context():
            result = executor.eval_step(batch, compute_loss=not collect_outputs, collect_outputs=collect_outputs)
        self.engine.recorder.take()
        if collect_outputs:
            return _widened(self.engine.gather_outputs(result.outputs, executor), torch.get_default_dtype())
        return result.loss

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "fabric.backward cannot run under pipeline parallelism: forward and backward of different "
            "microbatches interleave across ranks. Use `loss = fabric.strategy.pipeline_step(model, batch)`, "
            "which runs forward and backward of every microbatch, then step the optimizer."
        )

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        return self.engine.clip_grad_norm(float(max_norm), float(norm_type), error_if_nonfinite)

    # -- checkpoints --------------------------------------------------------------------------
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("FabricPipelineStrategy.save_checkpoint supports neither storage_options nor filter.")
        shards, meta, module = {}, {}, self._find_module(state)
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                shards[key] = _unwrap(obj).state_dict()
            elif isinstance(obj, Optimizer):
                shards[key] = ckpt.optimizer_state(module, obj)
            else:
                meta[key] = obj
        meta[ckpt.LAYOUT_KEY] = ckpt.layout_of(executor_of(module))
        ckpt.save(path, shards, meta)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if isinstance(state, (nn.Module, Optimizer)) or state is None:
            raise TypeError("FabricPipelineStrategy.load_checkpoint needs the state dict you saved, "
                            "e.g. {'model': model, 'optimizer': opt}.")
        module = self._find_module(state)
        if ckpt.find_checkpoint(path) is None:
            # A single file, e.g. saved by a one-device Fabric: {"model": state_dict, "optimizer":
            # optimizer.state_dict(), ...}. Each rank takes its parameters' part.
            meta = torch.load(path, map_location="cpu", weights_only=bool(weights_only))
            for key, obj in state.items():
                if isinstance(obj, (nn.Module, Optimizer)) and key not in meta:
                    raise KeyError(f"the checkpoint {path} has no {key!r} entry (it has {sorted(meta)})")
                if isinstance(obj, nn.Module):
                    ckpt.load_full_state_dict(_unwrap(obj), meta.pop(key), strict=strict)
                elif isinstance(obj, Optimizer):
                    ckpt.load_optimizer_state(module, obj, meta.pop(key), where=f"{path} ({key!r})")
        else:
            shards: dict[str, Any] = {}
            for key, obj in state.items():
                if isinstance(obj, nn.Module):
                    shards[key] = _unwrap(obj).state_dict()
                elif isinstance(obj, Optimizer):
                    shards[key] = ckpt.OptimizerShard(module, obj)
            meta = ckpt.load(path, shards, layout=ckpt.layout_of(executor_of(module)))
        meta.pop(ckpt.LAYOUT_KEY, None)
        for key in list(meta):
            if key in state and not isinstance(state[key], (nn.Module, Optimizer)):
                state[key] = meta.pop(key)
        return meta

    @staticmethod
    def _find_module(state: dict[str, Any]) -> Optional[nn.Module]:
        for obj in state.values():
            if isinstance(obj, nn.Module):
                return _unwrap(obj)
        return None


FabricPipelineStrategy.__init__.__doc__ = arguments_docstring(
    "Pipeline parallelism for Fabric.",
    {("precision" if name == "precision_plugin" else name): description for name, description in LIGHTNING_ARGUMENTS.items()})
