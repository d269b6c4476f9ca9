"""One rank's stage work: the forward and backward of one (microbatch, chunk), over an explicit
step state.

A forward receives its input from the previous virtual stage (or calls ``pipeline_inputs`` on the
first stage), runs the chunk and sends the output on (or computes ``pipeline_loss`` on the last
stage), keeping a :class:`Stash` for its backward. A backward gets its outputs' gradients (from the
next stage, or from the loss), runs autograd through the chunk and sends the input gradients back.
Under combined 1F1B every chunk runs through its schedule plan (:mod:`lightning_pp.runtime.plans.plan`),
and these transfers are the plan's hooks, so they happen inside the fused step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from lightning_pp.runtime.context import microbatch_context
from lightning_pp.runtime.failure.errors import PipelineCommError
from lightning_pp.runtime.step.loss import normalise_loss
from lightning_pp.runtime.step.microbatch import batch_size, map_tensors
from lightning_pp.runtime.plans.nodes import sending
from lightning_pp.runtime.transport.p2p import PointToPoint
from lightning_pp.runtime.cut.partition import Partition
from lightning_pp.runtime.step.rng import StageRNG
from lightning_pp.runtime.timeline import Timeline
from lightning_pp.runtime.tp.params import refuse_distributed_values
from lightning_pp.runtime.plans.weight_grad import DeferredWeights, engine_backward
from lightning_pp.schedules import ScheduleConfig
from lightning_pp.schedules.messages import Message


class Stash(NamedTuple):
    """What a forward keeps for its backward."""

    received: tuple[torch.Tensor, ...]  # the stage's received inputs (their .grad are the input gradients)
    # The outputs sent on (as :func:`kept_for_backward` keeps them when no plan runs the chunk), or
    # (loss_sum,) on the last stage.
    outputs: tuple[Any, ...]
    is_loss: bool
    plan: Any  # the schedule plan (combined 1F1B), else None
    detached: Any  # last stage with a plan: the detached outputs the loss was computed from


@dataclass
class StepState:
    """Everything one step accumulates, handed to every action of the step."""

    microbatches: list[Any]
    train: bool
    compute_loss: bool
    collect: bool
    loss_sum: torch.Tensor
    count: torch.Tensor
    saved: dict[tuple[int, int], Stash] = field(default_factory=dict)  # (microbatch, chunk) -> its Stash
    deferred: frozenset[tuple[int, int]] = frozenset()  # (microbatch, chunk) whose weight gradient is a later W
    weight_work: dict[tuple[int, int], DeferredWeights] = field(default_factory=dict)  # from a B to its W
    local: dict[Message, tuple[tuple[torch.Tensor, ...], bool]] = field(default_factory=dict)  # same-rank hand-offs
    outputs: list[Any] = field(default_factory=list)  # last stage, forward-only: per-microbatch outputs

    @classmethod
    def start(cls, microbatches: list, train: bool, compute_loss: bool, collect: bool,
              device: torch.device, deferred: frozenset = frozenset()) -> "StepState":
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(microbatches, train, compute_loss, collect, zero, zero.clone(), deferred=deferred)


class StageRunner:
    """Runs the forward, backward or both of one (microbatch, chunk) of this rank.

    ``loss_fn``, ``inputs_fn`` and ``predict_fn`` are the model's ``pipeline_loss``,
    ``pipeline_inputs`` and optional ``pipeline_predict`` (the strategies wrap ``loss_fn`` to
    record ``self.log`` calls). ``wait(work, what)`` is the executor's bounded collective wait,
    handed to the layers through the microbatch context."""

    tensor_parallel = False  # set by build_pipeline: whether outputs are checked for DTensors

    def __init__(self, partition: Partition, p2p: PointToPoint, config: ScheduleConfig, pp_rank: int, rng: StageRNG,
                 timeline: Timeline, wait: Callable[[Any, str], None], describe: Callable[[], str], use_plans: bool,
                 loss_fn: Callable, inputs_fn: Callable, predict_fn: Optional[Callable]) -> None:
        self.partition, self.p2p, self.rng, self.timeline = partition, p2p, rng, timeline
        self.owner_of, self.pp_rank = config.owner_of, pp_rank  # where each virtual stage lives
        self.num_stages = len(partition.layout)
        self.wait, self.describe, self.use_plans = wait, describe, use_plans
        self.loss_fn, self.inputs_fn, self.predict_fn = loss_fn, inputs_fn, predict_fn

    # -- one action ---------------------------------------------------------------------------
    def forward(self, state: StepState, microbatch: int, chunk_id: int) -> None:
        if self.use_plans and state.train:
            with self._context(state, microbatch, chunk_id), self.rng.stream(chunk_id):
                plan, hooks = self._forward_plan(state, microbatch, chunk_id)
                type(plan).run(plan, None, **hooks)
            return
        received, inputs = self._stage_input(state, microbatch, chunk_id)
        with self._context(state, microbatch, chunk_id), self.rng.stream(chunk_id), torch.set_grad_enabled(state.train):
            output = self.partition.chunks[chunk_id](inputs)
        self._finish_forward(state, microbatch, chunk_id, received, output, None)

    def backward(self, state: StepState, microbatch: int, chunk_id: int) -> None:
        weights = self._deferred_weights(state, microbatch, chunk_id)
        if state.saved[(microbatch, chunk_id)].plan is not None:
            with self._context(state, microbatch, chunk_id, deferred=weights):
                plan, hooks = self._backward_plan(state, microbatch, chunk_id)
                type(plan).run(None, plan, **hooks)
            return
        received, _, roots, grads = self._output_grads(state, microbatch, chunk_id)
        with self._context(state, microbatch, chunk_id):
            if weights is not None:  # zero-bubble: input gradient now, weights at W
                in_grads = weights.input_grads(roots or (), grads or (), received)
            else:
                if roots:
                    engine_backward(roots, grads)
                in_grads = tuple(t.grad for t in received)
        self._finish_backward(state, microbatch, chunk_id, received, in_grads)

    def _deferred_weights(self, state: StepState, microbatch: int, chunk_id: int) -> Optional[DeferredWeights]:
        """Where the backward of (microbatch, chunk) leaves its weight gradients for its W action
        (registered for the W), or ``None`` if the table has no W for it (a whole backward). A
        chunk run through its schedule plan splits node by node, a plain chunk as one segment."""
        if (microbatch, chunk_id) not in state.deferred:
            return None
        weights = DeferredWeights(list(self.partition.chunks[chunk_id].parameters()))
        state.weight_work[(microbatch, chunk_id)] = weights
        return weights

    def weight(self, state: StepState, microbatch: int, chunk_id: int) -> None:
        """The deferred weight gradient of a backward that ran as input-gradient only."""
        with self._context(state, microbatch, chunk_id):
            state.weight_work.pop((microbatch, chunk_id)).run()

    def forward_backward(self, state: StepState, f: tuple[int, int], b: tuple[int, int]) -> None:
        """Combined step: the forward of ``f`` and the backward of ``b``, their layers interleaved so
        that one's expert all-to-all runs while the other computes."""
        if not self.use_plans:
            self.forward(state, *f)
            self.backward(state, *b)
            return
        # Backward nodes draw no random numbers; only b's nodes run backwards, so only they defer.
        with self._context(state, *f, deferred=self._deferred_weights(state, *b)), self.rng.stream(f[1]):
            f_plan, f_hooks = self._forward_plan(state, *f)
            b_plan, b_hooks = self._backward_plan(state, *b)
            if type(f_plan) is type(b_plan):  # the plan class fuses them, the hooks carry the transfers
                type(f_plan).run(f_plan, b_plan, **f_hooks, **b_hooks)
            else:  # chunks of different plan classes (a layer with its own): one after the other
                type(f_plan).run(f_plan, None, **f_hooks)
                type(b_plan).run(None, b_plan, **b_hooks)

    # -- schedule plans and their hooks -------------------------------------------------------
    def _forward_plan(self, state: StepState, microbatch: int, chunk_id: int):
        """The chunk's plan for ``microbatch`` (built with the pipeline inputs on the first stage)
        and the hooks that carry its stage-boundary transfers: ``pre_forward`` receives the input,
        ``post_forward`` sends the output on (or computes the loss on the last stage)."""
        chunk = self.partition.chunks[chunk_id]
        received_box: list = [()]
        pre_forward = None
        if chunk.stage == 0:
            inputs = self.inputs_fn(state.microbatches[microbatch])
            plan = chunk.build_schedule_plan(*(inputs if isinstance(inputs, tuple) else (inputs,)))
        else:
            plan = chunk.build_schedule_plan()

            def pre_forward():
                received, inputs = self._stage_input(state, microbatch, chunk_id)
                received_box[0] = received
                return inputs if isinstance(inputs, tuple) else (inputs,)

        def post_forward(outputs):
            self._finish_forward(state, microbatch, chunk_id, received_box[0], untuple(outputs), plan)

        return plan, dict(pre_forward=pre_forward, post_forward=post_forward)

    def _backward_plan(self, state: StepState, microbatch: int, chunk_id: int):
        """The plan a forward stashed, and the hooks of its backward: ``pre_backward`` gets the
        output gradients (received, or the loss's), ``post_backward`` sends the input gradients."""
        plan = state.saved[(microbatch, chunk_id)].plan
        received_box: list = [()]

        def pre_backward():
            received, _, _, grads = self._output_grads(state, microbatch, chunk_id)
            received_box[0] = received
            return grads

        def post_backward(in_grads):
            self._finish_backward(state, microbatch, chunk_id, received_box[0], in_grads)

        return plan, dict(pre_backward=pre_backward, post_backward=post_backward)

    # -- transfers ----------------------------------------------------------------------------
    def _deliver(self, state: StepState, stage: int, message: Message, tensors: tuple, as_tuple: bool) -> None:
        if self.tensor_parallel:
            refuse_distributed_values(tensors, f"what virtual stage {stage} receives ({message.describe()})")
        dst = self.owner_of(stage)[0]
        if dst == self.pp_rank:
            # Same-rank hand-off (pp == 1 with several chunks, the tip of a V): a fresh leaf, like a
            # received tensor.
            state.local[message] = (tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors), as_tuple)
        elif message.direction == "F" and self.use_plans:
            with sending():  # combined 1F1B: forward sends from the comm stream
                self.p2p.send(dst, message, tensors, as_tuple)
        else:
            self.p2p.send(dst, message, tensors, as_tuple)

    def _receive(self, state: StepState, stage: int, message: Message) -> tuple[tuple, bool]:
        src = self.owner_of(stage)[0]
        if src == self.pp_rank:
            return state.local.pop(message)
        return self.p2p.recv(src, message)

    def _stage_input(self, state: StepState, microbatch: int, chunk_id: int) -> tuple[tuple, Any]:
        """(received tensors, the chunk's input) for a forward."""
        stage = self.partition.chunks[chunk_id].stage
        if stage == 0:
            return (), self.inputs_fn(state.microbatches[microbatch])
        received, as_tuple = self._receive(state, stage - 1, Message("F", microbatch, stage))
        return received, (received if as_tuple else received[0])

    def _context(self, state: StepState, microbatch: int, chunk_id: int, deferred: Optional[DeferredWeights] = None):
        samples = batch_size(state.microbatches[microbatch]) or 1
        return microbatch_context(float(samples), microbatch, chunk_id, self.timeline, self.wait, deferred)

    # -- the two halves of a forward and of a backward ------------------------------------------
    def _finish_forward(self, state: StepState, microbatch: int, chunk_id: int, received: tuple, output: Any,
                        plan) -> None:
        chunk = self.partition.chunks[chunk_id]
        stage = chunk.stage
        mb_batch = state.microbatches[microbatch]
        if stage == self.num_stages - 1:
            if state.collect:
                value = self.predict_fn(output, mb_batch) if self.predict_fn is not None else output
                state.outputs.append(value.detach() if isinstance(value, torch.Tensor) else value)
            if not (state.train or state.compute_loss):
                return
            detached = None
            if plan is not None:  # the loss is its own autograd segment; its grad feeds the plan
                detached = map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), output)
                output = detached
            with torch.set_grad_enabled(state.train):
                samples = batch_size(mb_batch) or 1
                if self.tensor_parallel:
                    refuse_distributed_values(output, "the last pipeline layer's output, given to pipeline_loss,")
                loss_sum, count = normalise_loss(self.loss_fn(output, mb_batch), samples)
            state.loss_sum += loss_sum.detach().to(torch.float64)
            state.count += count.to(state.count.device)
            if state.train:
                state.saved[(microbatch, chunk_id)] = Stash(received, (loss_sum,), True, plan, detached)
            return
        tensors, as_tuple = as_tensors(
            output, f"virtual stage {stage} (layers {chunk.first_layer}..{chunk.first_layer + len(chunk.layers) - 1})"
        )
        self._deliver(state, stage + 1, Message("F", microbatch, stage + 1), tensors, as_tuple)
        if state.train:
            kept = tensors if plan is not None else kept_for_backward(tensors)  # a plan holds its own outputs
            state.saved[(microbatch, chunk_id)] = Stash(received, kept, False, plan, None)

    def _output_grads(self, state: StepState, microbatch: int, chunk_id: int):
        """Pop the stash of a forward and get the gradients of its outputs: from the loss on the
        last stage, else from the next stage. Returns (received, plan, roots, grads)."""
        stage = self.partition.chunks[chunk_id].stage
        received, outputs, is_loss, plan, detached = state.saved.pop((microbatch, chunk_id))
        if is_loss:
            roots, grads = list(outputs), [torch.ones_like(outputs[0])]
            if plan is not None:
                engine_backward(roots, grads)
                leaves = detached if isinstance(detached, tuple) else (detached,)
                return received, plan, None, tuple(t.grad if t.requires_grad else None for t in leaves)
            return received, None, roots, grads
        out_grads, _ = self._receive(state, stage + 1, Message("B", microbatch, stage))
        needing = [t for t in outputs if needs_grad(t)]
        if len(needing) != len(out_grads):
            raise PipelineCommError(
                f"{self.describe()}: stage {stage} produced {len(needing)} outputs that need a "
                f"gradient, but {len(out_grads)} gradients came back for microbatch {microbatch}."
            )
        grads = [None if is_no_grad(g) else g for g in out_grads]
        if plan is not None:
            it = iter(grads)
            return received, plan, None, tuple(next(it) if needs_grad(t) else None for t in outputs)
        pairs = [(t, g) for t, g in zip(needing, grads) if g is not None]
        return received, None, [t for t, _ in pairs], [g for _, g in pairs]

    def _finish_backward(self, state: StepState, microbatch: int, chunk_id: int, received: tuple,
                         in_grads: tuple) -> None:
        stage = self.partition.chunks[chunk_id].stage
        if stage > 0:
            grads = tuple(g if g is not None else no_grad_marker(t) for t, g in zip(received, in_grads) if t.requires_grad)
            self._deliver(state, stage - 1, Message("B", microbatch, stage - 1), grads, True)


