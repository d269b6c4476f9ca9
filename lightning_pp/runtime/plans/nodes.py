"""The runtime's schedule plans: a chunk's layers for one microbatch, node by node, so that combined
1F1B can run one microbatch's forward and another's backward interleaved (see
:mod:`lightning_pp.runtime.plans.plan` for the contract).

A layer is cut into five slots, each a :class:`~lightning_pp.runtime.plans.plan.ScheduleNode`::

    attn (compute) -> dispatch (comm) -> mlp (compute) -> combine (comm) -> post (compute)

A layer that communicates (an expert-parallel MoE layer) provides them with
``schedule_nodes(event)``; a dense layer is one compute node in ``attn`` and no-ops elsewhere. A
layer that brings its own plan (``build_schedule_plan``) is run through its plan class's ``run``.

:meth:`ChunkSchedulePlan.run` interleaves the layers of two microbatches with Megatron's pairing,
so that the dispatch and combine of one hide behind the compute of the other::

    comm:    combine_bwd(b) | dispatch_fwd(f) | dispatch_bwd(b) | combine_fwd(f)
    compute: attn_fwd(f)    | mlp_bwd(b)      | mlp_fwd(f)      | attn_bwd(b)
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from lightning_pp.runtime.layer import run_layer
from lightning_pp.runtime.plans.plan import (
    Tensors,
    AbstractSchedulePlan,
    NoopScheduleNode,
    PlanEvent,
    ScheduleNode,
    get_comm_stream,
    get_comp_stream,
)
from lightning_pp.runtime.protocols import OwnsSchedulePlan, ProvidesScheduleNodes

_NO_STREAM = nullcontext()  # reusable: nullcontext keeps no state


def sending():
    """Context for launching a stage-boundary send: on CUDA the comm stream, made to wait for the
    compute issued so far (the tensors being sent), so that the send's launch does not sit behind
    compute issued later on the compute stream; on CPU nothing."""
    comm = get_comm_stream()
    if comm is None:
        return _NO_STREAM
    comm.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(comm)


class LayerNodes(NamedTuple):
    """What a communicating layer provides for fine-grained scheduling (``schedule_nodes(event)``)."""

    attn: ScheduleNode
    dispatch: ScheduleNode
    mlp: ScheduleNode
    combine: ScheduleNode
    post: ScheduleNode


def dense_nodes(layer: torch.nn.Module, event: PlanEvent) -> LayerNodes:
    """A layer without nodes of its own: all compute in ``attn``; a tuple input is unpacked."""

    def run(*xs):
        out = run_layer(layer, xs)
        return out if isinstance(out, tuple) else (out,)

    return LayerNodes(ScheduleNode(run, get_comp_stream, event, name="layer"), NoopScheduleNode(event, "dispatch"),
                      NoopScheduleNode(event, "mlp"), NoopScheduleNode(event, "combine"), NoopScheduleNode(event, "post"))


class LayerPlan:
    """One layer's nodes for one microbatch."""

    def __init__(self, layer: torch.nn.Module, event: PlanEvent) -> None:
        # A layer with its own nodes communicates (expert all-to-all): it is paired with another
        # such layer of the other microbatch. A dense layer is one compute node.
        self.communicates = isinstance(layer, ProvidesScheduleNodes)
        self.nodes: LayerNodes = layer.schedule_nodes(event) if self.communicates else dense_nodes(layer, event)

    def forward_slots(self, slots: Sequence[str], x: Tensors) -> Tensors:
        for slot in slots:
            x = getattr(self.nodes, slot).forward(x)
        return x

    def backward_slots(self, slots: Sequence[str], g: Tensors) -> Tensors:
        for slot in slots:
            g = getattr(self.nodes, slot).backward(g)
        return g


class OwnPlanLayer:
    """A layer inside a chunk that brings its own plan class: run through that class's ``run``,
    the previous layer's output handed over by ``pre_forward``."""

    communicates = False

    def __init__(self, layer: torch.nn.Module) -> None:
        self.plan: AbstractSchedulePlan = layer.build_schedule_plan()

    def forward(self, x: Tensors) -> Tensors:
        return type(self.plan).run(self.plan, None, pre_forward=lambda: x)[0]

    def backward(self, g: Tensors) -> Tensors:
        return type(self.plan).run(None, self.plan, grad=g)[1]


FORWARD_SLOTS = ("attn", "dispatch", "mlp", "combine", "post")
BACKWARD_SLOTS = tuple(reversed(FORWARD_SLOTS))


