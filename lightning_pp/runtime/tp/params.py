"""The tensor-parallel parameters of a stage (issue 37, first slice).

The user splits the layers with torch's ``parallelize_module`` over the tensor-parallel mesh
(``self.device_mesh["tensor_parallel"]``) in ``configure_model``, before the cut; the layers this
rank keeps hold DTensor parameters over that mesh. Their gradients are this rank's shards: reduced
over the data-parallel group as local tensors (every data-parallel replica holds the same shard),
counted once per shard in the global norm. DTensors over any other mesh are refused by name.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from lightning_pp.runtime.dtensors import is_dtensor
from lightning_pp.runtime.dtensors import local as local_of
from lightning_pp.runtime.topology import Topology


def _mesh_ranks(mesh) -> list[int]:
    return sorted(int(r) for r in mesh.mesh.flatten().tolist())


def is_tensor_parallel(param: torch.Tensor, topology: Topology) -> bool:
    """``param`` is a DTensor over this rank's tensor-parallel mesh (one dimension, its ranks)."""
    if topology.tp == 1 or not is_dtensor(param) or param.device_mesh.ndim != 1:
        return False
    return _mesh_ranks(param.device_mesh) == sorted(dist.get_process_group_ranks(topology.tp_group))


def distinct_shards(param: torch.Tensor) -> int:
    """How many different pieces ``param``'s ranks hold: the product of its mesh's sizes over the
    dimensions it is sharded along (1 for a plain or replicated tensor)."""
    if not is_dtensor(param):
        return 1
    count = 1
    for size, placement in zip(param.device_mesh.shape, param.placements):
        if placement.is_shard():
            count *= size
    return count


def refuse_other_meshes(params: Iterable[torch.Tensor], names: dict[int, str], managed: set[int],
                        topology: Topology) -> set[int]:
    """The ids of ``params`` that are tensor-parallel DTensors; ``ValueError`` naming every other
    DTensor parameter that the pipeline does not manage (``managed``: its FSDP2 units'), its mesh's
    dimensions and ranks. With ``tensor_parallel_size == 1`` the caller's own error stands."""
    params = list(params)
    tensor_parallel = {id(p) for p in params if id(p) not in managed and is_tensor_parallel(p, topology)}
    if topology.tp == 1:
        return tensor_parallel
    stray = [p for p in params if is_dtensor(p) and id(p) not in managed and id(p) not in tensor_parallel]
    if stray:
        p = stray[0]
        tp_ranks = sorted(dist.get_process_group_ranks(topology.tp_group))
        raise ValueError(
            f"{len(stray)} parameter(s) are DTensors over a mesh other than the tensor-parallel one when the "
            f"pipeline is set up: {', '.join(names.get(id(q), '?') for q in stray[:6])}; e.g. "
            f"{names.get(id(p), '?')} is over mesh dimension(s) {p.device_mesh.mesh_dim_names} with ranks "
            f"{_mesh_ranks(p.device_mesh)}, but this rank's tensor-parallel group is {tp_ranks} "
            f"(tensor_parallel_size={topology.tp}). Inside a pipeline, parallelize the layers over "
            f"self.device_mesh['tensor_parallel'] only (a 2-D data x tensor mesh, or fully_shard, with "
            f"tensor_parallel_size > 1 is not supported yet).")
    return tensor_parallel


_HEAD_COUNTS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads", "n_kv_heads",
                "num_kv_heads", "n_query_groups")


def check_tensor_parallel_model(module: torch.nn.Module, topology: Topology) -> None:
    """Before the cut, on the whole model (alike on every rank): with ``tensor_parallel_size > 1``
    some parameters must be tensor-parallel (the user's ``parallelize_module`` calls), none on the
    meta device, and every module split by them must have head counts divisible by the size."""
    if topology.tp == 1:
        return
    named = dict(module.named_parameters(remove_duplicate=False))
    refuse_other_meshes(named.values(), {id(p): n for n, p in reversed(named.items())}, set(), topology)
    split = {name: sub for name, sub in module.named_modules()
             if any(is_tensor_parallel(p, topology) for p in sub.parameters())}
    if not split:
        raise ValueError(
            f"tensor_parallel_size={topology.tp}, but no parameter of {type(module).__name__} is a DTensor over "
            f"the tensor-parallel mesh: split the layers in configure_model (Trainer) or before setup_module "
            f"(Fabric) with torch.distributed.tensor.parallel.parallelize_module(block, "
            f"self.device_mesh['tensor_parallel'], plan). Plans taken from the model (Hugging Face "
            f"base_model_tp_plan, litgpt) are not supported yet; use tensor_parallel_size=1 otherwise.")
    for name, sub in split.items():
        if any(p.is_meta for p in sub.parameters()):
            raise ValueError(
                f"{name or type(module).__name__} holds tensor-parallel parameters on the meta device: "
                f"tensor_parallel_size={topology.tp} with meta-device initialisation (empty_init=True) is not "
                f"supported yet. Build the model on the CPU, or use tensor_parallel_size=1.")
        for attr in _HEAD_COUNTS:
            heads = getattr(sub, attr, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads % topology.tp:
                raise ValueError(
                    f"{name or type(module).__name__}.{attr}={heads} is not divisible by "
                    f"tensor_parallel_size={topology.tp}: its tensor-parallel split gives every rank whole heads. "
                    f"Use a tensor_parallel_size that divides {heads}.")


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``'s gradient, which must be laid out as ``param`` is: a gradient
    left partial over the tensor-parallel ranks (as sequence-parallel layers can leave a replicated
    norm weight's) would be reduced and stepped as if it were whole."""
    grad = param.grad
    if is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):
        raise ValueError(
            f"a tensor-parallel parameter of shape {tuple(param.shape)} laid out as {tuple(param.placements)} over "
            f"{param.device_mesh.mesh_dim_names} has a gradient laid out as {tuple(grad.placements)}: sequence "
            f"parallelism (or another plan leaving gradients partial) is not supported yet inside pipeline stages. "
            f"Use ColwiseParallel/RowwiseParallel with replicated activations between the blocks.")
    return local_of(grad)


def refuse_distributed_values(values, where: str) -> None:
    """A DTensor (a plan's ``use_local_output=False``: loss parallel, sequence-parallel outputs) must not
    reach a stage boundary or ``pipeline_loss``: not supported yet."""
    from torch.utils._pytree import tree_leaves

    if any(is_dtensor(v) for v in tree_leaves(values) if isinstance(v, torch.Tensor)):
        raise ValueError(
            f"{where} is a DTensor: a tensor-parallel plan left a layer's output distributed (use_local_output=False, "
            f"as loss parallelism does). Loss parallelism and distributed activations between pipeline layers are "
            f"not supported yet: keep parallelize_module's default use_local_output=True.")
