"""``layout="auto"``: measuring what every pipeline layer costs, and deciding the layout once for all ranks.

:func:`measure_layer_costs` runs the model's pipeline layers one after the other on one microbatch
of a real batch (the first of the ``num_microbatches`` it is split into, so every layer sees the
shapes it sees in training) and records, per layer (:class:`~lightning_pp.schedules.auto_layout.LayerCost`):

* the time of its forward; of its backward as the runtime runs it (the runtime's own ways into
  autograd, :mod:`lightning_pp.runtime.plans.weight_grad`): split, the input gradient (``B``; none
  for the first layer, whose input is data) then the weight gradient from what it kept (``W``),
  as the zero-bubble schedules run them, and whole, in one pass (``full_backward``), as the others
  do. Each is the interquartile mean of at least ``repeats`` runs after a warm-up run, more until
  :data:`MIN_SECONDS` have passed: the time a run usually takes with the machine as busy as it is
  in training (:func:`decide_layout` has every rank measure at once). The fixed cost of entering
  autograd (:func:`backward_entries`) is taken out of each layer's backward and charged once per
  action instead (``LayerCosts.overhead``). ``pipeline_loss`` is measured apart and added to the
  last layer (so equal layers stay equal);
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

:func:`decide_layout` has every rank measure at once, on the first microbatch of rank 0's batch
(broadcast), so the times include what running side by side costs (cores and memory bandwidth
shared with the other ranks); neighbouring ranks then exchange a stage-boundary message
(:func:`measure_link`, the fastest round trip: the link's own cost) to price each hand-off
between ranks. Rank 0 takes the median over the ranks of each measured time, lets the pure
chooser (:func:`~lightning_pp.schedules.auto_layout.choose_layout`) pick the layout for the
resolved schedule, and broadcasts the choice (or the first failing rank's error) to every rank,
so every rank takes the same layout or raises the same error.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_pp.runtime.cut.layout import balanced_layout
from lightning_pp.runtime.cut.meta import has_meta_tensors, materialize
from lightning_pp.runtime.cut.partition import default_pipeline_inputs
from lightning_pp.runtime.layer import run_layer
from lightning_pp.runtime.measure_runtime import backward_entries, clock, measure_link, typical
from lightning_pp.runtime.plans.weight_grad import DeferredWeights, engine_backward
from lightning_pp.runtime.process import CHECKPOINT, copy_facts, fact
from lightning_pp.runtime.step.microbatch import map_tensors, split_microbatches, tensors_in
from lightning_pp.schedules.auto_layout import LayerCost, LayerCosts, LayoutChoice, choose_layout
from lightning_pp.schedules.costs import StageCost
from lightning_pp.schedules.tables import ScheduleConfig

_log = logging.getLogger("lightning_pp")
#: Optimizer states counted per trainable parameter (Adam's first and second moments).
OPTIMIZER_STATES = 2


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


#: Each distinct layer is run at least ``repeats`` times and until its runs took this many seconds
#: (a short layer is timed many times: a time slice lost to another process lands on few of them).
MIN_SECONDS = 0.05
#: ... but at most this many runs.
MAX_RUNS = 100


def _measure_one(fn: Callable[[Any], Any], x: Any, input_grad: bool, params: Sequence[torch.Tensor],
                 device: torch.device, repeats: int) -> tuple[float, float, float, float, float, Any]:
    """``(forward, input gradient, weight gradient, whole backward, bytes saved for backward,
    output)`` of ``fn(x)``: interquartile means (:func:`typical`) of at least ``repeats`` runs
    after a warm-up run, more until they took :data:`MIN_SECONDS` (the times a training step sees,
    other work on the machine included), the saved bytes counted once per storage,
    ``params`` left out. Each run times the forward twice: once before the backward split as the
    zero-bubble schedules run it (input gradient, then weight gradient from what it kept: the
    runtime's own :class:`DeferredWeights`), once before the whole backward in one pass (as the
    other schedules run it)."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    times: dict[str, list[float]] = {"F": [], "B": [], "W": [], "BW": []}
    out = None
    run, began = 0, time.perf_counter()
    while run <= repeats or (time.perf_counter() - began < MIN_SECONDS and run <= MAX_RUNS):
        if run == 1:
            began = time.perf_counter()  # the warm-up run does not count
        for split in (True, False):
            inputs = _leaf_inputs(x, input_grad)
            float_inputs = [t for t in tensors_in(inputs) if t.requires_grad]
            hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if run == 0 and split
                     else contextlib.nullcontext())
            start = clock(device)
            with hooks:
                out = fn(inputs)
            t_f = clock(device) - start
            outs = [t for t in tensors_in(out) if t.requires_grad]
            grads = [torch.ones_like(t) for t in outs]
            t_b = t_w = 0.0
            if outs:  # else nothing to differentiate (a frozen layer on integer inputs)
                # As the runtime runs them (lightning_pp.runtime.plans.weight_grad): gradients
                # accumulate into ``.grad`` (of this copy's parameters and the leaf inputs).
                if split:
                    weights = DeferredWeights(params)
                    start = clock(device)
                    weights.input_grads(outs, grads, float_inputs)  # B: nothing without float inputs
                    t_b = clock(device) - start if float_inputs else 0.0
                    start = clock(device)
                    weights.run()
                    t_w = clock(device) - start
                else:
                    start = clock(device)
                    engine_backward(outs, grads)
                    t_b = clock(device) - start
            if run:
                times["F"].append(t_f)
                if split:
                    times["B"].append(t_b)
                    times["W"].append(t_w)
                else:
                    times["BW"].append(t_b)
        run += 1
    return (typical(times["F"]), typical(times["B"]), typical(times["W"]), typical(times["BW"]),
            float(sum(saved.values())), out)


