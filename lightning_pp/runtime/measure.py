"""``layout="auto"``: measuring what every pipeline layer costs, and deciding the layout once for all ranks.

:func:`measure_layer_costs` runs the model's pipeline layers one after the other on one microbatch
of a real batch (the first of the ``num_microbatches`` it is split into, so every layer sees the
shapes it sees in training) and records, per layer (:class:`~lightning_pp.schedules.auto_layout.LayerCost`):

* the time of its forward, of its input gradient (``torch.autograd.grad`` to its floating-point
  inputs; none for the first layer, whose input is data) and of its weight gradient (then, from
  the same graph, to its parameters: the zero-bubble split's B and W), each the fastest of ``repeats`` runs after one warm-up run
  (noise on a shared machine only ever adds time); ``pipeline_loss`` is measured apart and added to
  the last layer (so equal layers stay equal);
* the bytes it holds for the whole step: its parameters, their gradients (trainable ones) and
  :data:`OPTIMIZER_STATES` optimizer states per trainable parameter (Adam's two moments), divided
  by the data-parallel size where ``data_parallel_sharding="full"`` shards them;
* the bytes it keeps per microbatch in flight: the tensors its forward saves for backward
  (counted once per storage, parameters left out).

One layer is held at a time, as a copy (so the model's own parameters, gradients and buffers are
untouched); a layer built on the meta device is materialised for the measurement only, with the
model's own initialisation, and freed after it. Layers that are identical (same structure and
parameter shapes, as ``repr`` and the parameters tell, and the same input shapes) are measured
once: a model of 48 equal blocks measures one block. Random state is forked around the
measurement, so training draws the same random numbers as without it.

:func:`decide_layout` measures on global rank 0 only, lets the pure chooser
(:func:`~lightning_pp.schedules.auto_layout.choose_layout`) pick the layout for the resolved
schedule, and broadcasts the choice (or rank 0's error) to every rank, so every rank takes the
same layout or raises the same error.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_pp.runtime.cut.layout import balanced_layout
from lightning_pp.runtime.cut.meta import has_meta_tensors, materialize
from lightning_pp.runtime.cut.partition import default_pipeline_inputs
from lightning_pp.runtime.layer import run_layer
from lightning_pp.runtime.process import CHECKPOINT, copy_facts, fact
from lightning_pp.runtime.step.microbatch import map_tensors, split_microbatches, tensors_in
from lightning_pp.schedules.auto_layout import LayerCost, LayerCosts, LayoutChoice, choose_layout
from lightning_pp.schedules.tables import ScheduleConfig

_log = logging.getLogger("lightning_pp")
#: Optimizer states counted per trainable parameter (Adam's first and second moments).
OPTIMIZER_STATES = 2


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> float:
    """The time now, after the device finished what was queued (CUDA kernels run asynchronously)."""
    _synchronize(device)
    return time.perf_counter()


def _signature(layer: nn.Module, x: Any, first: bool) -> tuple:
    """What makes two layers cost the same: their structure and configuration (``repr``), their
    parameters' and buffers' shapes, dtypes and trainability, the activation-checkpointing mark,
    the shapes and dtypes of their input, and whether that input is data (the first layer's:
    no input gradient)."""
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in layer.named_buffers())
    inputs = tuple((tuple(t.shape), str(t.dtype)) for t in tensors_in(x))
    return (type(layer), repr(layer), params, buffers, bool(fact(layer, CHECKPOINT, False)), inputs, first)


def parameter_bytes(parameters, shards: int = 1) -> float:
    """Bytes that ``parameters`` hold for a whole step: each parameter, and for a trainable one its
    gradient and :data:`OPTIMIZER_STATES` optimizer states, divided over ``shards`` replicas."""
    total = 0
    for p in {id(p): p for p in parameters}.values():
        size = p.numel() * p.element_size()
        total += size * (1 + OPTIMIZER_STATES + 1) if p.requires_grad else size
    return total / shards


def _leaf_inputs(x: Any, grad: bool) -> Any:
    """``x`` detached; with ``grad``, floating-point tensors made leaves that require grad (the
    layer's input gradient; the first layer's input is data, whose gradient nobody computes)."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if grad and (t.is_floating_point() or t.is_complex()) else t
    return map_tensors(leaf, x)


def _loss_tensor(loss: Any) -> torch.Tensor:
    return loss[0] if isinstance(loss, (tuple, list)) else loss


