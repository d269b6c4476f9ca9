"""Fine-grained scheduling nodes for combined 1F1B (forward of one microbatch overlapped with the
backward of another).

A layer is cut into five slots, each a :class:`ScheduleNode` of its microbatch's plan::

    attn (compute) -> dispatch (comm) -> mlp (compute) -> combine (comm) -> post (compute)

A dense layer puts all its compute in ``attn`` and passes through the other slots. Every node
detaches its inputs, so it is its own autograd segment whose backward runs from the output grads;
communication nodes (expert all-to-all) have an explicit backward (the reverse all-to-all).

Ordering within one microbatch: every node first waits for the microbatch's :class:`PlanEvent` and
then records into it, so one microbatch's nodes run strictly in issue order across streams. On CUDA
the event is a ``torch.cuda.Event`` and comm nodes run on a dedicated (optionally high-priority)
stream; on the CPU the event holds the async work handles of the microbatch's outstanding
collectives, and waiting on it waits for them. Nodes of the other microbatch hold a different
event, so its compute runs while this microbatch's all-to-all is in flight. One code path, two
backends.

:meth:`ChunkSchedulePlan.run` interleaves the layers of two microbatches with Megatron's pairing,
so that the dispatch and combine of one hide behind the compute of the other::

    comm:    combine_bwd(b) | dispatch_fwd(f) | dispatch_bwd(b) | combine_fwd(f)
    compute: attn_fwd(f)    | mlp_bwd(b)      | mlp_fwd(f)      | attn_bwd(b)
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch.autograd.variable import Variable

from lightning_pp.runtime import context
from lightning_pp.runtime.partition import run_layer

Tensors = tuple  # tuple of tensors
_NO_STREAM = nullcontext()  # reusable: nullcontext keeps no state
_ENGINE = Variable._execution_engine


# -- streams and events ------------------------------------------------------------------------
class StreamSet:
    """Compute is the current stream; communication a dedicated stream on CUDA, none on CPU."""

    def __init__(self, device: torch.device, high_priority: bool = True) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.comm = None
        if self.cuda:
            priority = torch.cuda.Stream.priority_range()[1] if high_priority else 0
            self.comm = torch.cuda.Stream(device=device, priority=priority)

    def context(self, comm: bool):
        if self.cuda and comm:
            return torch.cuda.stream(self.comm)
        return _NO_STREAM

    def sending(self):
        """Context for launching a stage-boundary send: on CUDA the comm stream, made to wait for
        the compute issued so far (the tensors being sent), so that the send's launch does not sit
        behind compute issued later on the compute stream; on CPU nothing."""
        if not self.cuda:
            return _NO_STREAM
        self.comm.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.comm)


class PlanEvent:
    """The baton that orders one microbatch's nodes (see the module docstring)."""

    def __init__(self, streams: StreamSet, timeline=None, microbatch: int = -1, chunk: int = -1) -> None:
        self.streams = streams
        self.cuda_event = torch.cuda.Event() if streams.cuda else None
        self.pending: list = []  # CPU: async work handles not yet waited on
        self.timeline = timeline
        self.microbatch, self.chunk = microbatch, chunk

    def add(self, work: Any) -> None:
        """Register an outstanding async collective of this microbatch."""
        if work is not None:
            self.pending.append(work)

    def wait(self, stream=None) -> None:
        if self.cuda_event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.cuda_event)
        if self.pending:
            pending, self.pending = self.pending, []
            wait_for(pending, self.timeline, self.microbatch, self.chunk)

    def record(self, stream=None) -> None:
        if self.cuda_event is not None:
            self.cuda_event.record(stream or torch.cuda.current_stream())


# -- nodes -------------------------------------------------------------------------------------
def _detach(inputs: Tensors) -> Tensors:
    return tuple(
        t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs
    )