def _tensor_bytes(x: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors_in(x)))


def measure_layer_costs(module: nn.Module, layers: Sequence[nn.Module], batch: Any, num_microbatches: int,
                        device: torch.device = torch.device("cpu"), repeats: int = 3, shards: int = 1,
                        loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                        inputs_fn: Optional[Callable[[Any], Any]] = None, split: bool = False) -> LayerCosts:
    """What each of ``layers`` costs on one microbatch of ``batch`` (module docstring). ``loss_fn``
    defaults to ``module.pipeline_loss`` (its ``self.log`` calls are dropped while measuring),
    ``inputs_fn`` to ``module.pipeline_inputs``. The result's ``overhead`` is the entry into
    autograd (:func:`backward_entries`) per B and W action of a schedule that splits its
    backwards (``split``), else per whole backward: taken out of each layer's measured backward,
    which pays it once per layer. Its ``boundary_bytes`` is the median size of the layers' outputs
    (what crosses a stage boundary); the link itself is measured by :func:`measure_link`."""
    microbatch = map_tensors(lambda t: t.to(device), split_microbatches(batch, num_microbatches)[0])
    inputs_fn = inputs_fn or getattr(module, "pipeline_inputs", None) or default_pipeline_inputs
    loss_fn = loss_fn or module.pipeline_loss
    init_fn, seed = getattr(module, "pipeline_init_weights", None), torch.initial_seed()
    measured: dict[tuple, tuple[LayerCost, Any]] = {}
    costs: list[LayerCost] = []
    outputs: list[float] = []
    devices = [device] if device.type == "cuda" else []
    muted = {name: module.__dict__.get(name) for name in ("log", "log_dict")}
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        module.__dict__["log"] = module.__dict__["log_dict"] = lambda *args, **kwargs: None
        try:
            whole_entry, b_entry, w_entry = backward_entries(device)

            def net(seconds: float, entry: float) -> float:  # a measured backward less its entry
                return max(0.0, seconds - entry) if seconds > 0 else 0.0

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
                    f, b, w, bw, kept, out = _measure_one(functools.partial(run_layer, work), x, index > 0,
                                                          [p for p in params if p.requires_grad], device, repeats)
                    cost = LayerCost(f, net(b, b_entry), net(w, w_entry), parameter_bytes(params, shards), kept,
                                     net(bw, whole_entry))
                    measured[key] = (cost, map_tensors(lambda t: t.detach(), out))
                    del work
                cost, x = measured[key]
                costs.append(cost)
                outputs.append(_tensor_bytes(x))
            # The loss runs on the last stage after its last layer: its forward and its gradient
            # (into the output) are the last layer's, measured apart so that equal layers stay equal.
            f, b, _, bw, kept, _ = _measure_one(lambda out: _loss_tensor(loss_fn(out, microbatch)), x, True, [],
                                                device, repeats)
            last = costs[-1]
            costs[-1] = last._replace(forward=last.forward + f, backward=last.backward + net(b, b_entry),
                                      activation_bytes=last.activation_bytes + kept,
                                      full_backward=last.full_backward + net(bw, whole_entry))
        finally:
            for name, value in muted.items():
                if value is None:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
    shape = [tuple(t.shape) for t in tensors_in(microbatch)][:3]
    return LayerCosts(tuple(costs), "s", f"measured on {device.type}, one microbatch (tensors {shape}), "
                      f"{len(measured)} distinct layers of {len(layers)}, interquartile means of >= {repeats} runs",
                      overhead=StageCost(0.0, b_entry, w_entry) if split else StageCost(0.0, whole_entry, 0.0),
                      boundary_bytes=statistics.median(outputs[:-1]) if len(outputs) > 1 else 0.0)


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