# -- tensors at stage boundaries ---------------------------------------------------------------------
def as_tensors(value: Any, where: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return value, True
    raise TypeError(
        f"{where} returned a {type(value).__name__}; between pipeline stages a layer must return a "
        f"tensor or a tuple of tensors (the next layer gets the tuple unpacked). Return tensors only."
    )



def kept_for_backward(tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """What the stash keeps of sent stage outputs for their backward: the autograd edge of each
    output computed in the stage (``get_gradient_edge``: the node and output number the incoming
    gradient enters), ``None`` for an output that needs no gradient, and the tensor itself only for
    a leaf (a received input or a parameter passed through, which the stage holds anyway).

    The runtime thus holds no reference to a computed output's storage once its send completes, so
    the storage is freed exactly when nothing else holds it: on a chain (the output feeds no
    operation of its own stage) right after the send, as the ``.data`` swap this replaces did. An
    output that an operation of the stage saved for its backward (a conditioning tensor returned
    with ``(x, c)`` after ``SiLU(c)``, a skip ``(h, h)`` that a pooling saved, a checkpointed
    layer's input kept for recomputation, a compiled graph's saved activations) stays alive through
    autograd's own reference, untouched: the user's tensors are never mutated."""
    return tuple(
        None if not t.requires_grad else t if t.grad_fn is None else get_gradient_edge(t) for t in tensors
    )


def needs_grad(kept: Any) -> bool:
    """Whether a stashed output (a tensor, an autograd edge or ``None``) takes a gradient."""
    return isinstance(kept, GradientEdge) or (isinstance(kept, torch.Tensor) and kept.requires_grad)


def no_grad_marker(t: torch.Tensor) -> torch.Tensor:
    """What crosses a stage boundary for a stage input that received no gradient (no path from it
    to the loss: a stop-gradient, an unused output): an empty tensor of the input's dtype and
    number of dimensions. The previous stage then runs no backward from that output, so its
    parameters keep ``grad = None`` as on one device instead of receiving a zero gradient."""
    if t.dim() == 0:
        return torch.zeros_like(t)  # a 0-d tensor has no empty form of its own rank; zero is exact
    return t.new_zeros((0,) + tuple(t.shape[1:]))


def is_no_grad(g: torch.Tensor) -> bool:
    return g.dim() > 0 and g.numel() == 0


def untuple(outputs: tuple) -> Any:
    return outputs[0] if len(outputs) == 1 else outputs
