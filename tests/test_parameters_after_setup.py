"""Parameters that change after the pipeline is set up: frozen or unfrozen later (a fine-tuning
schedule) trains exactly as on one device; replaced or wrapped later (``fully_shard`` in
``configure_optimizers``) raises at the first step, naming the parameter, on every rank; DTensor
parameters at setup that no FSDP2 unit of a layer drives are refused by name."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from distributed import run_distributed
from models import Block

TRAINER = dict(accelerator="cpu", max_epochs=2, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
BATCH = 4  # per replica


class FreezeFirstEpoch(L.LightningModule):
    """Trains its head and blocks for an epoch with the embedding frozen, then unfreezes it (a
    common fine-tuning schedule, written in the module's own hook)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Linear(5, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(4))
        self.head = nn.Linear(8, 3)
        self.embed.requires_grad_(False)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.pipeline_layers():
            x = layer(x)
        return self.pipeline_loss(x, batch)

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            self.embed.requires_grad_(True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ShardedInConfigureOptimizers(FreezeFirstEpoch):
    """Wraps its blocks with FSDP2 once the pipeline is set up: their parameters become DTensors
    the pipeline never saw."""

    def configure_optimizers(self):
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            if any(True for _ in block.parameters()):  # this rank's blocks (the cut removed the others)
                fully_shard(block, mesh=self.device_mesh["dp"])
        return super().configure_optimizers()


class DistributedInConfigureModel(FreezeFirstEpoch):
    """A DTensor parameter the pipeline does not drive (as tensor parallelism makes), set in
    configure_model: refused at setup by name. (fully_shard there is driven: tests/test_sharding_trainer.py.)"""

    def configure_model(self):
        from torch.distributed.tensor import Replicate, distribute_tensor

        for block in self.blocks:
            block.norm.weight = nn.Parameter(distribute_tensor(block.norm.weight.detach(), self.device_mesh["dp"],
                                                               [Replicate()]))


def _dataset(n=32):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g))


class ReplicasTogether(Sampler):
    """One device's order for ``replicas`` data-parallel replicas: per step, each replica's next
    batch from torch's DistributedSampler (seed 0, reshuffled every epoch), one after the other."""

    def __init__(self, dataset, replicas: int):
        self.dataset, self.replicas, self.epoch = dataset, replicas, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        shards = []
        for rank in range(self.replicas):
            sampler = DistributedSampler(self.dataset, num_replicas=self.replicas, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        return iter([i for k in range(0, len(shards[0]), BATCH) for shard in shards for i in shard[k:k + BATCH]])

    def __len__(self):
        return len(self.dataset)


def _run(rank, world):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    model = FreezeFirstEpoch()
    L.Trainer(devices=world, strategy=PipelineStrategy(pipeline_parallel_size=2, num_microbatches=2), **TRAINER).fit(
        model, DataLoader(_dataset(), batch_size=BATCH))
    unfrozen = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        L.Trainer(devices=world, strategy=PipelineStrategy(pipeline_parallel_size=2, num_microbatches=2), **TRAINER).fit(
            ShardedInConfigureOptimizers(), DataLoader(_dataset(), batch_size=BATCH))
        sharded = None
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        sharded = f"{type(exc).__name__}: {exc}"
    try:
        L.Trainer(devices=world, strategy=PipelineStrategy(pipeline_parallel_size=2, num_microbatches=2), **TRAINER).fit(
            DistributedInConfigureModel(), DataLoader(_dataset(), batch_size=BATCH))
        at_setup = None
    except Exception as exc:  # noqa: BLE001
        at_setup = f"{type(exc).__name__}: {exc}"
    return unfrozen, sharded, at_setup


@pytest.mark.timeout(300)
def test_parameters_frozen_later_train_exactly_and_parameters_replaced_later_raise_at_the_first_step():
    dataset = _dataset()
    ref = FreezeFirstEpoch()
    L.Trainer(devices=1, use_distributed_sampler=False, **TRAINER).fit(
        ref, DataLoader(dataset, batch_size=2 * BATCH, sampler=ReplicasTogether(dataset, 2)))
    expected = dict(ref.named_parameters())
    assert not torch.equal(expected["embed.weight"], FreezeFirstEpoch().embed.weight)  # it did train in epoch 2
    seen = set()
    for rank, (unfrozen, sharded, at_setup) in enumerate(run_distributed(_run, 4, timeout=260)):
        # pp=2 x dp=2: the embedding's gradient, frozen when the pipeline was set up, is reduced over
        # the two replicas once unfrozen (before, each replica stepped its own gradient).
        for name, value in unfrozen.items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {name}")
            seen.add(name)
        assert sharded is not None and "ParametersChangedError" in sharded, f"rank {rank}: {sharded}"
        block = "blocks.0." if rank < 2 else "blocks.2."  # stage 0 holds blocks 0-1, stage 1 blocks 2-3
        assert f"{block}norm.weight" in sharded and "DTensor" in sharded and "configure_model" in sharded, sharded
        assert at_setup is not None and "are DTensors when the pipeline is set up" in at_setup, f"rank {rank}: {at_setup}"
        assert "data_parallel_sharding='full'" in at_setup, at_setup
        assert f"{block}norm.weight" in at_setup, at_setup
    assert seen == set(expected)