def _combine(measured: Sequence[LayerCosts], links: Sequence[tuple[float, float]]) -> LayerCosts:
    """One :class:`LayerCosts` from every rank's: each time the median over the ranks (each
    measured while the others measured too), bytes from the first; the link from the ranks that
    had a peer."""
    first, n = measured[0], len(measured)

    def mean(values) -> float:  # the median over ranks: one rank's burst of load does not move it
        return statistics.median(values)

    layers = tuple(
        LayerCost(mean([m.layers[i].forward for m in measured]), mean([m.layers[i].backward for m in measured]),
                  mean([m.layers[i].weight_grad for m in measured]), first.layers[i].static_bytes,
                  first.layers[i].activation_bytes, mean([m.layers[i].whole_backward for m in measured]))
        for i in range(len(first.layers)))
    overhead = StageCost(*(mean([m.overhead[k] for m in measured]) for k in range(3)))
    paired = [link for link in links if link[0] > 0]
    hop, per_byte = (mean([h for h, _ in paired]), mean([p for _, p in paired])) if paired else (0.0, 0.0)
    size = first.boundary_bytes
    latency = max(0.0, hop - size * per_byte)
    return LayerCosts(layers, first.unit, f"{first.note}, on {n} rank{'s' if n > 1 else ''} at once", None, overhead,
                      latency, 1.0 / per_byte if per_byte > 0 else math.inf, size if hop > 0 else 0.0)


def decide_layout(module: nn.Module, layers: Sequence[nn.Module], schedule: ScheduleConfig, batch: Any,
                  device: torch.device, memory_budget: Optional[float] = None, repeats: int = 3,
                  shards: int = 1) -> LayoutChoice:
    """Measure on every rank at once (so the times include what running side by side costs:
    shared cores, memory bandwidth), choose on global rank 0, and give every rank the same
    :class:`LayoutChoice` (or raise the first failing rank's error on every rank). ``batch``: one
    training batch, or a function returning one (called on rank 0 only, whose first microbatch
    every rank then measures on)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    objects_on = device if device.type != "cpu" else None
    box: list = [None]
    if rank == 0:
        try:
            example = batch() if callable(batch) else batch
            box[0] = map_tensors(lambda t: t.detach().cpu(),
                                 split_microbatches(example, schedule.num_microbatches)[0])
        except Exception as err:  # noqa: BLE001 - every rank raises it (below), none waits forever
            box[0] = f"{type(err).__name__}: {err}"
    if distributed:
        dist.broadcast_object_list(box, src=0, device=objects_on)
    mine: Any
    if isinstance(box[0], str):
        mine = box[0]
    else:
        try:
            mine = measure_layer_costs(module, layers, box[0], 1, device, repeats, shards,
                                       split=schedule.spec.splits_backward)
        except Exception as err:  # noqa: BLE001 - every rank raises it (below), none waits forever
            mine = f"{type(err).__name__}: {err}"
    failed = [mine]
    if distributed:
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, mine if isinstance(mine, str) else None)
    error = next((f for f in failed if f is not None), None)
    link = (0.0, 0.0)
    if distributed and error is None:
        link = measure_link(mine.boundary_bytes, device)
    gathered = [(mine, link)]
    if distributed and error is None:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, link))
    box = [error]
    if rank == 0 and error is None:
        try:
            costs = _combine([m for m, _ in gathered], [k for _, k in gathered])
            choice = choose_layout(schedule, costs, memory_budget)
            for estimate in (choice.chosen, choice.even):
                estimate.result = None  # the replayed events stay here: what ranks need is the layout
            box[0] = choice
        except Exception as err:  # noqa: BLE001 - every rank raises it (below), none waits forever
            box[0] = f"{type(err).__name__}: {err}"
    if distributed:
        dist.broadcast_object_list(box, src=0, device=objects_on)
    if isinstance(box[0], str):
        raise ValueError(f"layout='auto' failed while measuring or choosing: {box[0]}")
    choice = box[0]
    if rank == 0:
        _log.info("lightning_pp: %s", choice.describe())
    return choice


__all__ = ["MAX_RUNS", "MIN_SECONDS", "OPTIMIZER_STATES", "batch_to_measure", "decide_layout", "measure_layer_costs",
           "parameter_bytes"]
