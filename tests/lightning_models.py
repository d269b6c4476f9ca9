"""A LightningModule with the pipeline protocol whose single-device training is the reference."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from models import Block


class PipeRegressor(L.LightningModule):
    def __init__(self, dim_in: int = 5, hidden: int = 8, dim_out: int = 3, blocks: int = 6, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(dim_in, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.head = nn.Linear(hidden, dim_out)
        self.train_mse = torchmetrics.MeanSquaredError()
        self.hook_calls = {"on_after_backward": 0, "on_before_optimizer_step": 0}
        self.grad_norms = []

    # -- the pipeline protocol --
    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output, batch):
        loss = F.mse_loss(output, batch[1])
        self.log("mae", F.l1_loss(output, batch[1]), prog_bar=True, sync_dist=True)
        if self.training:
            self.train_mse(output, batch[1])
            self.log("mse_metric", self.train_mse, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    # -- unchanged single-device code --
    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self(batch[0]), batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self(batch[0]), batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self(batch[0]), batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def on_after_backward(self):
        self.hook_calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, optimizer):
        self.hook_calls["on_before_optimizer_step"] += 1

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def regression_data(n: int = 48, dim_in: int = 5, dim_out: int = 3, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim_in, generator=g)
    y = torch.randn(n, dim_out, generator=g) + x[:, :dim_out]
    return TensorDataset(x, y)


def loader(batch_size: int, n: int = 48, dp: int = 1, dp_rank: int = 0) -> DataLoader:
    """Sequential batches. With ``dp > 1``: this data-parallel rank's share of each global batch of
    ``batch_size * dp`` rows, so the dp ranks together see exactly the single-device batches."""
    data = regression_data(n)
    if dp > 1:
        global_batch = batch_size * dp
        rows = [i for start in range(0, n, global_batch)
                for i in range(start + dp_rank * batch_size, min(start + (dp_rank + 1) * batch_size, n))]
        data = TensorDataset(*(t[rows] for t in data.tensors))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


# -- a tied-embedding LM and one device's order of a data-parallel run (sharding, compile) --
TRAINER = dict(accelerator="cpu", precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
BATCH = 4  # per data-parallel replica at dp=2
VOCAB, HIDDEN, SEQ = 11, 8, 5


class TiedLM(L.LightningModule):
    """Embedding shared with the head (on the first and last stage), four blocks; AdamW."""

    def __init__(self, shard_blocks: bool = False):
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(4))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.shard_blocks = shard_blocks

    def configure_model(self):
        if self.shard_blocks:  # Lightning's ModelParallelStrategy convention, over the dp dimension
            from torch.distributed.fsdp import fully_shard

            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh["dp"])

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, logits, batch):
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def tokens(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))


class OneDeviceOrder(Sampler):
    """One device's order for a run whose epoch ``e`` had ``replicas[e]`` data-parallel replicas of
    ``global_batch / replicas[e]`` samples each: per step, each replica's next batch from torch's
    DistributedSampler (seed 0, reshuffled every epoch), one after the other."""

    def __init__(self, dataset, replicas: list[int], global_batch: int = 2 * BATCH):
        self.dataset, self.replicas, self.global_batch, self.epoch = dataset, replicas, global_batch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        replicas = self.replicas[self.epoch]
        per = self.global_batch // replicas
        shards = []
        for rank in range(replicas):
            sampler = DistributedSampler(self.dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        return iter([i for k in range(0, len(shards[0]), per) for shard in shards for i in shard[k:k + per]])

    def __len__(self):
        return len(self.dataset)


def gathered(model):
    """Every parameter this rank holds, whole, by its one-device name (a tied copy by its tie's)."""
    from lightning_pp.runtime import executor_of

    names = executor_of(model).partition.parameter_names
    return {names[id(p)]: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in model.parameters()}
