"""Mixture-of-experts layers with expert parallelism and zero-copy staging buffers."""

from lightning_pp.moe.buffers import BufferStats, StagingPool, stage_dispatch_bwd_grad
from lightning_pp.moe.layer import CausalSelfAttention, Expert, MoEBlock, TopKRouter
from lightning_pp.moe.parallel import ExpertOnOtherRank, ExpertParallelMoE, mark_expert_parameters
from lightning_pp.moe.state import DispatchState, MoERouting

__all__ = ["BufferStats", "CausalSelfAttention", "Expert", "ExpertOnOtherRank", "ExpertParallelMoE", "MoEBlock",
           "DispatchState", "MoERouting", "StagingPool", "TopKRouter", "mark_expert_parameters", "stage_dispatch_bwd_grad"]
