"""See the pipeline: train a residual MLP on 2 CPU processes with ``PipelineMonitor`` and look at
each rank's measured schedule next to the planned one.

    python examples/monitor.py                                    # 1F1B, pp=2, 4 microbatches
    python examples/monitor.py --schedule interleaved --vp 2 --png docs/timeline.png

Writes into ``lightning_logs/version_N/``: ``metrics.csv`` (``pipeline/bubble``,
``pipeline/ideal_bubble``, ``pipeline/forward_ms``, ...), ``pipeline_trace_step{k}.json`` (open it
in https://ui.perfetto.dev) and ``pipeline_timeline_step{k}.png``; ``--png`` also copies the
picture to the given path.
"""

from __future__ import annotations

import argparse
import shutil

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pp
from lightning_pp import PipelineMonitor


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Regressor(L.LightningModule):
    def __init__(self, hidden: int, num_blocks: int):
        super().__init__()
        self.embed = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(num_blocks))
        self.head = nn.Linear(hidden, hidden)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.pipeline_layers():
            x = layer(x)
        return self.pipeline_loss(x, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "interleaved", "combined_1f1b", "gpipe"])
    parser.add_argument("--vp", type=int, default=1, help="virtual stages per rank")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trace-step", type=int, default=19, help="batch whose trace and picture are written")
    parser.add_argument("--png", default=None, help="also copy the picture here")
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(256 * 10, args.hidden)
    data = DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=256)
    monitor = PipelineMonitor(every_n_steps=10, trace_step=args.trace_step)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_pp.PipelineStrategy(
            pipeline_parallel_size=2, virtual_pipeline_size=args.vp, num_microbatches=args.microbatches,
            schedule=args.schedule,
        ),
        max_steps=args.steps,
        callbacks=[monitor],
        logger=CSVLogger("lightning_logs", name=""),
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # every pipeline stage sees the same batch
    )
    trainer.fit(Regressor(args.hidden, args.blocks), data)
    if trainer.is_global_zero:
        print(monitor.last_stats.summary())
        for path in monitor.written:
            print(f"wrote {path}")
        pngs = [p for p in monitor.written if p.suffix == ".png"]
        if args.png and pngs:
            shutil.copyfile(pngs[0], args.png)
            print(f"copied the picture to {args.png}")


if __name__ == "__main__":
    main()
