"""The fine-grained scheduling contract, after Megatron-core's ``pipeline_parallel.utils``.

A model that wants its microbatches' forward and backward interleaved at a finer grain than whole
layers (so that one microbatch's expert all-to-all runs under another's compute) plugs in here:

* every virtual-pipeline chunk builds, per microbatch, an :class:`AbstractSchedulePlan` with
  ``build_schedule_plan(*inputs)`` (the runtime's chunks build a ``ChunkSchedulePlan`` from their
  layers; a layer that is a chunk of its own may bring its own plan class);
* combined 1F1B runs a steady-state step as ``type(plan).run(f_plan, b_plan, grad, pre_forward,
  pre_backward, post_forward, post_backward)``: the forward of one microbatch and the backward of
  another, interleaved as the plan class decides, with the stage-boundary receives and sends as
  the hooks, so they overlap inside the fused step as in Megatron;
* a plan is made of :class:`ScheduleNode` s: one autograd segment (compute) or one explicit
  forward/backward pair (communication) each, ordered within a microbatch by one event.

Streams. On CUDA, compute runs on the current stream (:func:`get_comp_stream`) and communication
on one dedicated stream per process (:func:`set_streams`, :func:`get_comm_stream`). On the CPU
there are no streams: both functions return ``None``, a node runs on the calling thread, and a
communication node launches asynchronous (gloo) collectives whose work handles it registers with
the microbatch's event (:class:`PlanEvent`); waiting on the event waits for them. The same node
code serves both. The stream state lives in one :class:`Streams` object per process; the
functions are Megatron's names for its methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional, Union

import torch

from lightning_pp.runtime import context
from lightning_pp.runtime.transport.waits import wait_for
from lightning_pp.runtime.plans.weight_grad import deferred_weights, engine_backward
from lightning_pp.runtime.process import state

#: What crosses a node boundary: the node's inputs, outputs or their gradients.
Tensors = tuple[Any, ...]


# -- streams ----------------------------------------------------------------------------------------
class Streams:
    """This process's communication stream (CUDA), created by :meth:`set`; no streams on CPU."""

    def __init__(self) -> None:
        self.comm = None

    def set(self, comm_stream=None, high_priority: bool = False) -> None:
        if not torch.cuda.is_available():
            return  # CPU: no streams
        if comm_stream is not None:
            self.comm = comm_stream
        elif self.comm is None:
            priority = torch.cuda.Stream.priority_range()[1] if high_priority else 0
            self.comm = torch.cuda.Stream(priority=priority)

    def comp(self):
        return torch.cuda.current_stream() if self.comm is not None else None


def _streams() -> Streams:
    process = state()  # the streams are the process's (lightning_pp.runtime.process)
    if process.streams is None:
        process.streams = Streams()
    return process.streams


def set_streams(comm_stream=None, high_priority: bool = False) -> None:
    """Create (once) the process's communication stream, at the highest priority if asked, or use
    ``comm_stream``. A no-op without CUDA."""
    _streams().set(comm_stream, high_priority)


def get_comp_stream():
    """The compute stream: CUDA's current stream; ``None`` on CPU (the calling thread)."""
    return _streams().comp()


def get_comm_stream():
    """The communication stream; ``None`` on CPU (collectives are asynchronous gloo work)."""
    return _streams().comm


def _stream_context(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


# -- events ----------------------------------------------------------------------------------------
class PlanEvent:
    """The baton that orders one microbatch's nodes: every node first waits for it, then records
    into it, so a microbatch's nodes run in issue order across streams, while another
    microbatch's nodes (another event) are free to run beside them. On CUDA a ``torch.cuda.Event``;
    on CPU the outstanding work handles of the microbatch's asynchronous collectives
    (:meth:`add`), which waiting waits for (through ``wait_fn``, the runtime's bounded wait)."""

    def __init__(self, wait_fn: Optional[Callable[[list], None]] = None) -> None:
        self.cuda_event = torch.cuda.Event() if get_comm_stream() is not None else None
        self.pending: list = []
        if wait_fn is None:  # the pipeline's bounded, recorded wait, for the microbatch being run
            ctx = context.current()
            wait_fn = lambda works: wait_for(works, ctx.timeline, ctx.microbatch, ctx.chunk)  # noqa: E731
        self.wait_fn = wait_fn

    def add(self, work: Any) -> None:
        """Register an outstanding asynchronous collective of this microbatch."""
        if work is not None:
            self.pending.append(work)

    def wait(self, stream=None) -> None:
        if self.cuda_event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.cuda_event)
        if self.pending:
            pending, self.pending = self.pending, []
            self.wait_fn(pending)

    def record(self, stream=None) -> None:
        if self.cuda_event is not None:
            self.cuda_event.record(stream or torch.cuda.current_stream())