class ChunkSchedulePlan(AbstractSchedulePlan):
    """One microbatch through one pipeline chunk, layer by layer, node by node (what a chunk's
    ``build_schedule_plan(*inputs)`` returns unless its layer brings its own)."""

    def __init__(self, layers: Sequence[torch.nn.Module], inputs: Tensors = ()) -> None:
        self.event = PlanEvent()
        self.layers = [OwnPlanLayer(layer) if isinstance(layer, OwnsSchedulePlan) else LayerPlan(layer, self.event)
                       for layer in layers]
        self.inputs: Tensors = inputs
        self.output: Tensors = ()

    def forward(self, inputs: Tensors = ()) -> Tensors:
        """This microbatch's forward alone (``inputs``: if the plan was built without)."""
        return ChunkSchedulePlan.run(self, None, pre_forward=lambda: inputs)[0]

    def backward(self, grads: Tensors) -> Tensors:
        """This microbatch's backward alone, from its outputs' gradients."""
        return ChunkSchedulePlan.run(None, self, grad=grads)[1]

    @staticmethod
    def run(f_schedule_plan: Optional["ChunkSchedulePlan"], b_schedule_plan: Optional["ChunkSchedulePlan"],
            grad: Optional[Tensors] = None, pre_forward: Optional[Callable] = None,
            pre_backward: Optional[Callable] = None, post_forward: Optional[Callable] = None,
            post_backward: Optional[Callable] = None):
        """See :meth:`AbstractSchedulePlan.run`. Layers are interleaved (forward layers in order,
        backward layers in reverse).

        Layers that communicate are paired with each other (Megatron keeps the embedding and the
        output layer outside its layer pairing for the same reason): pairing an MoE layer with a
        dense one would leave the MoE layer's all-to-all only the dense layer's compute to hide
        behind. Dense layers run on their own, backward ones first (they need nothing from the
        forward side, so a forward combine still in flight keeps hiding behind them)."""
        f, b = f_schedule_plan, b_schedule_plan
        x = g = None
        if f is not None:
            x = f.inputs if f.inputs else _as_tuple(pre_forward())
        if b is not None:
            g = grad if grad is not None else _as_tuple(pre_backward())
        x, g = _interleave(f.layers if f is not None else [], list(reversed(b.layers)) if b is not None else [], x, g)
        if f is not None:
            f.event.wait()
            f.output = x
            if post_forward is not None:
                post_forward(x)
        if b is not None:
            b.event.wait()
            if post_backward is not None:
                post_backward(g)
        return x, g


def _as_tuple(value) -> Tensors:
    return value if isinstance(value, tuple) else (value,)


def _interleave(f_layers: list, b_layers: list, x: Tensors, g: Tensors) -> tuple[Tensors, Tensors]:
    i = j = 0
    # A forward layer's post node (which waits for its combine) is held back until the next
    # backward layer has launched its combine-backward: the combine then hides behind the
    # backward attention *and* the next layer's post-backward (see _overlapped_layer).
    deferred: Optional[LayerPlan] = None
    while i < len(f_layers) or j < len(b_layers):
        f = f_layers[i] if i < len(f_layers) else None
        b = b_layers[j] if j < len(b_layers) else None
        if b is not None and not b.communicates:
            g = b.backward(g) if isinstance(b, OwnPlanLayer) else b.backward_slots(BACKWARD_SLOTS, g)
            j += 1
            continue
        if f is not None and not f.communicates:
            if deferred is not None:
                x = deferred.nodes.post.forward(x)
                deferred = None
            x = f.forward(x) if isinstance(f, OwnPlanLayer) else f.forward_slots(FORWARD_SLOTS, x)
            i += 1
            continue
        if b is not None:
            g = b.backward_slots(("post", "combine"), g)  # launches b's combine-backward
        if deferred is not None:
            x = deferred.nodes.post.forward(x)
            deferred = None
        if b is None:
            x = f.forward_slots(FORWARD_SLOTS, x)
            i += 1
        elif f is None:
            g = b.backward_slots(("mlp", "dispatch", "attn"), g)
            j += 1
        else:
            x, g = _overlapped_layer(f, b, x, g)
            deferred = f
            i += 1
            j += 1
    if deferred is not None:
        x = deferred.nodes.post.forward(x)
    return x, g


def _overlapped_layer(f: LayerPlan, b: LayerPlan, x: Tensors, g: Tensors) -> tuple[Tensors, Tensors]:
    """One forward layer and one backward layer, each collective launched before the compute it
    hides behind (Megatron's pairing)::

        combine_bwd(b) || attn_fwd(f);  dispatch_fwd(f) || mlp_bwd(b);
        dispatch_bwd(b) || mlp_fwd(f);  combine_fwd(f) || attn_bwd(b) [+ next post_bwd]

    The caller has already run ``b``'s post-backward and launched its combine-backward, and runs
    ``f``'s post node later (after the next backward layer's combine-backward is launched, or at
    the end). Megatron issues mlp_bwd(b) before dispatch_fwd(f) because a GPU host never blocks
    on compute; here every collective is issued first, which gives the same pairs on CUDA streams
    and also lets the CPU backend (where compute runs on the issuing thread) overlap them."""
    fn, bn = f.nodes, b.nodes
    x = fn.attn.forward(x)           # hides b's combine-backward
    x = fn.dispatch.forward(x)       # launch comm(f) ...
    g = bn.mlp.backward(g)           # ... under b's expert backward (waits for b's combine)
    g = bn.dispatch.backward(g)      # launch comm(b) ...
    x = fn.mlp.forward(x)            # ... under f's experts (wait for f's dispatch)
    x = fn.combine.forward(x)        # launch comm(f) ...
    g = bn.attn.backward(g)          # ... under b's attention backward
    return x, g