class ScheduleNode:
    """One unit of a microbatch plan.

    Compute nodes: ``forward_fn(state, *inputs) -> outputs`` is differentiated by autograd.
    Comm nodes: ``forward_fn`` and ``backward_fn(state, *output_grads) -> input_grads`` are
    explicit (they launch collectives and register them with ``state.event``).
    """

    def __init__(self, forward_fn: Callable, name: str, comm: bool = False, backward_fn: Optional[Callable] = None) -> None:
        self.forward_fn = forward_fn
        self.backward_fn = backward_fn
        self.name = name
        self.comm = comm
        self.inputs: Tensors = ()
        self.outputs: Tensors = ()

    def forward(self, plan: "LayerPlan", inputs: Tensors) -> Tensors:
        event, streams = plan.event, plan.event.streams
        with streams.context(self.comm):
            event.wait()
            if self.comm:
                self.inputs = inputs
                outputs = self.forward_fn(plan.state, *inputs)
                # Collective outputs are new tensors outside autograd: they need a gradient exactly
                # where the matching input did, so the next node's backward produces one.
                outputs = tuple(
                    o.detach().requires_grad_(i.requires_grad)
                    if isinstance(o, torch.Tensor) and isinstance(i, torch.Tensor) and o.is_floating_point() else o
                    for o, i in zip(outputs, inputs)
                )
            else:
                self.inputs = _detach(inputs)
                outputs = self.forward_fn(plan.state, *self.inputs)
            event.record()
        self.outputs = outputs
        return outputs

    def backward(self, plan: "LayerPlan", grads: Tensors) -> Tensors:
        event, streams = plan.event, plan.event.streams
        with streams.context(self.comm):
            event.wait()
            if self.comm:
                # A collective runs on every member whatever this rank's gradients are: an output
                # without a gradient takes part as zeros.
                grads = tuple(torch.zeros_like(o) if g is None and isinstance(o, torch.Tensor) else g
                              for o, g in zip(self.outputs, grads))
                in_grads = self.backward_fn(plan.state, *grads)
            else:
                roots, root_grads = [], []
                for out, grad in zip(self.outputs, grads):
                    if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None:
                        roots.append(out)
                        root_grads.append(grad)
                if roots:
                    # The engine directly (as torch.autograd.backward does after checking its
                    # arguments): this runs for every compute node, so the checks' cost shows.
                    _ENGINE.run_backward(tuple(roots), tuple(root_grads), False, False, (), True, True)
                in_grads = tuple(
                    t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in self.inputs
                )
            event.record()
        self.inputs, self.outputs = (), ()
        return in_grads


class NoopScheduleNode(ScheduleNode):
    """Pass-through slot (a dense layer has no dispatch, experts or combine)."""

    def __init__(self, name: str) -> None:
        super().__init__(lambda state, *xs: xs, name)

    def forward(self, plan: "LayerPlan", inputs: Tensors) -> Tensors:
        return inputs

    def backward(self, plan: "LayerPlan", grads: Tensors) -> Tensors:
        return grads


class LayerNodes(NamedTuple):
    """What a layer provides for fine-grained scheduling (``layer.schedule_nodes()``)."""

    attn: ScheduleNode
    dispatch: ScheduleNode
    mlp: ScheduleNode
    combine: ScheduleNode
    post: ScheduleNode


def dense_nodes(layer: torch.nn.Module) -> LayerNodes:
    """A layer without its own nodes: all compute in ``attn``; a tuple input is unpacked."""

    def run(state, *xs):
        out = run_layer(layer, xs)
        return out if isinstance(out, tuple) else (out,)

    return LayerNodes(ScheduleNode(run, "layer"), NoopScheduleNode("dispatch"), NoopScheduleNode("mlp"),
                      NoopScheduleNode("combine"), NoopScheduleNode("post"))


class LayerPlan:
    """One layer's nodes for one microbatch, with the microbatch's event and scratch state."""

    def __init__(self, layer: torch.nn.Module, event: PlanEvent) -> None:
        build = getattr(layer, "schedule_nodes", None)
        # A layer with its own nodes communicates (expert all-to-all): it is paired with another
        # such layer of the other microbatch. A dense layer is one compute node.
        self.communicates = callable(build)
        self.nodes: LayerNodes = build() if self.communicates else dense_nodes(layer)
        self.event = event
        self.state: dict = {"event": event}

    def forward_slots(self, slots: Sequence[str], x: Tensors) -> Tensors:
        for slot in slots:
            x = getattr(self.nodes, slot).forward(self, x)
        return x

    def backward_slots(self, slots: Sequence[str], g: Tensors) -> Tensors:
        for slot in slots:
            g = getattr(self.nodes, slot).backward(self, g)
        return g


FORWARD_SLOTS = ("attn", "dispatch", "mlp", "combine", "post")
BACKWARD_SLOTS = tuple(reversed(FORWARD_SLOTS))


class AbstractSchedulePlan:
    """A microbatch's work on one chunk that can be run alone or fused with another's."""

    @staticmethod
    def run(f_plan, b_plan, f_input=None, b_grad=None):  # pragma: no cover - interface
        raise NotImplementedError


