"""Stage-boundary point-to-point transport with a shape/dtype handshake.

A message is a fixed-size int64 header (number of tensors, whether they form a tuple, then dtype,
requires_grad, ndim and shape of each) followed by one message per tensor, so shapes and dtypes
may change between steps and between microbatches (short last batch, variable sequence length).
Once a step with the same microbatch shapes has completed, the header is skipped and receives are
posted ahead of need (see :meth:`PointToPoint.begin_step`): a header costs a round trip on the
critical path, because a payload receive can only be posted once its header has arrived.

Receives are posted in the order the peer sends (``lightning_pp.schedules.messages``), so
backends that match messages first-in-first-out per peer pair (NCCL) pair them correctly, and
sends are asynchronous so a rank never blocks on a send: with the schedule's dependencies
acyclic, blocking only on receives cannot deadlock.
"""

from __future__ import annotations

import collections
import datetime
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_pp.runtime.failure.errors import PipelineCommError
from lightning_pp.runtime.timeline import SpanKind
from lightning_pp.runtime.transport.waits import BoundedWait
from lightning_pp.schedules.messages import Message

HEADER_LEN = 64
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


class StageBoundaryError(ValueError):
    """What crosses a stage boundary changed its dtype, number of dimensions or tensor count
    between microbatches of one step."""


class TensorSpec(NamedTuple):
    """What a shape header says of one tensor crossing a stage boundary."""

    dtype: torch.dtype
    requires_grad: bool
    shape: tuple[int, ...]


class PostedReceive(NamedTuple):
    """A receive posted ahead of need on the header-free fast path (see ``begin_step``)."""

    message: Message
    tensors: list  # the buffers being received into
    works: list  # their irecv works
    specs: list  # their TensorSpecs
    as_tuple: bool  # whether the sender passed a tuple


def signature(tensors: Sequence[torch.Tensor], as_tuple: bool) -> tuple:
    """What must stay the same for every microbatch of a step at one boundary (sizes may vary)."""
    return as_tuple, tuple((t.dtype, t.dim()) for t in tensors)


def _spec_signature(specs, as_tuple: bool) -> tuple:
    return as_tuple, tuple((spec.dtype, len(spec.shape)) for spec in specs)


def _render(sig: tuple) -> str:
    as_tuple, items = sig
    parts = ", ".join(f"{str(dtype).replace('torch.', '')} {ndim}-D" for dtype, ndim in items)
    return f"({parts})" if as_tuple else parts


