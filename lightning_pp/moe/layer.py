"""A transformer block with a mixture-of-experts MLP, expert parallel over a process group.

Forward of one block (``T`` tokens, ``E`` experts, top ``k``)::

    h = x + attn(ln1(x));  t = ln2(h)                       # attn slot (compute)
    probs, idx = router(t)        (+ aux / z loss through autograd)
    permute t by expert id -> (T*k, H), exchange counts       #
    all-to-all to the ranks that own the experts              # dispatch slot (comm)
    run the local experts on their tokens                     # mlp slot (compute)
    all-to-all back                                           # combine slot (comm)
    out = h + sum_k probs * expert_output                     # post slot (compute)

Experts are built for the whole model (so a single process is the unsharded reference) and
``setup_expert_parallel`` (called by the runtime after cutting) keeps only this rank's share of
them; they keep their global names (``experts.5.fc1.weight``), so checkpoints re-shard across
expert-parallel sizes. Expert parameters carry ``_lpp_expert = True`` and are reduced over the
expert-data-parallel group. Routing is dropless unless ``capacity_factor`` is set.

The same slot functions run in both execution modes, so they give identical numbers:
``forward`` (plain autograd, synchronous all-to-all) and ``schedule_nodes`` (fine-grained nodes
with asynchronous all-to-all, used by combined 1F1B).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pp.moe.buffers import StagingPool, scatter_rows_into, stage_dispatch_bwd_grad
from lightning_pp.runtime import context
from lightning_pp.runtime.nodes import LaunchedWork, LayerNodes, ScheduleNode, wait_for


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} must be divisible by num_heads={num_heads}.")
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)
        for p in self.parameters():
            p._lpp_expert = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ExpertOnOtherRank(nn.Module):
    """Placeholder for an expert held by another expert-parallel rank."""

    def __init__(self, index: int, rank: int):
        super().__init__()
        self.index, self.rank = index, rank

    def forward(self, x):  # pragma: no cover - never called by the layer
        raise RuntimeError(f"expert {self.index} lives on expert-parallel rank {self.rank}, not on this rank.")


class TopKRouter(nn.Module):
    """Softmax top-k router with the load-balancing auxiliary loss (Switch/GShard form
    ``E * sum_e f_e * P_e``) and an optional z-loss (mean squared log-sum-exp of the logits)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, aux_loss_coeff: float = 0.01,
                 z_loss_coeff: float = 0.0, normalize: bool = True):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}.")
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coeff, self.z_loss_coeff, self.normalize = aux_loss_coeff, z_loss_coeff, normalize

    def forward(self, tokens: torch.Tensor):
        logits = self.gate(tokens)
        probs = logits.softmax(dim=-1)
        topk_probs, topk_idx = probs.topk(self.top_k, dim=-1)
        if self.normalize and self.top_k > 1:
            topk_probs = topk_probs / topk_probs.sum(dim=-1, keepdim=True)
        aux = logits.new_zeros(())
        if self.aux_loss_coeff:
            load = torch.bincount(topk_idx.flatten(), minlength=self.num_experts).to(probs.dtype)
            load = load / max(1, topk_idx.numel())
            aux = aux + self.aux_loss_coeff * self.num_experts * (load * probs.mean(dim=0)).sum()
        if self.z_loss_coeff:
            aux = aux + self.z_loss_coeff * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return topk_probs, topk_idx, aux


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward also sends ``weight`` as the gradient of ``aux``, so the
    auxiliary loss trains the router without travelling to the last pipeline stage."""

    @staticmethod
    def forward(ctx, x, aux, weight: float):
        ctx.weight = weight
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


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


class MoEBlock(nn.Module):
    """Pre-norm transformer block whose MLP is a top-k mixture of experts.

    Args:
        hidden, num_heads: attention width and heads.
        ffn_hidden: hidden size of each expert.
        num_experts, top_k: experts and experts per token.
        capacity_factor: None for dropless routing; else each expert takes at most
            ``ceil(tokens * top_k / num_experts * capacity_factor)`` tokens per rank (the rest
            pass through the residual) and the staging buffers have a fixed size.
        aux_loss_coeff, z_loss_coeff: router losses.
        a2a_delay: seconds added to every expert all-to-all (an emulated slower link for
            benchmarks: the wait sleeps, burning no CPU).
    """

    def __init__(self, hidden: int, num_heads: int, ffn_hidden: int, num_experts: int, top_k: int = 2,
                 capacity_factor: Optional[float] = None, aux_loss_coeff: float = 0.01,
                 z_loss_coeff: float = 0.0, a2a_delay: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, num_heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.router = TopKRouter(hidden, num_experts, top_k, aux_loss_coeff, z_loss_coeff)
        self.experts = nn.ModuleList(Expert(hidden, ffn_hidden) for _ in range(num_experts))
        self.num_experts, self.top_k, self.hidden = num_experts, top_k, hidden
        self.capacity_factor = capacity_factor
        self.a2a_delay = a2a_delay
        self.ep_group, self.ep_size, self.ep_rank = None, 1, 0
        self.use_staging = False  # persistent staging buffers, switched on by setup_expert_parallel
        self.pool: Optional[StagingPool] = None

    # -- expert parallelism -------------------------------------------------------------------
    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def setup_expert_parallel(self, group, ep_rank: int, ep_size: int, device: torch.device) -> None:
        """Keep experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``; the rest become placeholders."""
        if self.num_experts % ep_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by expert_parallel_size={ep_size}: every "
                f"expert-parallel rank must hold the same number of experts. Use an expert_parallel_size "
                f"that divides {self.num_experts}, or change num_experts."
            )
        self.ep_group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        local = self.num_local_experts
        for e in range(self.num_experts):
            if not ep_rank * local <= e < (ep_rank + 1) * local:
                self.experts[e] = ExpertOnOtherRank(e, e // local)
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
    def _attn_route(self, state: dict, x: torch.Tensor):
        b, s, h = x.shape
        hidden = x + self.attn(self.ln1(x))
        tokens = self.ln2(hidden).reshape(b * s, h)
        topk_probs, topk_idx, aux = self.router(tokens)
        if aux.requires_grad:
            hidden = _AttachAuxLoss.apply(hidden, aux, context.current().loss_weight)
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        capacity = self._capacity(b * s)
        if capacity is not None:
            sorted_expert = flat_expert[order]
            starts = torch.searchsorted(sorted_expert, torch.arange(self.num_experts, device=x.device))
            position = torch.arange(order.numel(), device=x.device) - starts[sorted_expert]
            order = order[position < capacity]
        token_of = order // self.top_k
        counts = torch.bincount(flat_expert[order], minlength=self.num_experts)
        state.update(shape=(b, s, h), token_of=token_of, counts=counts, capacity=capacity)
        self._launch_counts(state)  # travels while the tokens are gathered
        return hidden, tokens[token_of], topk_probs.reshape(-1)[order]

    def _launch_counts(self, state: dict) -> None:
        """Start the exchange of per-expert token counts (how many rows each rank will send)."""
        counts = state["counts"]
        if self.ep_size > 1:
            recv = torch.empty_like(counts)
            # A few bytes: the emulated link's delay (which stands for moving the tokens) is not added.
            state["counts_exchange"] = (recv, self._a2a(recv, counts, None, None, emulate_link=False))
        else:
            state["counts_exchange"] = (counts, None)

    def _exchange_counts(self, state: dict) -> None:
        """Finish the counts exchange and derive the all-to-all splits and the expert-major order."""
        recv, work = state.pop("counts_exchange")
        _timed_wait(work)
        local = self.num_local_experts
        recv = recv.view(self.ep_size, local)
        state["send_splits"] = state["counts"].view(self.ep_size, local).sum(1).tolist()
        state["recv_splits"] = recv.sum(1).tolist()
        # Received rows are grouped by source rank, then by local expert; the experts want them
        # grouped by expert. expert_major[i] = source-major row index of expert-major row i:
        # block (src, e) starts at source-major row src_start[src, e]; walking the blocks in
        # expert-major order, row i of a block lies at src_start + (i - that block's expert-major start).
        src_start = (torch.cumsum(recv.flatten(), 0) - recv.flatten()).view(self.ep_size, local)
        lengths = recv.t().reshape(-1)
        em_start = torch.cumsum(lengths, 0) - lengths
        shift = torch.repeat_interleave(src_start.t().reshape(-1) - em_start, lengths)
        state["expert_major"] = torch.arange(shift.numel(), device=recv.device) + shift
        state["expert_counts"] = recv.sum(0).tolist()

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

    def _dispatch(self, state: dict, permuted: torch.Tensor):
        self._exchange_counts(state)
        rows = sum(state["recv_splits"])
        if self.use_staging and self.pool is None:
            # Fixed staging size with a capacity: every source sends at most `capacity` rows per
            # local expert. Dropless: grown to the high-water mark.
            capacity = state["capacity"]
            fixed = capacity * self.num_local_experts * self.ep_size if capacity is not None else None
            self.pool = StagingPool(self.hidden, permuted.dtype, permuted.device, self.ep_group, capacity_rows=fixed)
        if self.pool is not None:
            slot = self.pool.acquire(rows)
            out = self.pool.forward_buffer(slot, rows)
        else:
            slot, out = None, permuted.new_empty((rows, permuted.shape[1]))
        state["slot"] = slot
        work = self._a2a(out, permuted.detach().contiguous(), state["recv_splits"], state["send_splits"])
        return out, work

    def _dispatch_backward(self, state: dict, grad: torch.Tensor):
        slot = state["slot"]
        if self.pool is not None and slot is not None:
            grad = stage_dispatch_bwd_grad(self.pool, slot, grad.contiguous())
        out = grad.new_empty((sum(state["send_splits"]), grad.shape[1]))
        work = self._a2a(out, grad.contiguous(), state["send_splits"], state["recv_splits"])
        return out, _ReleaseOnWait(work, self.pool, slot)

    def _experts(self, state: dict, received: torch.Tensor) -> torch.Tensor:
        index = state["expert_major"]
        grouped = received[index]
        outputs, start = [], 0
        first = self.ep_rank * self.num_local_experts
        for e, count in enumerate(state["expert_counts"]):
            outputs.append(self.experts[first + e](grouped[start:start + count]))
            start += count
        slot = state.get("slot")
        if self.pool is not None and slot is not None and all(o.dtype == self.pool.dtype for o in outputs):
            # Zero-copy: the experts' rows land in the combine's persistent send buffer, back in
            # received order.
            return scatter_rows_into(self.pool.combine_buffer(slot, grouped.shape[0]), index, outputs)
        expert_out = torch.cat(outputs) if outputs else grouped
        return torch.empty_like(expert_out).index_copy(0, index, expert_out)

    def _combine(self, state: dict, expert_out: torch.Tensor):
        out = expert_out.new_empty((sum(state["send_splits"]), expert_out.shape[1]))
        send = expert_out.detach().contiguous()
        if self.pool is not None and self.pool.owns(send):
            self.pool.stats.zero_copy_bytes += send.numel() * send.element_size()
        work = self._a2a(out, send, state["send_splits"], state["recv_splits"])
        return out, work

    def _combine_backward(self, state: dict, grad: torch.Tensor):
        out = grad.new_empty((sum(state["recv_splits"]), grad.shape[1]))
        work = self._a2a(out, grad.contiguous(), state["recv_splits"], state["send_splits"])
        return out, work

    def _post(self, state: dict, hidden: torch.Tensor, combined: torch.Tensor, probs: torch.Tensor):
        b, s, h = state["shape"]
        weighted = combined * probs.unsqueeze(-1).to(combined.dtype)
        mixed = weighted.new_zeros((b * s, h)).index_add(0, state["token_of"], weighted)
        return hidden + mixed.view(b, s, h)

    # -- plain execution ----------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state: dict = {}
        hidden, permuted, probs = self._attn_route(state, x)
        received = _Exchange.apply(permuted, self._dispatch, self._dispatch_backward, state)
        expert_out = self._experts(state, received)
        combined = _Exchange.apply(expert_out, self._combine, self._combine_backward, state)
        if not torch.is_grad_enabled() and self.pool is not None and state.get("slot") is not None:
            self.pool.release(state["slot"])  # no backward will come for this microbatch
        return self._post(state, hidden, combined, probs)

    # -- fine-grained execution ---------------------------------------------------------------
    def schedule_nodes(self) -> LayerNodes:
        def attn(state, x):
            return self._attn_route(state, x)

        def exchange(fn):
            """A comm node's function: ``fn`` launches the all-to-all on the middle tensor (tokens
            or their gradient); the work joins the microbatch's event; the others pass through."""
            def run(state, hidden, tokens, probs):
                out, work = fn(state, tokens)
                state["event"].add(work)
                return hidden, out, probs

            return run

        def mlp(state, hidden, received, probs):
            return hidden, self._experts(state, received), probs

        def post(state, hidden, combined, probs):
            return (self._post(state, hidden, combined, probs),)

        return LayerNodes(
            ScheduleNode(attn, "attn"),
            ScheduleNode(exchange(self._dispatch), "dispatch", comm=True, backward_fn=exchange(self._dispatch_backward)),
            ScheduleNode(mlp, "mlp"),
            ScheduleNode(exchange(self._combine), "combine", comm=True, backward_fn=exchange(self._combine_backward)),
            ScheduleNode(post, "post"),
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
    def forward(ctx, x, forward_fn, backward_fn, state: dict):
        ctx.backward_fn, ctx.state = backward_fn, state
        out, work = forward_fn(state, x)
        _timed_wait(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, work = ctx.backward_fn(ctx.state, grad)
        _timed_wait(work)
        return out, None, None, None
