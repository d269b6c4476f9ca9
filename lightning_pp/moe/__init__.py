"""Mixture-of-experts layers with expert parallelism and zero-copy staging buffers."""

from lightning_pp.moe.buffers import BufferStats, StagingPool, stage_dispatch_bwd_grad
from lightning_pp.moe.layer import CausalSelfAttention, Expert, MoEBlock, TopKRouter

__all__ = ["BufferStats", "CausalSelfAttention", "Expert", "MoEBlock", "StagingPool", "TopKRouter", "stage_dispatch_bwd_grad"]