# -- nodes -----------------------------------------------------------------------------------------
def _detach(inputs: Tensors) -> Tensors:
    return tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs)


class ScheduleNode:
    """One unit of a microbatch's plan, run on ``stream`` and ordered by ``event``.

    Compute node (no ``backward_func``): ``forward`` detaches its inputs, so the node is its own
    autograd segment, and runs ``forward_func(*inputs)``; ``backward(output_grads)`` runs autograd
    from its outputs and returns its inputs' gradients (``None`` where an input gets none).
    Communication node (``backward_func`` given): ``forward_func(*inputs)`` and
    ``backward_func(*output_grads)`` are explicit (they launch collectives and register them with
    the event); outputs that are floating point need a gradient where their input did.

    ``stream`` may be a callable (resolved at each use), e.g. :func:`get_comm_stream`.
    ``free_input``: release the inputs' storage once the forward is done, for nodes whose backward
    does not read them (``ncclep_zero_copy``: never release persistent staging buffers, which are
    registered with the transport and reused).
    """

    def __init__(self, forward_func: Callable, stream, event: PlanEvent, backward_func: Optional[Callable] = None,
                 free_input: bool = False, name: str = "schedule_node", ncclep_zero_copy: bool = False) -> None:
        self.forward_func = forward_func
        self.backward_func = backward_func
        self.stream = stream
        self.event = event
        self.free_input = free_input
        self.name = name
        self.ncclep_zero_copy = ncclep_zero_copy
        self.inputs: Tensors = ()
        self.outputs: Tensors = ()
        self.input_grads: Tensors = ()

    def _stream(self):
        return self.stream() if callable(self.stream) else self.stream

    @contextmanager
    def stream_acquire_context(self, name: Optional[str] = None) -> Iterator[None]:
        """Wait for the microbatch's event on this node's stream, run the body there, record."""
        stream = self._stream()
        self.event.wait(stream)
        with _stream_context(stream):
            yield
        self.event.record(stream)

    def forward(self, inputs: Union[Tensors, torch.Tensor] = ()) -> Tensors:
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        with self.stream_acquire_context(f"{self.name} forward"):
            if self.backward_func is not None:
                self.inputs = inputs
                outputs = self.forward_func(*inputs)
                outputs = outputs if isinstance(outputs, tuple) else (outputs,)
                # Collective outputs are new tensors outside autograd: they need a gradient exactly
                # where the matching input did, so the next node's backward produces one.
                outputs = tuple(
                    o.detach().requires_grad_(i.requires_grad)
                    if isinstance(o, torch.Tensor) and isinstance(i, torch.Tensor) and o.is_floating_point() else o
                    for o, i in zip(outputs, inputs)
                ) + tuple(outputs[len(inputs):])
            else:
                self.inputs = _detach(inputs)
                outputs = self.forward_func(*self.inputs)
                outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            if self.free_input:
                self._free(inputs)
        self.outputs = outputs
        return outputs

    def _free(self, inputs: Tensors) -> None:
        for t in inputs:
            if not isinstance(t, torch.Tensor) or t.requires_grad:
                continue
            if self.ncclep_zero_copy and t.untyped_storage().data_ptr() in state().persistent_storages:
                continue
            stream = self._stream()
            if stream is not None:
                t.record_stream(stream)
            t.untyped_storage().resize_(0)

    def backward(self, output_grad: Union[Tensors, torch.Tensor, None] = ()) -> Tensors:
        grads = output_grad if isinstance(output_grad, tuple) else (output_grad,)
        with self.stream_acquire_context(f"{self.name} backward"):
            if self.backward_func is not None:
                # A collective runs on every member whatever this rank's gradients are: an output
                # without a gradient takes part as zeros.
                grads = tuple(torch.zeros_like(o) if g is None and isinstance(o, torch.Tensor) else g
                              for o, g in zip(self.outputs, grads))
                in_grads = self.backward_func(*grads)
                in_grads = in_grads if isinstance(in_grads, tuple) else (in_grads,)
            else:
                roots, root_grads = [], []
                for out, grad in zip(self.outputs, grads):
                    if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None:
                        roots.append(out)
                        root_grads.append(grad)
                weights = deferred_weights()
                if weights is not None:  # zero-bubble B: the inputs' gradients now, the weights' at W
                    in_grads = weights.input_grads(roots, root_grads, self.inputs)
                else:
                    if roots:
                        engine_backward(roots, root_grads)
                    in_grads = tuple(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None
                                     for t in self.inputs)
        self.input_grads = in_grads
        self.inputs, self.outputs = (), ()
        return in_grads

    def get_output(self) -> Tensors:
        """The outputs of the last forward (until the backward)."""
        return self.outputs

    def get_grad(self) -> Tensors:
        """The inputs' gradients from the last backward."""
        return self.input_grads


