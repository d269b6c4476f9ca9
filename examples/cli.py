"""LightningCLI with the pipeline strategy.

    python examples/cli.py fit --config examples/pipeline.yaml

The strategy can be given by class path (``lightning_pp.PipelineStrategy`` with ``init_args``) or,
because this script imports ``lightning_pp``, by a registered name such as ``pp_1f1b``.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pp  # noqa: F401  (registers pp_1f1b & co.)


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class PipelineRegressor(L.LightningModule):
    """A residual MLP regressor with the three pipeline methods."""

    def __init__(self, dim_in: int = 16, hidden: int = 32, dim_out: int = 4, num_blocks: int = 6, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(dim_in, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(num_blocks))
        self.head = nn.Linear(hidden, dim_out)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class RandomRegression(L.LightningDataModule):
    def __init__(self, dim_in: int = 16, dim_out: int = 4, samples: int = 256, batch_size: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(samples, dim_in, generator=g)
        w = torch.randn(dim_in, dim_out, generator=g)
        self.data = TensorDataset(x, torch.tanh(x @ w))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def main(args=None):
    return LightningCLI(PipelineRegressor, RandomRegression, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
