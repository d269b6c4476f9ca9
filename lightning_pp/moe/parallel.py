"""Expert parallelism for any mixture-of-experts layer: routing result -> token-count exchange ->
dispatch all-to-all -> local experts -> combine all-to-all -> weighted scatter-add.

A layer subclasses :class:`ExpertParallelMoE` and supplies three things; everything between them
(the permutation, the all-to-alls, the staging buffers, both execution modes, the schedule nodes)
is decided here, once::

    moe_pre(*inputs) -> MoERouting(carry, tokens, probs, indices)    # attn slot (compute)
        carry:   tensors moe_post needs (residual stream, a shared expert's output, ...)
        tokens:  [T, C] rows to route;  probs, indices: [T, k] routing weights and expert ids
    exchange counts; permute rows by expert; all-to-all           # dispatch slot (comm)
    expert_list()[e](rows [n, C]) -> [n, C] for the local experts # mlp slot (compute)
    all-to-all back                                               # combine slot (comm)
    mixed[t] = sum_k probs[t, k] * out[t, k]  (experts in ascending order, from zeros)
    moe_post(carry, mixed [T, C]) -> output                       # post slot (compute)

Experts are built for the whole model (so one process is the unsharded reference) and
:meth:`ExpertParallelMoE.setup_expert_parallel` (called by the runtime after cutting) keeps only
this rank's share of them in the layer's experts ``ModuleList``, the others replaced by
:class:`ExpertOnOtherRank`; local experts keep their global names (``experts.5.fc1.weight``), so
checkpoints re-shard across expert-parallel sizes. A layer whose experts are stacked in one module
(``stacked_experts = True``: ``expert_list()`` holds that one module, whose parameters have every
expert along dim 0, as Hugging Face's fused ``gate_up_proj``) keeps its rows of each stacked
parameter instead, under the same names (:mod:`lightning_pp.runtime.cut.stacked`), and supplies
``expert_forward(e, rows)``. The parameters of ``expert_list()`` are the
expert parameters (marked ``_lpp_expert = True`` there) and are reduced over the
expert-data-parallel group; every other parameter of the layer is dense. Routing is dropless unless
``capacity_factor`` is set.

The same slot functions run in both execution modes, so they give identical numbers:
``forward`` (plain autograd, synchronous all-to-all) and ``schedule_nodes`` (fine-grained nodes
with asynchronous all-to-all, used by combined 1F1B).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.moe.buffers import StagingPool, scatter_rows_into, stage_dispatch_bwd_grad
from lightning_pp.moe.state import DispatchState, MoERouting
from lightning_pp.runtime import context
from lightning_pp.runtime.plans.nodes import LayerNodes
from lightning_pp.runtime.cut.partition import drop_keys_held_elsewhere
from lightning_pp.runtime.cut.stacked import shard_rows_of
from lightning_pp.runtime.plans.plan import PlanEvent, ScheduleNode, StageDispatchBwdGrad, get_comm_stream, get_comp_stream
from lightning_pp.runtime.transport.waits import LaunchedWork, wait_for


def mark_expert_parameters(module: nn.Module) -> None:
    """Mark ``module``'s parameters as expert parameters (reduced over the expert-data-parallel
    group instead of the data-parallel group). Not needed for the experts of an
    :class:`ExpertParallelMoE`: ``setup_expert_parallel`` marks every parameter of its
    ``expert_list()``. A marked parameter outside every layer's ``expert_list()`` is an error at
    setup (the runtime could not tell on which ranks it lives)."""
    for p in module.parameters():
        p._lpp_expert = True


class ExpertOnOtherRank(nn.Module):
    """Placeholder for an expert held by another expert-parallel rank. A one-device state dict
    holds that expert's entries: this rank skips them, so ``load_state_dict`` of a one-device
    state dict (strict included) works after expert parallelism is set up."""

    def __init__(self, index: int, rank: int):
        super().__init__()
        self.index, self.rank = index, rank
        self._register_load_state_dict_pre_hook(drop_keys_held_elsewhere)

    def forward(self, x):  # pragma: no cover - never called by the layer
        raise RuntimeError(f"expert {self.index} lives on expert-parallel rank {self.rank}, not on this rank.")

    def extra_repr(self) -> str:
        return f"expert={self.index}, ep_rank={self.rank}"


class _ReleaseOnWait:
    """A work handle that returns a staging slot once the transfer reading it has finished."""

    def __init__(self, work, pool: StagingPool, slot: int) -> None:
        self.work, self.pool, self.slot = work, pool, slot
        self.launched = getattr(work, "launched", None)
        self.host_blocking = getattr(work, "host_blocking", True)

    def wait(self, *args, **kwargs):
        if self.work is not None:
            self.work.wait(*args, **kwargs)
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None
        return True


class ExpertParallelMoE(nn.Module):
    """Base of a layer whose MLP is a mixture of experts run expert-parallel (see the module
    docstring for what a subclass supplies).

    Args:
        num_experts, top_k: experts, and experts per token.
        capacity_factor: None for dropless routing; else each expert takes at most
            ``ceil(tokens * top_k / num_experts * capacity_factor)`` tokens per rank (the rest
            get no expert output) and the staging buffers have a fixed size.
        a2a_delay: seconds added to every expert all-to-all (an emulated slower link for
            benchmarks: the wait sleeps, burning no CPU).
    """

    #: How the expert count is called where the user sets it (named by the divisibility error).
    num_experts_field = "num_experts"
    #: True: ``expert_list()`` holds one module whose parameters stack every expert along dim 0.
    stacked_experts = False

    def __init__(self, num_experts: int, top_k: int, capacity_factor: Optional[float] = None,
                 a2a_delay: float = 0.0) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = capacity_factor
        self.a2a_delay = a2a_delay
        self.ep_group, self.ep_size, self.ep_rank = None, 1, 0
        self.use_staging = False  # persistent staging buffers, switched on by setup_expert_parallel
        self.pool: Optional[StagingPool] = None

    # -- what a subclass supplies -------------------------------------------------------------
    def expert_list(self) -> nn.ModuleList:
        """The experts, indexed by global expert id; each maps rows ``[n, C]`` to ``[n, C]``."""
        raise NotImplementedError

    def expert_forward(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` (global id, held on this rank) on its rows ``[n, C]``. Stacked experts
        override it (the local rows of the stacked parameters are experts ``first..``)."""
        return self.expert_list()[e](rows)

    def moe_pre(self, *inputs: Any) -> MoERouting:
        """Everything before the experts (attention, norms, router)."""
        raise NotImplementedError

    def moe_post(self, carry: tuple, mixed: torch.Tensor) -> Any:
        """Everything after them; ``mixed`` is ``[T, C]``, the routed experts' weighted sum."""
        raise NotImplementedError

    # -- expert parallelism -------------------------------------------------------------------
    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def setup_expert_parallel(self, group, ep_rank: int, ep_size: int, device: torch.device) -> None:
        """Keep experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``; the rest become placeholders."""
        field = self.num_experts_field
        if self.num_experts % ep_size:
            raise ValueError(
                f"{field}={self.num_experts} is not divisible by expert_parallel_size={ep_size}: every "
                f"expert-parallel rank must hold the same number of experts. Use an expert_parallel_size "
                f"that divides {self.num_experts}, or change {field}."
            )
        experts = self.expert_list()  # checked before the cut (runtime.check_expert_placement)
        # What expert_list() returns is the expert set, by construction: its parameters are reduced over
        # the expert-data-parallel group, never broadcast or averaged with another rank's experts.
        mark_expert_parameters(experts)
        self.ep_group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        local = self.num_local_experts
        if self.stacked_experts:
            if ep_size > 1:
                shard_rows_of(experts[0], self.num_experts, ep_rank, ep_size, group, device.type)
            self.use_staging = True
            return
        for e in range(self.num_experts):
            if not ep_rank * local <= e < (ep_rank + 1) * local:
                experts[e] = ExpertOnOtherRank(e, e // local)
        self.use_staging = True  # the pool is made at the first dispatch, in the tokens' dtype

    def pipeline_step_end(self, step: int) -> None:
        """Called by the executor after each training step: after the first, buffer growth counts
        as steady-state allocation."""
        if self.pool is not None and step >= 1:
            self.pool.mark_warm()

    def pipeline_teardown(self) -> None:
        """Release the staging buffers, together with the other expert-parallel ranks."""
        if self.pool is not None:
            if self.pool.symmetric and self.ep_group is not None:
                dist.barrier(group=self.ep_group)  # no peer may still read our symmetric buffers
            self.pool.reset()
            self.pool = None

    def _capacity(self, tokens: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(tokens * self.top_k / self.num_experts * self.capacity_factor))

    # -- slot functions (shared by both execution modes) -------------------------------------
    def _route(self, state: DispatchState, *inputs: Any) -> tuple:
        """``moe_pre``, then the rows in expert order; returns ``(*carry, rows, their probs)``."""
        carry, tokens, probs, indices = self.moe_pre(*inputs)
        flat_expert = indices.reshape(-1)
        # Stable: each expert's rows stay in token order, and a token's rows in expert order.
        order = torch.argsort(flat_expert, stable=True)
        capacity = self._capacity(tokens.shape[0])
        if capacity is not None:
            sorted_expert = flat_expert[order]
            starts = torch.searchsorted(sorted_expert, torch.arange(self.num_experts, device=tokens.device))
            position = torch.arange(order.numel(), device=tokens.device) - starts[sorted_expert]
            order = order[position < capacity]
        token_of = order // self.top_k
        counts = torch.bincount(flat_expert[order], minlength=self.num_experts)
        state.num_tokens, state.token_of, state.counts, state.capacity = tokens.shape[0], token_of, counts, capacity
        self._launch_counts(state)  # travels while the tokens are gathered
        return (*carry, tokens[token_of], probs.reshape(-1)[order])

    def _launch_counts(self, state: DispatchState) -> None:
        """Start the exchange of per-expert token counts (how many rows each rank will send)."""
        counts = state.counts
        if self.ep_size > 1:
            recv = torch.empty_like(counts)
            # A few bytes: the emulated link's delay (which stands for moving the tokens) is not added.
            state.counts_exchange = (recv, self._a2a(recv, counts, None, None, emulate_link=False))
        else:
            state.counts_exchange = (counts, None)

    def _exchange_counts(self, state: DispatchState) -> None:
        """Finish the counts exchange and derive the all-to-all splits and the expert-major order."""
        (recv, work), state.counts_exchange = state.counts_exchange, None
        _timed_wait(work)
        local = self.num_local_experts
        recv = recv.view(self.ep_size, local)
        state.send_splits = state.counts.view(self.ep_size, local).sum(1).tolist()
        state.recv_splits = recv.sum(1).tolist()
        # Received rows are grouped by source rank, then by local expert; the experts want them
        # grouped by expert. expert_major[i] = source-major row index of expert-major row i:
        # block (src, e) starts at source-major row src_start[src, e]; walking the blocks in
        # expert-major order, row i of a block lies at src_start + (i - that block's expert-major start).
        src_start = (torch.cumsum(recv.flatten(), 0) - recv.flatten()).view(self.ep_size, local)
        lengths = recv.t().reshape(-1)
        em_start = torch.cumsum(lengths, 0) - lengths
        shift = torch.repeat_interleave(src_start.t().reshape(-1) - em_start, lengths)
        state.expert_major = torch.arange(shift.numel(), device=recv.device) + shift
        state.expert_counts = recv.sum(0).tolist()

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, emulate_link: bool = True):
        """All-to-all of rows; returns an async work handle (None if nothing to wait for), which
        the timeline shows from launch to completion."""
        timeline = context.current().timeline
        launched = timeline.now() if timeline is not None else None
        work = None
        if self.ep_size > 1:
            work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.ep_group, async_op=True)
        else:
            out.copy_(inp)
        delay = self.a2a_delay if emulate_link else 0.0
        if work is None and delay <= 0:
            return None
        return LaunchedWork(work, launched, delay, on_cpu=out.device.type == "cpu")

    def _dispatch(self, state: DispatchState, permuted: torch.Tensor):
        self._exchange_counts(state)
        rows = sum(state.recv_splits)
        if self.use_staging and self.pool is None:
            # Fixed staging size with a capacity: every source sends at most `capacity` rows per
            # local expert. Dropless: grown to the high-water mark.
            capacity = state.capacity
            fixed = capacity * self.num_local_experts * self.ep_size if capacity is not None else None
            self.pool = StagingPool(permuted.shape[1], permuted.dtype, permuted.device, self.ep_group,
                                    capacity_rows=fixed)
        if self.pool is not None:
            slot = self.pool.acquire(rows)
            out = self.pool.forward_buffer(slot, rows)
        else:
            slot, out = None, permuted.new_empty((rows, permuted.shape[1]))
        state.slot = slot
        work = self._a2a(out, permuted.detach().contiguous(), state.recv_splits, state.send_splits)
        return out, work

    def _dispatch_backward(self, state: DispatchState, grad: torch.Tensor):
        # With staging, ``grad`` is already the slot's persistent backward buffer: the experts'
        # input passed through StageDispatchBwdGrad (see _experts).
        slot = state.slot
        out = grad.new_empty((sum(state.send_splits), grad.shape[1]))
        work = self._a2a(out, grad.contiguous(), state.send_splits, state.recv_splits)
        return out, _ReleaseOnWait(work, self.pool, slot)

    def _experts(self, state: DispatchState, received: torch.Tensor) -> torch.Tensor:
        slot = state.slot
        if self.pool is not None and slot is not None and received.requires_grad:
            pool = self.pool
            received = StageDispatchBwdGrad.apply(received, lambda grad: stage_dispatch_bwd_grad(pool, slot, grad))
        index = state.expert_major
        grouped = received[index]
        outputs, start = [], 0
        first = self.ep_rank * self.num_local_experts
        for e, count in enumerate(state.expert_counts):
            outputs.append(self.expert_forward(first + e, grouped[start:start + count]))
            start += count
        if self.pool is not None and slot is not None and all(o.dtype == self.pool.dtype for o in outputs):
            # Zero-copy: the experts' rows land in the combine's persistent send buffer, back in
            # received order.
            return scatter_rows_into(self.pool.combine_buffer(slot, grouped.shape[0]), index, outputs)
        expert_out = torch.cat(outputs) if outputs else grouped
        return torch.empty_like(expert_out).index_copy(0, index, expert_out)

    def _combine(self, state: DispatchState, expert_out: torch.Tensor):
        out = expert_out.new_empty((sum(state.send_splits), expert_out.shape[1]))
        send = expert_out.detach().contiguous()
        if self.pool is not None and self.pool.owns(send):
            self.pool.stats.zero_copy_bytes += send.numel() * send.element_size()
        work = self._a2a(out, send, state.send_splits, state.recv_splits)
        return out, work

    def _combine_backward(self, state: DispatchState, grad: torch.Tensor):
        out = grad.new_empty((sum(state.recv_splits), grad.shape[1]))
        work = self._a2a(out, grad.contiguous(), state.recv_splits, state.send_splits)
        return out, work

    def _post(self, state: DispatchState, carry: tuple, combined: torch.Tensor, probs: torch.Tensor):
        # Rows arrive in expert order, so each token sums its experts' outputs in ascending expert
        # order, starting from zeros (as a loop over the experts that adds into a zero tensor does).
        weighted = combined * probs.unsqueeze(-1).to(combined.dtype)
        mixed = weighted.new_zeros((state.num_tokens, combined.shape[1])).index_add(0, state.token_of, weighted)
        return self.moe_post(carry, mixed)

    # -- plain execution ----------------------------------------------------------------------
    def forward(self, *inputs: Any) -> Any:
        state = DispatchState()
        *carry, permuted, probs = self._route(state, *inputs)
        received = _Exchange.apply(permuted, self._dispatch, self._dispatch_backward, state)
        expert_out = self._experts(state, received)
        combined = _Exchange.apply(expert_out, self._combine, self._combine_backward, state)
        if not torch.is_grad_enabled() and self.pool is not None and state.slot is not None:
            self.pool.release(state.slot)  # no backward will come for this microbatch
        return self._post(state, tuple(carry), combined, probs)

    # -- fine-grained execution ---------------------------------------------------------------
    def schedule_nodes(self, event: PlanEvent) -> LayerNodes:
        """The five nodes of one microbatch, ordered by its ``event``. Between nodes the values
        travel as ``(*carry, rows, probs)``: the comm nodes exchange ``rows`` (or their gradient)
        and pass the others through."""
        state = DispatchState(event=event)

        def attn(*inputs):
            return self._route(state, *inputs)

        def exchange(fn):
            """A comm node's function: ``fn`` launches the all-to-all on the rows (tokens or their
            gradient); the work joins the microbatch's event; the others pass through."""
            def run(*values):
                *carry, rows, probs = values
                out, work = fn(state, rows)
                event.add(work)
                return (*carry, out, probs)

            return run

        def mlp(*values):
            *carry, received, probs = values
            return (*carry, self._experts(state, received), probs)

        def post(*values):
            *carry, combined, probs = values
            out = self._post(state, tuple(carry), combined, probs)
            return out if isinstance(out, tuple) else (out,)

        return LayerNodes(
            ScheduleNode(attn, get_comp_stream, event, name="attn"),
            ScheduleNode(exchange(self._dispatch), get_comm_stream, event, exchange(self._dispatch_backward),
                         name="dispatch"),
            ScheduleNode(mlp, get_comp_stream, event, name="mlp"),
            ScheduleNode(exchange(self._combine), get_comm_stream, event, exchange(self._combine_backward),
                         name="combine"),
            ScheduleNode(post, get_comp_stream, event, name="post"),
        )


def _timed_wait(work) -> None:
    if work is not None:
        ctx = context.current()
        wait_for([work], ctx.timeline, ctx.microbatch, ctx.chunk)


class _Exchange(torch.autograd.Function):
    """A synchronous all-to-all inside autograd: ``forward_fn(state, x)`` and
    ``backward_fn(state, grad)`` each return ``(output, work)`` and are waited on here (the plain
    execution mode; the node mode calls the same functions without waiting)."""

    @staticmethod
    def forward(ctx, x, forward_fn, backward_fn, state: DispatchState):
        ctx.backward_fn, ctx.state = backward_fn, state
        out, work = forward_fn(state, x)
        _timed_wait(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, work = ctx.backward_fn(ctx.state, grad)
        _timed_wait(work)
        return out, None, None, None
