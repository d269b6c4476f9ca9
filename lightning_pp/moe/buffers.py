"""Persistent staging buffers for expert dispatch and combine (zero-copy staging).

Per in-flight microbatch a slot holds three persistent buffers of ``rows x hidden``:

* ``fwd``: the dispatch all-to-all writes the tokens a rank receives straight into it, and the
  experts read them from there;
* ``cmb``: the experts write their outputs straight into it, already back in received order
  (:func:`scatter_rows_into`), and the combine all-to-all sends from it: no copy between the
  expert computation and the transfer;
* ``bwd``: the backward of dispatch stages its incoming gradient there before the reverse
  all-to-all (:func:`stage_dispatch_bwd_grad`, one copy, counted).

A slot is taken at a microbatch's dispatch forward and returned after its dispatch backward
(the experts keep the received tokens for their backward), sized from the capacity or grown to a
high-water mark, and never freed or resized while training. Backends:

* CPU / gloo: plain persistent tensors;
* CUDA: ``torch.distributed._symmetric_memory`` when available (``symm_mem.empty`` +
  ``rendezvous`` on the expert group), else plain device tensors.

Counters: ``allocations`` (buffers created or grown), ``allocations_after_warmup``,
``staged_bytes`` (gradient bytes copied by the dispatch-backward staging) and
``zero_copy_bytes`` (bytes the combine sent straight from a persistent buffer).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_pp.runtime.plans.plan import register_persistent, unregister_persistent


def symmetric_memory_available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        # importlib, not an import statement: ``import torch.distributed...`` here would make
        # ``torch`` a local name of this function, unbound on the line above.
        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception:
        return False
    return True


@dataclass
class BufferStats:
    allocations: int = 0
    allocations_after_warmup: int = 0
    staged_bytes: int = 0
    zero_copy_bytes: int = 0
    peak_slots: int = 0
    warm: bool = False


class StagingPool:
    """Slots of persistent buffers for one MoE layer, three per in-flight microbatch: the dispatch's
    forward receive buffer (``"fwd"``), the combine's send buffer the experts write into (``"cmb"``)
    and the dispatch-backward staging buffer (``"bwd"``)."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, group=None,
                 capacity_rows: Optional[int] = None, headroom: float = 1.25) -> None:
        self.hidden, self.dtype, self.device, self.group = hidden, dtype, device, group
        self.capacity_rows = capacity_rows
        self.headroom = headroom
        self.symmetric = symmetric_memory_available(device)
        self.slots: list[dict[str, torch.Tensor]] = []
        self.free: list[int] = []
        self.stats = BufferStats()

    def _allocate(self, rows: int) -> torch.Tensor:
        self.stats.allocations += 1
        if self.stats.warm:
            self.stats.allocations_after_warmup += 1
        shape = (rows, self.hidden)
        if self.symmetric:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(shape, dtype=self.dtype, device=self.device)
            if self.group is not None:
                symm_mem.rendezvous(buf, self.group)
        else:
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        register_persistent(buf)
        return buf

    def _rows_for(self, needed: int) -> int:
        if self.capacity_rows is not None:
            if needed > self.capacity_rows:
                raise RuntimeError(
                    f"the expert dispatch needs {needed} rows but the capacity buffer holds "
                    f"{self.capacity_rows}: raise capacity_factor or use dropless routing."
                )
            return self.capacity_rows
        return max(needed, int(needed * self.headroom) + 1)

    def acquire(self, rows: int) -> int:
        """A free slot whose buffers hold at least ``rows`` rows (grown if needed)."""
        if self.free:
            slot = self.free.pop()
        else:
            slot = len(self.slots)
            self.slots.append({})
            self.stats.peak_slots = max(self.stats.peak_slots, len(self.slots))
        bufs = self.slots[slot]
        for kind in ("fwd", "cmb", "bwd"):
            if kind not in bufs or bufs[kind].shape[0] < rows:
                if kind in bufs:
                    unregister_persistent(bufs[kind])  # replaced by a larger one
                bufs[kind] = self._allocate(self._rows_for(rows))
        return slot

    def forward_buffer(self, slot: int, rows: int) -> torch.Tensor:
        return self.slots[slot]["fwd"][:rows]

    def combine_buffer(self, slot: int, rows: int) -> torch.Tensor:
        return self.slots[slot]["cmb"][:rows]

    def backward_buffer(self, slot: int, rows: int) -> torch.Tensor:
        return self.slots[slot]["bwd"][:rows]

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies inside one of the pool's buffers."""
        ptr = tensor.data_ptr()
        for bufs in self.slots:
            for buf in bufs.values():
                start = buf.data_ptr()
                if start <= ptr < start + buf.numel() * buf.element_size():
                    return True
        return False

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def mark_warm(self) -> None:
        """Called after the first step: later allocations count as steady-state growth."""
        self.stats.warm = True

    def reset(self) -> None:
        """Drop every buffer (collectively, at teardown: symmetric buffers are shared)."""
        for bufs in self.slots:
            for buf in bufs.values():
                unregister_persistent(buf)
        self.slots, self.free = [], []


def stage_dispatch_bwd_grad(pool: StagingPool, slot: int, grad: torch.Tensor) -> torch.Tensor:
    """What :class:`~lightning_pp.runtime.plans.plan.StageDispatchBwdGrad` does in backward for a
    staging pool: copy the gradient arriving at a dispatch's output into the slot's persistent
    backward buffer and return it, so the reverse all-to-all reads from it (a symmetric buffer on
    CUDA, which one-sided transports need: autograd's own gradient is an ordinary allocation).
    Counted in ``stats.staged_bytes``."""
    buf = pool.backward_buffer(slot, grad.shape[0])
    buf.copy_(grad)
    pool.stats.staged_bytes += grad.numel() * grad.element_size()
    return buf


class _ScatterRowsInto(torch.autograd.Function):
    """Writes ``parts`` (consecutive row blocks) to rows ``index`` of ``holder[0]``, a persistent
    buffer, and returns that buffer: the producer's output *is* the staging buffer. The buffer
    is handed over inside a list so that autograd does not track it as an input (its other
    microbatches' contents must stay out of this graph); backward gathers the rows back."""

    @staticmethod
    def forward(ctx, index: torch.Tensor, holder: list, *parts: torch.Tensor) -> torch.Tensor:
        buf = holder[0]
        start = 0
        for part in parts:
            buf.index_copy_(0, index[start:start + part.shape[0]], part)
            start += part.shape[0]
        ctx.save_for_backward(index)
        ctx.sizes = [p.shape[0] for p in parts]
        return buf

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return (None, None, *grad.index_select(0, index).split(ctx.sizes))


def scatter_rows_into(buf: torch.Tensor, index: torch.Tensor, parts: list) -> torch.Tensor:
    """``buf[index] = cat(parts)`` as a differentiable function of ``parts`` whose result is
    ``buf`` itself (used to write expert outputs straight into the combine's staging buffer)."""
    return _ScatterRowsInto.apply(index, [buf], *parts)