class ChunkSchedulePlan(AbstractSchedulePlan):
    """One microbatch through one pipeline chunk, layer by layer, node by node."""

    def __init__(self, layers: Sequence[torch.nn.Module], streams: StreamSet, timeline=None,
                 microbatch: int = -1, chunk: int = -1) -> None:
        self.event = PlanEvent(streams, timeline, microbatch, chunk)
        self.layers = [LayerPlan(layer, self.event) for layer in layers]
        self.output: Tensors = ()

    def forward(self, x: Tensors) -> Tensors:
        return ChunkSchedulePlan.run(self, None, x, None)[0]

    def backward(self, grads: Tensors) -> Tensors:
        return ChunkSchedulePlan.run(None, self, None, grads)[1]

    @staticmethod
    def run(f_plan: Optional["ChunkSchedulePlan"], b_plan: Optional["ChunkSchedulePlan"],
            f_input: Optional[Tensors] = None, b_grad: Optional[Tensors] = None):
        """Forward ``f_plan`` from ``f_input`` and backward ``b_plan`` from ``b_grad``, layers
        interleaved (forward layers in order, backward layers in reverse). Returns
        ``(forward outputs, input grads)``; either side may be None.

        Layers that communicate are paired with each other (Megatron keeps the embedding and the
        output layer outside its layer pairing for the same reason): pairing an MoE layer with a
        dense one would leave the MoE layer's all-to-all only the dense layer's compute to hide
        behind. Dense layers run on their own, backward ones first (they need nothing from the
        forward side, so a forward combine still in flight keeps hiding behind them)."""
        f_layers = f_plan.layers if f_plan is not None else []
        b_layers = list(reversed(b_plan.layers)) if b_plan is not None else []
        x, g = f_input, b_grad
        i = j = 0
        # A forward layer's post node (which waits for its combine) is held back until the next
        # backward layer has launched its combine-backward: the combine then hides behind the
        # backward attention *and* the next layer's post-backward (see _overlapped_layer).
        deferred: Optional[LayerPlan] = None
        while i < len(f_layers) or j < len(b_layers):
            f = f_layers[i] if i < len(f_layers) else None
            b = b_layers[j] if j < len(b_layers) else None
            if b is not None and not b.communicates:
                g = b.backward_slots(BACKWARD_SLOTS, g)
                j += 1
                continue
            if f is not None and not f.communicates:
                if deferred is not None:
                    x = deferred.nodes.post.forward(deferred, x)
                    deferred = None
                x = f.forward_slots(FORWARD_SLOTS, x)
                i += 1
                continue
            if b is not None:
                g = b.backward_slots(("post", "combine"), g)  # launches b's combine-backward
            if deferred is not None:
                x = deferred.nodes.post.forward(deferred, x)
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
            x = deferred.nodes.post.forward(deferred, x)
        if f_plan is not None:
            f_plan.event.wait()
            f_plan.output = x
        if b_plan is not None:
            b_plan.event.wait()
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
    x = fn.attn.forward(f, x)           # hides b's combine-backward
    x = fn.dispatch.forward(f, x)       # launch comm(f) ...
    g = bn.mlp.backward(b, g)           # ... under b's expert backward (waits for b's combine)
    g = bn.dispatch.backward(b, g)      # launch comm(b) ...
    x = fn.mlp.forward(f, x)            # ... under f's experts (wait for f's dispatch)
    x = fn.combine.forward(f, x)        # launch comm(f) ...
    g = bn.attn.backward(b, g)          # ... under b's attention backward
    return x, g


class LaunchedWork:
    """An async collective and when it was launched (on the step's timeline clock), so the
    timeline can show each all-to-all from launch to completion (``a2a``) next to the time
    compute waited for it (``a2a_wait``).

    ``on_cpu``: the collective runs on a CPU backend (gloo), whose transfers progress on the
    process group's worker thread. With every core busy computing, that thread would wait for a
    scheduler tick before it picks the work up; yielding once right after the launch lets it
    start the transfer at once (on a 2-core machine this halves the wait at the far end). CUDA
    collectives progress on the device and need no help."""

    def __init__(self, work: Any, launched: Optional[float], delay: float = 0.0, on_cpu: bool = False) -> None:
        self.work = work
        self.launched = launched
        # An emulated slower link (benchmarks): complete no earlier than ``delay`` seconds after
        # launch; the wait sleeps, burning no CPU.
        self.ready_at = time.perf_counter() + delay if delay > 0 else 0.0
        # A gloo wait blocks the host anyway, so it may as well be bounded by the pipeline
        # timeout; a CUDA wait only orders streams, and bounding it would block the host (the
        # process group's own watchdog bounds it instead).
        self.host_blocking = on_cpu
        if on_cpu and work is not None:
            os.sched_yield()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self.work is not None:
            self.work.wait(*args, **kwargs)
        remaining = self.ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return True


def wait_for(works: Sequence[Any], timeline=None, microbatch: int = -1, chunk: int = -1) -> None:
    """Wait for ``works``, recording the wait (``a2a_wait``) and each launched transfer's span
    (``a2a``: from launch until it was seen complete) on ``timeline``. Inside a pipelined step
    each wait is bounded by the pipeline timeout, and a failed one names the rank that failed
    first (the executor's waiter, from the microbatch context)."""
    waiter = context.current().wait
    what = f"the expert all-to-all of microbatch {microbatch} (chunk {chunk})"
    recording = timeline is not None and timeline.enabled
    start = timeline.now() if recording else 0.0
    for work in works:
        before = timeline.now() if recording else 0.0
        if waiter is not None and getattr(work, "host_blocking", True):
            waiter(work, what)
        else:
            work.wait()
        if recording:
            after = timeline.now()
            launched = getattr(work, "launched", None)
            if launched is not None:
                # Already complete when the wait began: it finished at the latest then.
                timeline.add("a2a", microbatch, chunk, launched, after if after - before > 1e-5 else before)
    if recording:
        timeline.add("a2a_wait", microbatch, chunk, start, timeline.now())
