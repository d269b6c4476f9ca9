"""A transformer block with a mixture-of-experts MLP, expert parallel over a process group.

Forward of one block (``T`` tokens, ``E`` experts, top ``k``)::

    h = x + attn(ln1(x));  t = ln2(h)                       # attn slot (compute)
    probs, idx = router(t)        (+ aux / z loss through autograd)
    permute t by expert id -> (T*k, H), exchange counts
    all-to-all to the ranks that own the experts              # dispatch slot (comm)
    run the local experts on their tokens                     # mlp slot (compute)
    all-to-all back                                           # combine slot (comm)
    out = h + sum_k probs * expert_output                     # post slot (compute)

The block supplies the attention, router and residual (``moe_pre`` / ``moe_post``) and its
experts; the expert parallelism (sharding, dispatch and combine, staging buffers, both execution
modes, the schedule nodes) is :class:`lightning_pp.moe.parallel.ExpertParallelMoE`'s.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pp.moe.parallel import ExpertParallelMoE
from lightning_pp.moe.state import MoERouting
from lightning_pp.runtime import context


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


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


class MoEBlock(ExpertParallelMoE):
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
        super().__init__(num_experts, top_k, capacity_factor=capacity_factor, a2a_delay=a2a_delay)
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, num_heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.router = TopKRouter(hidden, num_experts, top_k, aux_loss_coeff, z_loss_coeff)
        self.experts = nn.ModuleList(Expert(hidden, ffn_hidden) for _ in range(num_experts))
        self.hidden = hidden

    def expert_list(self) -> nn.ModuleList:
        return self.experts

    def moe_pre(self, x: torch.Tensor) -> MoERouting:
        b, s, h = x.shape
        hidden = x + self.attn(self.ln1(x))
        tokens = self.ln2(hidden).reshape(b * s, h)
        topk_probs, topk_idx, aux = self.router(tokens)
        if aux.requires_grad:
            hidden = _AttachAuxLoss.apply(hidden, aux, context.current().loss_weight)
        return MoERouting((hidden,), tokens, topk_probs, topk_idx)

    def moe_post(self, carry: tuple, mixed: torch.Tensor) -> torch.Tensor:
        (hidden,) = carry
        return hidden + mixed.view(hidden.shape)