def register_persistent(buffer: torch.Tensor) -> None:
    """Mark ``buffer``'s storage as a persistent staging buffer (registered with a transport): a
    node's ``free_input`` never releases it. Unregister it when the buffer is dropped."""
    state().persistent_storages.add(buffer.untyped_storage().data_ptr())


def unregister_persistent(buffer: torch.Tensor) -> None:
    """Forget ``buffer`` (dropped or replaced): its address may be reused by an ordinary tensor."""
    state().persistent_storages.discard(buffer.untyped_storage().data_ptr())


class NoopScheduleNode(ScheduleNode):
    """A slot with nothing to do (a dense layer has no dispatch, experts or combine)."""

    def __init__(self, event: Optional[PlanEvent] = None, name: str = "noop") -> None:
        super().__init__(lambda *xs: xs, None, event, name=name)

    def forward(self, inputs: Union[Tensors, torch.Tensor] = ()) -> Tensors:
        return inputs if isinstance(inputs, tuple) else (inputs,)

    def backward(self, output_grad: Union[Tensors, torch.Tensor, None] = ()) -> Tensors:
        return output_grad if isinstance(output_grad, tuple) else (output_grad,)


class StageDispatchBwdGrad(torch.autograd.Function):
    """Identity in forward. In backward the incoming gradient is staged by ``stage(grad)``, which
    copies it into the persistent dispatch-backward buffer and returns that buffer (a view of
    it), so the reverse all-to-all reads from memory the transport has registered (symmetric
    memory on CUDA) instead of an ordinary autograd allocation. Put it on the dispatched tokens,
    before the experts."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, stage: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.stage = stage
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.stage(grad.contiguous()), None


class AbstractSchedulePlan(ABC):
    """One microbatch's work on one chunk, run alone or fused with another microbatch's."""

    @staticmethod
    @abstractmethod
    def run(f_schedule_plan: Optional["AbstractSchedulePlan"], b_schedule_plan: Optional["AbstractSchedulePlan"],
            grad: Optional[Tensors] = None, pre_forward: Optional[Callable] = None,
            pre_backward: Optional[Callable] = None, post_forward: Optional[Callable] = None,
            post_backward: Optional[Callable] = None) -> tuple[Optional[Tensors], Optional[Tensors]]:
        """Forward ``f_schedule_plan`` and backward ``b_schedule_plan`` (either may be ``None``),
        interleaved as the plan class sees fit. Contract:

        * the forward's inputs are the ones the plan was built with, or, if it was built without
          any, what ``pre_forward()`` returns (the stage-boundary receive); ``pre_forward`` is
          called before the forward starts either way (it also waits for the input);
        * the backward starts from ``grad``, or from what ``pre_backward()`` returns (the
          gradients of the plan's outputs: received, or the loss's on the last stage);
        * ``post_forward(outputs)`` is called with the forward's outputs as soon as they exist (it
          sends them on), ``post_backward(input_grads)`` with the backward's input gradients;
        * returns ``(forward outputs, input gradients)``, ``None`` for a side that did not run."""


class _MakeViewless(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
        out.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def make_viewless(e: Any) -> Any:
    """``e`` as a tensor that is not a view of another (same storage, same autograd history), so
    that what crosses a node boundary can have its storage released without touching a base
    tensor; anything else unchanged."""
    if not isinstance(e, torch.Tensor) or e._base is None:
        return e
    return _MakeViewless.apply(e) if e.requires_grad else _MakeViewless.forward(None, e)


__all__ = [
    "AbstractSchedulePlan", "NoopScheduleNode", "PlanEvent", "ScheduleNode", "StageDispatchBwdGrad", "Streams",
    "get_comm_stream", "get_comp_stream", "make_viewless", "register_persistent", "set_streams", "unregister_persistent",
]
