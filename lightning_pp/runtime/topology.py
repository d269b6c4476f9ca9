"""Process groups for pipeline (pp), data (dp), expert (ep) and tensor (tp) parallelism.

Rank order (pp outermost, tp innermost)::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank,      dp_rank = edp_rank * ep + ep_rank

so a tensor-parallel group is ``tp`` consecutive ranks (the fast links of a node), the
data-parallel group joins the ranks of one stage with the same tensor-parallel rank, and a
pipeline group the ranks with the same (dp, tp) coordinates.

so one pipeline stage owns ``dp`` consecutive ranks, an expert-parallel group is ``ep``
consecutive ranks inside one stage (expert all-to-all never crosses stages), and the
expert-data-parallel group (``edp = dp / ep``) joins the ranks of one stage that hold the same
experts. Example, world 8, pp 2, ep 2 (dp 4, edp 2)::

    pp groups  [0,4] [1,5] [2,6] [3,7]
    dp groups  [0,1,2,3] [4,5,6,7]
    ep groups  [0,1] [2,3] [4,5] [6,7]
    edp groups [0,2] [1,3] [4,6] [5,7]

Dense parameters are reduced over ``dp``, expert parameters over ``edp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from lightning_pp.schedules.tables import positive_int


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions; :meth:`check` raises before any group exists."""

    world_size: int
    pp: int
    ep: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp)

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    def check(self) -> "ParallelDims":
        for name, value in (("pipeline_parallel_size", self.pp), ("expert_parallel_size", self.ep),
                            ("tensor_parallel_size", self.tp)):
            positive_int(name, value, "Use 1 to disable it.")
        if self.world_size % (self.pp * self.tp * self.ep) != 0 and self.tp > 1:
            fits = [t for t in range(1, self.world_size + 1) if self.world_size % (self.pp * t * self.ep) == 0]
            raise ValueError(
                f"world size {self.world_size} is not divisible by pipeline_parallel_size * tensor_parallel_size * "
                f"expert_parallel_size = {self.pp} * {self.tp} * {self.ep} = {self.pp * self.tp * self.ep}: every "
                f"pipeline stage needs the same number of ranks, made of whole tensor-parallel groups. Use a device "
                f"count that is a multiple of {self.pp * self.tp * self.ep}, or tensor_parallel_size in {fits} with "
                f"pipeline_parallel_size={self.pp}.")
        if self.world_size % (self.pp * self.ep) != 0:
            fits = [p for p in range(1, self.world_size + 1) if self.world_size % (p * self.ep) == 0]
            raise ValueError(
                f"world size {self.world_size} is not divisible by pipeline_parallel_size * "
                f"expert_parallel_size = {self.pp} * {self.ep} = {self.pp * self.ep}: every pipeline "
                f"stage needs the same number of ranks, and expert groups must fit inside a stage. "
                f"Use a device count that is a multiple of {self.pp * self.ep}, or "
                f"pipeline_parallel_size in {fits} with expert_parallel_size={self.ep}."
            )
        return self

    def coordinates(self, rank: int) -> dict[str, int]:
        slot, tp_rank = divmod(rank, self.tp)
        pp_rank, dp_rank = divmod(slot, self.dp)
        edp_rank, ep_rank = divmod(dp_rank, self.ep)
        return {"pp": pp_rank, "dp": dp_rank, "ep": ep_rank, "edp": edp_rank, "tp": tp_rank}

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank


@dataclass
class Topology:
    """This rank's place in the pp x dp(edp x ep) x tp grid, and the groups that go with it."""

    dims: ParallelDims
    rank: int
    pp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None
    edp_group: Optional[dist.ProcessGroup] = None
    tp_group: Optional[dist.ProcessGroup] = None
    # The ("pp", "edp", "ep", "tp") device mesh, given to the user's configure_model as
    # self.device_mesh; it also answers Lightning's ModelParallelStrategy names "data_parallel"
    # (= "dp") and "tensor_parallel" (= "tp").
    mesh: object = None
    dp_mesh: object = None  # its flattened data-parallel dimension ("dp": edp x ep), kept here
    tp_mesh: object = None  # its tensor-parallel dimension
    # The stage's ("ep", "edp") mesh (ep > 1 and edp > 1 only): experts stacked in one tensor are
    # cut into rows over ep, then FSDP2 shards each rank's rows over edp; their checkpoint view is
    # the global tensor sharded along dim 0 over this mesh, ep first (lightning_pp.runtime.cut.stacked).
    ep_edp_mesh: object = None

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def pp_rank(self) -> int:
        return self.dims.coordinates(self.rank)["pp"]

    @property
    def dp_rank(self) -> int:
        return self.dims.coordinates(self.rank)["dp"]

    @property
    def ep_rank(self) -> int:
        return self.dims.coordinates(self.rank)["ep"]

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def tp_rank(self) -> int:
        return self.dims.coordinates(self.rank)["tp"]

    def global_rank(self, pp_rank: int, dp_rank: Optional[int] = None) -> int:
        """Global rank of pipeline stage ``pp_rank`` in this rank's data-parallel and
        tensor-parallel slot."""
        return self.dims.rank_of(pp_rank, self.dp_rank if dp_rank is None else dp_rank, self.tp_rank)

    def describe(self, rank: Optional[int] = None) -> str:
        rank = self.rank if rank is None else rank
        c = self.dims.coordinates(rank)
        tp = f", tp={c['tp']}" if self.dims.tp > 1 else ""
        return f"rank {rank} (pp={c['pp']}, dp={c['dp']}, ep={c['ep']}{tp})"


def build_topology(pp: int, ep: int = 1, device_type: str = "cpu", tp: int = 1) -> Topology:
    """Create the pp/dp/ep/edp/tp groups with ``torch.distributed.device_mesh``.

    Must be called on every rank after ``init_process_group``. The sizes are checked before any
    group is created, so a bad configuration fails identically and immediately on all ranks.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_topology needs an initialised default process group: call "
            "torch.distributed.init_process_group first (Lightning's strategy does this for you)."
        )
    dims = ParallelDims(dist.get_world_size(), pp, ep, tp).check()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dims.pp, dims.edp, dims.ep, dims.tp), mesh_dim_names=("pp", "edp", "ep", "tp"))
    dp_mesh = mesh["edp", "ep"]._flatten("dp")
    # Lightning's ModelParallelStrategy names, for configure_model code written for it.
    mesh["edp", "ep"]._flatten("data_parallel")
    mesh["tp"]._flatten("tensor_parallel")
    ep_edp_mesh = None
    if dims.ep > 1 and dims.edp > 1:  # made on every rank alike (a mesh's groups are collective to make)
        from torch.distributed.device_mesh import DeviceMesh

        ep_edp_mesh = DeviceMesh(device_type, mesh.mesh.permute(0, 2, 1, 3),
                                 mesh_dim_names=("pp", "ep", "edp", "tp"))["ep", "edp"]
    return Topology(
        dims=dims,
        rank=dist.get_rank(),
        pp_group=mesh.get_group("pp"),
        dp_group=dp_mesh.get_group(),
        ep_group=mesh.get_group("ep"),
        edp_group=mesh.get_group("edp"),
        tp_group=mesh.get_group("tp"),
        mesh=mesh,
        dp_mesh=dp_mesh,
        tp_mesh=mesh["tp"],
        ep_edp_mesh=ep_edp_mesh,
    )