def encode_header(tensors: Sequence[torch.Tensor], device: torch.device, as_tuple: bool = True) -> torch.Tensor:
    fields = [len(tensors), int(as_tuple)]
    for t in tensors:
        if t.dtype not in _DTYPE_CODE:
            raise TypeError(f"stage outputs of dtype {t.dtype} cannot cross a stage boundary; use one of {_DTYPES}.")
        fields += [_DTYPE_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(
            f"a stage boundary carries {len(tensors)} tensors with {len(fields)} header fields, more than "
            f"the {HEADER_LEN} the handshake holds: pass fewer or lower-rank tensors between stages."
        )
    fields += [0] * (HEADER_LEN - len(fields))
    return torch.tensor(fields, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> tuple[list[TensorSpec], bool]:
    """(a :class:`TensorSpec` per tensor, whether the sender passed a tuple)."""
    fields = header.tolist()
    count, as_tuple, pos, specs = fields[0], bool(fields[1]), 2, []
    for _ in range(count):
        dtype, requires_grad, ndim = fields[pos : pos + 3]
        shape = tuple(fields[pos + 3 : pos + 3 + ndim])
        specs.append(TensorSpec(_DTYPES[dtype], bool(requires_grad), shape))
        pos += 3 + ndim
    return specs, as_tuple


def _fit_no_grad_markers(payload: tuple, spec: tuple, cached: tuple, describe, message: Message):
    """Header-free gradients whose "no gradient" markers (empty tensors, see the executor) differ
    from the previous step with the same batch shapes. The receiver has posted receives of last
    step's sizes: a gradient that is missing now goes as zeros of that size (exact for the sum);
    a gradient that was missing then but exists now cannot fit, and is an error."""
    (specs, as_tuple), (old_specs, old_as_tuple) = spec, cached
    if len(specs) != len(old_specs) or as_tuple != old_as_tuple:
        return payload, spec
    fitted, fitted_specs = [], []
    for t, new, old in zip(payload, specs, old_specs):
        if new != old and t.numel() == 0 and t.dim() > 0 and len(old.shape) == t.dim():
            t = torch.zeros(old.shape, dtype=t.dtype, device=t.device)
            new = TensorSpec(t.dtype, new.requires_grad, old.shape)
        elif new != old and 0 in old.shape and t.numel() > 0:
            raise StageBoundaryError(
                f"{describe()} sends {message.describe()}: an output of virtual stage {message.stage} got no "
                f"gradient in the previous step with the same batch shapes but gets one "
                f"now, so whether it reaches the loss depends on the data. Build the pipeline with "
                f"static_shapes=False so every message carries its shapes."
            )
        fitted.append(t)
        fitted_specs.append(new)
    return tuple(fitted), (fitted_specs, as_tuple)


class _Channel:
    """Receives from one peer, in the peer's send order."""

    def __init__(self) -> None:
        self.expected: collections.deque[Message] = collections.deque()
        self.arrived: dict[Message, tuple[tuple[torch.Tensor, ...], bool]] = {}
        self.header: Optional[torch.Tensor] = None
        self.header_work = None
        # Fast path: receives posted ahead, in the peer's send order.
        self.posted: collections.deque[PostedReceive] = collections.deque()


class PointToPoint:
    """Asynchronous sends and ordered, timed receives between pipeline ranks.

    ``peer_rank`` maps a pipeline rank to the global rank of the same data-parallel slot.
    ``describe`` names this rank in error messages. ``position`` (a
    :class:`~lightning_pp.runtime.failure.board.Position`) is told whom this rank is waiting for, so
    the watchdog can publish it.

    Within one step every microbatch crossing a boundary must keep the dtypes, numbers of
    dimensions and count of the first one (sizes may vary): both the sender and the receiver
    check, so a change fails on both sides at once with the same explanation instead of as a
    shape error in some later layer.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        peer_rank,
        device: torch.device,
        timeout: datetime.timedelta,
        describe,
        timeline=None,
        position=None,
    ) -> None:
        self.group = group
        self.peer_rank = peer_rank
        self.device = device
        self.timeout = timeout
        self.describe = describe
        self.timeline = timeline
        self.position = position
        self.bounded_wait = BoundedWait(timeout, describe, position)
        self.signatures: dict[tuple[str, int], tuple[int, tuple]] = {}  # (direction, stage) -> (mb, sig)
        self.channels: dict[int, _Channel] = {}
        # Header-free fast path (see begin_step): for training and for forward-only steps apart
        # (keyed by ``forward_only``), the specs of last step's messages and the batch key they were
        # seen with.
        self.specs: dict[bool, dict[tuple[int, Message], tuple[list[TensorSpec], bool]]] = {False: {}, True: {}}
        self.last_key: dict[bool, object] = {}
        self.fast = False
        self.forward_only = False
        self.key = None
        self.post_ahead = 2
        self.pending_sends: list[tuple[object, tuple[torch.Tensor, ...], Message, int]] = []
        # From the schedule (messages.delivery_marks): the peer's action index that consumes each
        # message sent to it, and the one that sends each message received from it.
        self.consumed_at: dict = {}
        self.sent_at: dict = {}

    # -- plan ---------------------------------------------------------------------------------
    def begin_step(self, key=None, forward_only: bool = False, marks: Optional[tuple[dict, dict]] = None) -> None:
        """Start a step. ``key`` describes the step's microbatch shapes (every rank of a pipeline
        splits the same batch, so they all compute the same key); ``forward_only`` separates
        forward-only steps from training.

        When the key equals the one of the last completed step of the same kind, both sides skip
        the shape header: the sender checks its tensors against last step's specs (and raises if
        they changed although the batch shapes did not), and the receiver posts its receives ahead
        of need, ``post_ahead`` per peer, in the peer's send order. Otherwise every message carries
        its header, so shapes may change freely."""
        self.signatures.clear()
        self.consumed_at, self.sent_at = marks if marks is not None else ({}, {})
        self.forward_only, self.key = forward_only, key
        self.fast = key is not None and self.last_key.get(forward_only) == key

    def _check_signature(self, message: Message, sig: tuple, side: str) -> Optional[str]:
        """The explanation if ``sig`` differs from the first microbatch of this step at this
        boundary, else None (and the first one is recorded)."""
        key = (message.direction, message.stage)
        first = self.signatures.setdefault(key, (message.microbatch, sig))
        if first[1] == sig:
            return None
        what = "activations into" if message.direction == "F" else "gradients into the output of"
        return (
            f"{self.describe()} {side} {what} virtual stage {message.stage}: microbatch {message.microbatch} "
            f"carries {_render(sig)} but microbatch {first[0]} of this step carried {_render(first[1])}. "
            f"A stage's outputs must keep their dtype and number of dimensions (and tensor count) across "
            f"the microbatches of a step; only sizes may vary. Cast or reshape inside the layer so every "
            f"microbatch returns the same kind of tensors."
        )

    def expect(self, src: int, order: list[Message]) -> None:
        """Declare the messages pipeline rank ``src`` will send this step, in its send order."""
        channel = self.channels.setdefault(src, _Channel())
        if channel.expected or channel.arrived:
            left = list(channel.expected) + list(channel.arrived)
            raise PipelineCommError(
                f"{self.describe()}: {len(left)} message(s) from pipeline rank {src} of the previous step "
                f"were never consumed (first: {left[0].describe()}); the step ended out of sync."
            )
        channel.expected.extend(order)
        if self.fast:
            self._post_ahead(src, channel)
        else:
            self._post_header(src, channel)

    def _post_ahead(self, src: int, channel: _Channel) -> None:
        specs = self.specs[self.forward_only]
        peer = self.peer_rank(src)
        while channel.expected and len(channel.posted) < self.post_ahead:
            message = channel.expected.popleft()
            tensor_specs, as_tuple = specs[(src, message)]
            tensors = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in tensor_specs]
            works = [dist.irecv(t, src=peer, group=self.group) for t in tensors]
            channel.posted.append(PostedReceive(message, tensors, works, tensor_specs, as_tuple))

    def _post_header(self, src: int, channel: _Channel) -> None:
        if channel.expected and channel.header_work is None:
            channel.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            channel.header_work = dist.irecv(channel.header, src=self.peer_rank(src), group=self.group)

    # -- transfers ----------------------------------------------------------------------------
    def send(self, dst: int, message: Message, tensors: Sequence[torch.Tensor], as_tuple: bool = True) -> None:
        """Send ``tensors`` to pipeline rank ``dst`` without waiting. The header records which
        tensors require grad, so the receiver makes those leaves that collect a gradient."""
        spec = ([TensorSpec(t.dtype, t.requires_grad, tuple(t.shape)) for t in tensors], as_tuple)
        payload = tuple(t.detach().contiguous() for t in tensors)
        peer = self.peer_rank(dst)
        if self.fast:
            # A change of dtype or rank inside the step gets its own explanation; the receiver,
            # whose receives are posted without a header, learns it through the failure board.
            mismatch = self._check_signature(message, signature(tensors, as_tuple), "sends")
            if mismatch is not None:
                raise StageBoundaryError(mismatch)
            cached = self.specs[self.forward_only].get((dst, message))
            if cached != spec and message.direction == "B" and cached is not None:
                payload, spec = _fit_no_grad_markers(payload, spec, cached, self.describe, message)
            if cached != spec:
                raise StageBoundaryError(
                    f"{self.describe()} sends {message.describe()} as {spec[0]}, but the previous step "
                    f"with the same batch shapes sent {cached[0] if cached else 'nothing'}: this boundary's "
                    f"shapes depend on the data, not only on the batch shapes. Build the pipeline with "
                    f"static_shapes=False so every message carries its shapes."
                )
            works = [dist.isend(t, dst=peer, group=self.group) for t in payload]
            for work in works:
                self.pending_sends.append((work, payload, message, dst))
            self._reap_sends()
            return
        self.specs[self.forward_only][(dst, message)] = spec
        mismatch = self._check_signature(message, signature(tensors, as_tuple), "sends")
        header = encode_header(tensors, self.device, as_tuple)
        works = [dist.isend(header, dst=peer, group=self.group)]
        works += [dist.isend(t, dst=peer, group=self.group) for t in payload]
        for work in works:
            self.pending_sends.append((work, (header, *payload), message, dst))
        self._reap_sends()
        if mismatch is not None:
            # Sent anyway, and flushed (briefly) before raising: the receiver sees the same change in
            # the header and fails at once too, instead of learning of it when this process exits.
            # Only the header: the receiver stops there.
            try:
                works[0].wait(timeout=datetime.timedelta(seconds=min(5.0, self.timeout.total_seconds())))
            except Exception:  # noqa: BLE001 - the mismatch is the error to report
                pass
            raise StageBoundaryError(mismatch)

    def recv(self, src: int, message: Message) -> tuple[tuple[torch.Tensor, ...], bool]:
        """(tensors, sent as a tuple) of ``message`` from pipeline rank ``src``; blocks (with the timeout) until they
        arrive, receiving earlier messages of that peer first."""
        channel = self.channels.get(src)
        if channel is None:
            raise PipelineCommError(f"{self.describe()}: no messages were expected from pipeline rank {src}.")
        while message not in channel.arrived:
            if self.fast:
                self._post_ahead(src, channel)
            if not channel.expected and not channel.posted:
                raise PipelineCommError(
                    f"{self.describe()}: waited for {message.describe()} from pipeline rank {src}, "
                    f"which the schedule never sends."
                )
            if self.fast:
                posted = channel.posted.popleft()
                nxt = posted.message
                for work in posted.works:
                    self._wait(work, f"receiving {nxt.describe()}", src, nxt)
                channel.arrived[nxt] = (tuple(t.requires_grad_(spec.requires_grad) if spec.requires_grad else t
                                              for t, spec in zip(posted.tensors, posted.specs)), posted.as_tuple)
                self._post_ahead(src, channel)
            else:
                nxt = channel.expected.popleft()
                channel.arrived[nxt] = self._recv_payload(src, channel, nxt)
            self._release_delivered(src, nxt)
        return channel.arrived.pop(message)

    def _release_delivered(self, src: int, arrived: Message) -> None:
        """Drop the sends to ``src`` that the message that just arrived proves delivered (see
        ``messages.delivery_marks``), so their buffers are freed now rather than at the end of the
        step: gloo does not report a send complete until it is waited for."""
        sent = self.sent_at.get((src, arrived))
        if sent is None:
            return
        keep = []
        for work, payload, message, dst in self.pending_sends:
            consumed = self.consumed_at.get((dst, message)) if dst == src else None
            if consumed is not None and consumed < sent:
                self._wait(work, f"sending {message.describe()}", dst)  # delivered: returns at once
            else:
                keep.append((work, payload, message, dst))
        self.pending_sends = keep

    def _wait(self, work, what: str, peer: int, message: Optional[Message] = None, host: bool = False) -> None:
        if self.device.type == "cuda" and not host:
            # Stream-ordered: the current stream waits for the transfer and the host goes on
            # queueing work. ProcessGroupNCCL's wait(timeout) would block the host until the
            # transfer is done; the process group's own watchdog bounds this wait instead. Only
            # a header, which the host must read, is waited for on the host (host=True).
            work.wait()
            return
        start = self.timeline.now() if self.timeline is not None and message is not None else None
        global_peer = self.peer_rank(peer)
        self.bounded_wait(work, what, global_peer, f" with pipeline rank {peer} (global rank {global_peer})")
        if start is not None:
            self.timeline.add(SpanKind.RECV_WAIT, message.microbatch, message.stage, start, self.timeline.now())

    def _recv_payload(self, src: int, channel: _Channel, message: Message):
        self._wait(channel.header_work, f"receiving the header of {message.describe()}", src, message, host=True)
        specs, as_tuple = decode_header(channel.header)
        channel.header_work = None
        mismatch = self._check_signature(message, _spec_signature(specs, as_tuple), "receives")
        if mismatch is not None:
            raise StageBoundaryError(mismatch)
        self.specs[self.forward_only][(src, message)] = (specs, as_tuple)
        peer = self.peer_rank(src)
        tensors = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in specs]
        works = [dist.irecv(t, src=peer, group=self.group) for t in tensors]
        # The next header is posted before waiting so it is already in flight.
        self._post_header(src, channel)
        for work in works:
            self._wait(work, f"receiving {message.describe()}", src, message)
        return tuple(t.requires_grad_(spec.requires_grad) if spec.requires_grad else t
                     for t, spec in zip(tensors, specs)), as_tuple

    def _reap_sends(self) -> None:
        if len(self.pending_sends) > 64:
            self.pending_sends = [entry for entry in self.pending_sends if not entry[0].is_completed()]

    def finish(self) -> None:
        """Wait for every send of the step (the buffers must live until the peer has them)."""
        pending, self.pending_sends = self.pending_sends, []
        for work, _, message, dst in pending:
            self._wait(work, f"sending {message.describe()}", dst)
        # Every message of the step went through: the next step with the same key may skip headers.
        self.last_key[self.forward_only] = self.key

    def reset(self) -> None:
        """Drop receive state after a failed step."""
        self.channels.clear()
        self.pending_sends = []
        self.signatures.clear()
        self.last_key.clear()
