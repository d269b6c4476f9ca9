"""Data under a pipeline: every stage of one pipeline reads the same batches, replicas disjoint ones.

A sampler is told by the strategies' ``distributed_sampler_kwargs`` (the data-parallel size and
rank, not the world's). A dataset that shards itself by ``torch.distributed``'s world size and rank
would give every stage another shard; for one the strategies do not know, read
:attr:`DataParallelWorld.size` / ``rank`` from ``strategy.data_parallel_size`` /
``strategy.data_parallel_rank`` and shard by those.

litdata's ``StreamingDataset`` (and ``CombinedStreamingDataset``) is made to shard over the
data-parallel ranks with no change to the user's code, in two places:

* while a pipeline's process groups exist, litdata's own detection of the distributed environment
  (``_DistributedEnv.detect``, which litdata calls when a dataset is made, e.g. in
  ``train_dataloader()`` as litgpt does) answers with the data-parallel world, so litdata's own
  rules (``drop_last`` in a distributed run, node-aware shuffling) apply to the replicas;
* a dataset made before the groups existed (it saw one process) gets the data-parallel world when
  its loader is set up (``process_dataloader``): its ``distributed_env``, the attribute litdata's
  maintainers point to for overriding the detection.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class DataParallelWorld:
    """What a data loader shards over under the pipeline: the data-parallel replicas."""

    size: int  # replicas: world size / pipeline size
    rank: int  # this rank's replica (the same on every stage of one pipeline)
    num_nodes: int  # nodes one stage's replicas span (1 unless a stage spans several nodes)


def _litdata_env():
    """litdata's environment class, if litdata is installed (imported only then)."""
    if "litdata" not in sys.modules:
        import importlib.util

        if importlib.util.find_spec("litdata") is None:
            return None
    try:
        from litdata.utilities.env import _DistributedEnv
    except ImportError:  # pragma: no cover - an older or newer litdata without it
        return None
    return _DistributedEnv


class LitdataSharding:
    """Makes litdata see the data-parallel world while installed (see the module docstring)."""

    def __init__(self, world: DataParallelWorld) -> None:
        self.world = world
        self._env = _litdata_env()
        self._original: Optional[Any] = None

    def install(self) -> None:
        env = self._env
        if env is None or self._original is not None:
            return
        original = env.__dict__["detect"]
        world = self.world

        def detect(cls):
            found = original.__func__(cls)
            # Only litdata's answer taken from torch.distributed is replaced (inside litdata's own
            # optimize/map workers it reads its environment variables: left alone).
            if dist.is_initialized() and found.world_size == dist.get_world_size():
                return cls(world.size, world.rank, world.num_nodes)
            return found

        env.detect = classmethod(detect)
        self._original = original

    def uninstall(self) -> None:
        if self._original is not None:
            self._env.detect = self._original
            self._original = None

    def apply(self, dataloader: Any) -> Any:
        """Give every litdata dataset of ``dataloader`` the data-parallel world."""
        env = self._env
        if env is None:
            return dataloader
        for dataset in _streaming_datasets(getattr(dataloader, "dataset", None)):
            seen = dataset.distributed_env
            world = self.world
            if (seen.world_size, seen.global_rank) == (world.size, world.rank):
                continue
            dataset.distributed_env = env(world.size, world.rank, world.num_nodes)
            if world.size > 1 and seen.world_size == 1 and not dataset.drop_last:
                # Made before the process group existed, litdata took one process and kept
                # drop_last=False; in a distributed run it sets it, so every replica runs the same
                # number of steps (uneven replicas would wait for each other's reductions).
                dataset.drop_last = True
                warnings.warn(
                    f"lightning_pp: a litdata {type(dataset).__name__} made before the process group existed "
                    f"now shards over the {world.size} data-parallel replicas with drop_last=True, as litdata "
                    f"does in a distributed run. Make it in train_dataloader() (or after fabric.launch()) to "
                    f"have litdata decide from the start.", stacklevel=3)
            dataset.shuffler = None  # made again with the new world and drop_last
        return dataloader


def _streaming_datasets(dataset: Any) -> list:
    """litdata datasets in ``dataset`` (a ``StreamingDataset``, or those a
    ``CombinedStreamingDataset`` combines), found by their attributes without importing litdata."""
    if dataset is None or not type(dataset).__module__.startswith("litdata"):
        return []
    inner = getattr(dataset, "_datasets", None)
    if inner is not None:
        return [d for sub in inner for d in _streaming_datasets(sub)]
    return [dataset] if hasattr(dataset, "distributed_env") else []


def data_parallel_world(dims: Any, global_rank: int, num_nodes: int) -> DataParallelWorld:
    """The data-parallel world of ``global_rank`` for parallel sizes ``dims`` (``ParallelDims``)."""
    nodes = num_nodes // dims.pp if num_nodes % dims.pp == 0 and num_nodes >= dims.pp else 1
    return DataParallelWorld(dims.dp, dims.coordinates(global_rank)["dp"], max(1, nodes))


def first_training_batch(trainer) -> Any:
    """What ``layout="auto"`` measures on when fitting a module without ``pipeline_example_batch``:
    a function returning the first batch of the training dataloader (called on global rank 0 only,
    and only for ``layout="auto"``); ``None`` otherwise."""
    from lightning.pytorch.trainer.states import TrainerFn

    module = trainer.lightning_module
    if trainer.state.fn != TrainerFn.FITTING or callable(getattr(module, "pipeline_example_batch", None)):
        return None

    def first_batch() -> Any:
        from lightning.pytorch.utilities.combined_loader import CombinedLoader

        loader = trainer.fit_loop._data_source.dataloader()  # the user's train_dataloader(), as the fit loop asks
        batch, _, _ = next(iter(CombinedLoader(loader, "max_size_cycle")))
        return batch

    return first_batch


__all__ = ["DataParallelWorld", "LitdataSharding", "data_parallel_world", "first_training_batch"]
