"""The gradients of sharded parameters (``runtime.dp.sharding``): a chunk's reduce-scatter."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_pp.runtime.timeline import SpanKind


class ShardedBucket:
    """The gradients of one chunk's sharded units of one kind (dense over the data-parallel group,
    experts over the expert-data-parallel group), reduce-scattered as one flat buffer.

    Every rank's segment holds, for each parameter, its dim-0 shard padded to ``ceil(n / world)``
    rows (``torch.chunk``'s split, FSDP2's), then one presence count per parameter (in every
    segment, so every rank learns which parameters any replica produced a gradient for: those get
    ``grad = None`` where none did, as on one device)."""

    def __init__(self, sharding, chunk: int, expert: bool, group, stage: int) -> None:
        self.sharding, self.chunk, self.expert, self.group, self.stage = sharding, chunk, expert, group, stage
        self.chunks = (chunk,)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.launch_after = -1
        self.work = None
        self.flag: Optional[torch.Tensor] = None  # inf/nan in this rank's gradients before the reduction
        self._pairs: list = []
        self._buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._posted: object = None  # the timeline's mark when the reduce-scatter was posted
        self.segment_elements = 0

    def _layout(self, params: list[torch.Tensor]) -> tuple[list[tuple[int, int, int]], int]:
        """(offset, rows per shard, elements per row) of every parameter in a segment; segment size."""
        spans, offset = [], 0
        for p in params:
            rows = p.shape[0] if p.dim() else 1
            per = math.ceil(rows / self.world)
            inner = p.numel() // rows if rows else 0
            spans.append((offset, per, inner))
            offset += per * inner
        return spans, offset + len(params)

    def launch(self, nonfinite) -> None:
        """Post the reduce-scatter of the gathered gradients and free them."""
        pairs = [(s, u) for s, u, expert in self.sharding.pairs(self.chunk) if expert == self.expert]
        self._pairs = pairs
        grads = [u.grad if s.requires_grad else None for s, u in pairs]
        for _, u in pairs:
            u.grad = None
        device = pairs[0][0].device if pairs else torch.device("cpu")
        self.flag = nonfinite([g for g in grads if g is not None], device)
        dtype = next((g.dtype for g in grads if g is not None), pairs[0][0].dtype if pairs else torch.float32)
        spans, size = self._layout([u for _, u in pairs])
        self._dtype, self._device = dtype, device
        send = torch.zeros(self.world, size, dtype=dtype, device=device)
        for i, (offset, per, inner) in enumerate(spans):
            g, grads[i] = grads[i], None  # each gathered gradient is freed once copied
            if g is None:
                continue
            rows = g.shape[0] if g.dim() else 1
            flat = g.reshape(rows, inner)
            if per * self.world != rows:
                flat = torch.cat([flat, flat.new_zeros(per * self.world - rows, inner)])
            send[:, offset:offset + per * inner].copy_(flat.reshape(self.world, per * inner))
            send[:, size - len(pairs) + i] = 1
        self.segment_elements = size  # what one rank receives (the benchmarks replay it alone)
        self._buffers, self.work = self._reduce(send, async_op=True)
        timeline = self.sharding.timeline
        self._posted = timeline.mark() if timeline is not None else None

    def _reduce(self, send: torch.Tensor, async_op: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], Any]:
        """Post the sum of ``send`` over the group; ``((send, this rank's summed segment), work)``.

        A reduce-scatter where the backend has a fast one (NCCL: half an all-reduce's traffic). Gloo's
        is slower than its all-reduce of the whole buffer (19 M float32 over two ranks here: 122 ms
        against 68 ms; its all-gather 83 ms), so on gloo the buffer is all-reduced and each rank
        keeps its own segment: the same sums, in less time."""
        if dist.get_backend(self.group) == "gloo":
            work = dist.all_reduce(send, group=self.group, async_op=async_op)
            return (send, send[self.rank]), work
        recv = torch.empty(send.shape[1], dtype=send.dtype, device=send.device)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.11
        return (send, recv), reduce_scatter(recv, send.reshape(-1), group=self.group, async_op=async_op)

    def run_alone(self) -> None:
        """The last step's reduction once more, by itself and blocking, on zeros (for measuring how
        long it takes when nothing runs beside it)."""
        send = torch.zeros(self.world, self.segment_elements, dtype=self._dtype, device=self._device)
        self._reduce(send, async_op=False)

    def finish(self, wait) -> None:
        """Wait and give each sharded parameter its reduced shard (or ``None``)."""
        from torch.distributed.tensor import DTensor

        timeline = self.sharding.timeline if self._posted is not None else None
        with timeline.span(SpanKind.REDUCE_SCATTER_WAIT, -1, self.chunk) if timeline is not None else nullcontext():
            wait(self.work, "the data-parallel gradient reduce-scatter")
        if timeline is not None:
            timeline.add_between(SpanKind.REDUCE_SCATTER, -1, self.chunk, self._posted, timeline.mark())
        _, recv = self._buffers
        spans, size = self._layout([u for _, u in self._pairs])
        counts = recv[size - len(self._pairs):].tolist()
        for (s, _), (offset, _, inner), count in zip(self._pairs, spans, counts):
            if count <= 0:
                s.grad = None
                continue
            piece = s.to_local()
            rows = piece.shape[0] if piece.dim() else 1
            value = recv[offset:offset + rows * inner].reshape(piece.shape).clone()
            s.grad = DTensor.from_local(value, s.device_mesh, s.placements, shape=s.shape, stride=s.stride(),
                                        run_check=False)
        self._buffers, self.work, self._pairs = None, None, []

    def abandon(self) -> None:
        self._buffers, self.work, self._pairs = None, None, []