def _measure_one(fn: Callable[[Any], Any], x: Any, input_grad: bool, params: Sequence[torch.Tensor],
                 device: torch.device, repeats: int) -> tuple[float, float, float, float, Any]:
    """``(forward, input gradient, weight gradient, bytes saved for backward, output)`` of
    ``fn(x)``: the fastest of ``repeats`` runs after a warm-up run (noise only ever adds time), the
    saved bytes counted once per storage, ``params`` left out."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    times: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    out = None
    for run in range(repeats + 1):
        inputs = _leaf_inputs(x, input_grad)
        float_inputs = [t for t in tensors_in(inputs) if t.requires_grad]
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if run == 0 else contextlib.nullcontext()
        start = _clock(device)
        with hooks:
            out = fn(inputs)
        t_f = _clock(device) - start
        outs = [t for t in tensors_in(out) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        t_b = t_w = 0.0
        if outs:  # else nothing to differentiate (a frozen layer on integer inputs)
            # As the zero-bubble split runs them: the input gradient, then the weight gradient
            # from what it left (the graph kept in between).
            if float_inputs:
                start = _clock(device)
                torch.autograd.grad(outs, float_inputs, grads, retain_graph=bool(params), allow_unused=True)
                t_b = _clock(device) - start
            if params:
                start = _clock(device)
                torch.autograd.grad(outs, list(params), grads, allow_unused=True)
                t_w = _clock(device) - start
        if run:
            times["F"].append(t_f)
            times["B"].append(t_b)
            times["W"].append(t_w)
    return min(times["F"]), min(times["B"]), min(times["W"]), float(sum(saved.values())), out


def measure_layer_costs(module: nn.Module, layers: Sequence[nn.Module], batch: Any, num_microbatches: int,
                        device: torch.device = torch.device("cpu"), repeats: int = 3, shards: int = 1,
                        loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                        inputs_fn: Optional[Callable[[Any], Any]] = None) -> LayerCosts:
    """What each of ``layers`` costs on one microbatch of ``batch`` (module docstring). ``loss_fn``
    defaults to ``module.pipeline_loss`` (its ``self.log`` calls are dropped while measuring),
    ``inputs_fn`` to ``module.pipeline_inputs``."""
    microbatch = map_tensors(lambda t: t.to(device), split_microbatches(batch, num_microbatches)[0])
    inputs_fn = inputs_fn or getattr(module, "pipeline_inputs", None) or default_pipeline_inputs
    loss_fn = loss_fn or module.pipeline_loss
    init_fn, seed = getattr(module, "pipeline_init_weights", None), torch.initial_seed()
    measured: dict[tuple, tuple[LayerCost, Any]] = {}
    costs: list[LayerCost] = []
    devices = [device] if device.type == "cuda" else []
    muted = {name: module.__dict__.get(name) for name in ("log", "log_dict")}
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        module.__dict__["log"] = module.__dict__["log_dict"] = lambda *args, **kwargs: None
        try:
            x = inputs_fn(microbatch)
            for index, layer in enumerate(layers):
                key = _signature(layer, x, index == 0)
                if key not in measured:
                    work = copy.deepcopy(layer)  # the model's own layer stays untouched
                    copy_facts(layer, work)  # recomputed in backward as the layer is
                    if has_meta_tensors(work):
                        materialize(work, device, seed, init_fn)
                    work.to(device)
                    params = list({id(p): p for p in work.parameters()}.values())
                    f, b, w, kept, out = _measure_one(functools.partial(run_layer, work), x, index > 0,
                                                      [p for p in params if p.requires_grad], device, repeats)
                    cost = LayerCost(f, b, w, parameter_bytes(params, shards), kept)
                    measured[key] = (cost, map_tensors(lambda t: t.detach(), out))
                    del work
                cost, x = measured[key]
                costs.append(cost)
            # The loss runs on the last stage after its last layer: its forward and its gradient
            # (into the output) are the last layer's, measured apart so that equal layers stay equal.
            f, b, _, kept, _ = _measure_one(lambda out: _loss_tensor(loss_fn(out, microbatch)), x, True, [], device,
                                            repeats)
            last = costs[-1]
            costs[-1] = last._replace(forward=last.forward + f, backward=last.backward + b,
                                      activation_bytes=last.activation_bytes + kept)
        finally:
            for name, value in muted.items():
                if value is None:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
    shape = [tuple(t.shape) for t in tensors_in(microbatch)][:3]
    return LayerCosts(tuple(costs), "s", f"measured on {device.type}, one microbatch (tensors {shape}), "
                      f"{len(measured)} distinct layers of {len(layers)}, fastest of {repeats} runs")


def batch_to_measure(module: nn.Module, layout: Any, num_layers: int, num_stages: int, example_batch: Any) -> Any:
    """What ``layout="auto"`` measures on: ``example_batch``, else the module's
    ``pipeline_example_batch`` (called later, on rank 0 only); raises ``ValueError`` (before any
    process group exists) when there is neither, or too few layers for the stages."""
    balanced_layout(num_layers, num_stages)  # enough layers for the stages (its error names them)
    batch = example_batch if example_batch is not None else getattr(module, "pipeline_example_batch", None)
    if batch is None:
        raise ValueError(
            f"layout={layout!r} measures every pipeline layer on one real training batch before the cut, "
            f"and none was given: give {type(module).__name__} a `pipeline_example_batch(self)` method returning "
            f"one batch as your dataloader yields it, or pass build_pipeline(..., example_batch=batch) (the "
            f"Trainer strategy takes the first batch of the training dataloader).")
    return batch


def decide_layout(module: nn.Module, layers: Sequence[nn.Module], schedule: ScheduleConfig, batch: Any,
                  device: torch.device, memory_budget: Optional[float] = None, repeats: int = 3,
                  shards: int = 1) -> LayoutChoice:
    """Measure on global rank 0, choose there, and give every rank the same :class:`LayoutChoice`
    (or raise rank 0's error on every rank). ``batch``: one training batch, or a function
    returning one (called on rank 0 only)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    box: list = [None]
    if rank == 0:
        try:
            example = batch() if callable(batch) else batch
            costs = measure_layer_costs(module, layers, example, schedule.num_microbatches, device, repeats, shards)
            choice = choose_layout(schedule, costs, memory_budget)
            for estimate in (choice.chosen, choice.even):
                estimate.result = None  # the replayed events stay here: what ranks need is the layout
            box[0] = choice
        except Exception as err:  # noqa: BLE001 - every rank raises it (below), none waits forever
            box[0] = f"{type(err).__name__}: {err}"
    if distributed:
        dist.broadcast_object_list(box, src=0, device=device if device.type != "cpu" else None)
    if isinstance(box[0], str):
        raise ValueError(f"layout='auto' failed on global rank 0 while measuring or choosing: {box[0]}")
    choice = box[0]
    if rank == 0:
        _log.info("lightning_pp: %s", choice.describe())
    return choice


__all__ = ["OPTIMIZER_STATES", "batch_to_measure", "decide_layout", "measure_layer_costs", "parameter_bytes"]
