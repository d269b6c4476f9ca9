"""The global gradient norm of a pipelined model, and clipping by it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_pp.runtime.cut.partition import Partition
from lightning_pp.runtime.dp.grads import GradientSync, is_expert_parameter
from lightning_pp.runtime.dtensors import is_dtensor
from lightning_pp.runtime.dtensors import local as local_of
from lightning_pp.runtime.topology import Topology
from lightning_pp.runtime.tp.params import distinct_shards


def grad_norm(sync: GradientSync, topology: Topology, partition: Partition, norm_type: float = 2.0) -> torch.Tensor:
    """Norm of the whole model's gradient, identical on every rank.

    Each rank weights its local contribution so that one all-reduce over the world counts every
    parameter exactly once: dense gradients are replicated over dp (weight 1/dp), expert
    gradients over edp (weight 1/edp), a sharded gradient's shards are disjoint (weight 1), all of
    them replicated over tp (weight 1/tp) except a tensor-parallel one's shards, and a
    tied parameter counts only on the lowest pipeline rank that holds it.
    """
    owner = {t.name: min(t.pp_ranks) for t in partition.tied}
    names = partition.parameter_names
    norm_type = float(norm_type)
    device = sync.params[0].device if sync.params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in sync.params:
        if p.grad is None or owner.get(names.get(id(p)), topology.pp_rank) != topology.pp_rank:
            continue
        g = local_of(p.grad).detach().to(torch.float64)
        if norm_type == float("inf"):
            if g.numel():
                total = torch.maximum(total, g.abs().max())
        else:
            if is_dtensor(p.grad) and id(p) not in sync.tensor_parallel:  # an FSDP2 shard, disjoint over dp
                replicas = topology.tp
            else:  # replicated over dp (edp) and tp, except over the tensor-parallel ranks it is sharded over
                replicas = (topology.dims.edp if is_expert_parameter(p) else topology.dp) * topology.tp / distinct_shards(p)
            total += g.abs().pow(norm_type).sum() / replicas
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM)
    return total if norm_type == float("inf") else total.pow(1.0 / norm_type)


def clip_grad_norm_(sync: GradientSync, topology: Topology, partition: Partition, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every rank's gradients by the same factor so the global norm is at most ``max_norm``
    (the formula of ``torch.nn.utils.clip_grad_norm_``, applied to the whole pipelined model)."""
    total = grad_norm(sync, topology, partition, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), so it cannot be "
            f"clipped. Set error_if_nonfinite=False to clip anyway."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in sync.params:
        if p.grad is not None:
            local_of(p.grad).mul_(coef.to(p.grad.dtype))
    return total
