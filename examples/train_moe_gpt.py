"""Train a small byte-level MoE GPT with pipeline x expert parallelism and combined 1F1B.

The corpus is the source of Python's own standard library, read from the running interpreter
(nothing is downloaded), split into train/validation by file name. Defaults: CPU, 4 processes,
pipeline 2 x expert 2, 2 virtual stages per rank, combined 1F1B — a few minutes on 2 cores.

    python examples/train_moe_gpt.py                         # the defaults above
    python examples/train_moe_gpt.py --max-steps 20 --devices 2 --pp 2 --ep 1 --schedule interleaved
    python examples/train_moe_gpt.py --resume out/checkpoints/last.ckpt
    torchrun --nproc-per-node 8 examples/train_moe_gpt.py --accelerator gpu --devices 8 --pp 2 --ep 4

It prints the unigram baseline and the validation loss, logs to CSV (and TensorBoard if
installed), saves sharded checkpoints, prints the pipeline summary, writes the timeline picture,
and finally generates text through the pipeline.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sysconfig
import time
import zlib
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_pp
from lightning_pp.moe import MoEBlock

VOCAB = 256  # bytes


# -- data ------------------------------------------------------------------------------------
def stdlib_bytes(part: int) -> bytes:
    """Half ``part`` (0 or 1) of the standard library's top-level sources, split by file name
    (the litgpt and Hugging Face fine-tuning examples' corpora)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return b"\n".join(p.read_bytes() for p in files if zlib.crc32(p.name.encode()) % 2 == part)[:3_000_000]


def stdlib_corpus(max_bytes: int = 4_000_000) -> tuple[bytes, bytes]:
    """(train, val) bytes of the standard library's top-level .py files; every 20th file (by a
    hash of its name) is validation. Deterministic on every machine with the same Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, total = [], [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        (val if zlib.crc32(path.name.encode()) % 20 == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(train), b"\n".join(val)


class Windows(Dataset):
    """``length`` windows of ``context + 1`` bytes at seeded pseudo-random offsets."""

    def __init__(self, data: bytes, context: int, length: int, seed: int):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.context, self.length, self.seed = context, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        start = random.Random(self.seed * 1_000_003 + index).randrange(len(self.data) - self.context - 1)
        chunk = self.data[start:start + self.context + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibBytes(L.LightningDataModule):
    def __init__(self, context: int, batch_size: int, train_windows: int, val_windows: int):
        super().__init__()
        self.context, self.batch_size = context, batch_size
        self.train_bytes, self.val_bytes = stdlib_corpus()
        self.train_set = Windows(self.train_bytes, context, train_windows, seed=1)
        self.val_set = Windows(self.val_bytes, context, val_windows, seed=2)

    def unigram_baseline(self) -> float:
        """Cross entropy (nats/byte) of the validation bytes under the training byte frequencies."""
        counts = torch.bincount(torch.frombuffer(bytearray(self.train_bytes), dtype=torch.uint8).long(), minlength=VOCAB)
        probs = (counts.double() + 1) / (counts.sum() + VOCAB)
        val = torch.frombuffer(bytearray(self.val_bytes), dtype=torch.uint8).long()
        return float(-probs.log()[val].mean())

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)


# -- model -----------------------------------------------------------------------------------
class Embedding(nn.Module):
    def __init__(self, hidden: int, context: int):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, hidden)
        self.positions = nn.Embedding(context, hidden)

    def forward(self, idx):
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, VOCAB)

    def forward(self, x):
        return self.out(self.norm(x))


class MoEGPT(L.LightningModule):
    """Byte-level GPT whose blocks have a mixture-of-experts MLP."""

    def __init__(self, hidden: int = 64, heads: int = 4, blocks: int = 6, experts: int = 4, top_k: int = 2,
                 ffn_hidden: int = 128, context: int = 64, lr: float = 3e-3, warmup_steps: int = 20,
                 max_steps: int = 400, aux_loss_coeff: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.embed = Embedding(hidden, context)
        self.blocks = nn.ModuleList(
            MoEBlock(hidden, heads, ffn_hidden, experts, top_k, aux_loss_coeff=aux_loss_coeff) for _ in range(blocks))
        self.head = Head(hidden)

    # The three pipeline methods.
    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, logits, batch):
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    # Unchanged single-device code.
    def forward(self, idx):
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self(batch[0]), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01, betas=(0.9, 0.95))
        warmup, total = self.hparams.warmup_steps, max(self.hparams.max_steps, 1)

        def schedule(step):
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule),
                                                   "interval": "step"}}


# -- generation through the pipeline ----------------------------------------------------------
@torch.no_grad()
def generate(trainer: L.Trainer, model: MoEGPT, prompts: list[bytes], new_bytes: int, temperature: float = 0.8) -> list[bytes]:
    """Sample ``new_bytes`` bytes after each prompt. Every rank runs this loop: each step is one
    forward-only pass through the pipeline (``strategy.pipeline_predict``), and every rank samples
    with the same seeded generator, so all ranks agree on the text."""
    context = model.hparams.context
    width = min(len(p) for p in prompts)
    tokens = torch.tensor([list(p[-width:]) for p in prompts], dtype=torch.long, device=model.device)
    g = torch.Generator().manual_seed(0)
    model.eval()
    for _ in range(new_bytes):
        window = tokens[:, -context:]
        logits = trainer.strategy.pipeline_predict((window,))[:, -1].float().cpu()
        next_byte = torch.multinomial((logits / temperature).softmax(-1), 1, generator=g)
        tokens = torch.cat([tokens, next_byte.to(tokens.device)], dim=1)
    return [bytes(row.tolist()) for row in tokens.cpu()]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size")
    p.add_argument("--vp", type=int, default=2, help="virtual pipeline stages per rank")
    p.add_argument("--schedule", default="combined_1f1b", choices=["1f1b", "interleaved", "combined_1f1b", "gpipe"])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel rank and step")
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--out", default="out", help="logs, checkpoints and pictures go here")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    p.add_argument("--generate", type=int, default=96, help="bytes to generate at the end (0: skip)")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile every pipeline layer (docs/compile.md)")
    args = p.parse_args(argv)

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.devices)))
    L.seed_everything(0, workers=True, verbose=False)
    out = Path(args.out)
    data = StdlibBytes(args.context, args.batch_size, train_windows=args.max_steps * args.batch_size * 4,
                       val_windows=4 * args.batch_size)
    model = MoEGPT(hidden=args.hidden, blocks=args.blocks, experts=args.experts, context=args.context,
                   max_steps=args.max_steps)
    strategy = lightning_pp.PipelineStrategy(
        pipeline_parallel_size=args.pp, expert_parallel_size=args.ep, virtual_pipeline_size=args.vp,
        num_microbatches=args.microbatches, schedule=args.schedule, compile=args.compile)
    loggers = [CSVLogger(out, name="logs")]
    try:
        from lightning.pytorch.loggers import TensorBoardLogger

        import tensorboard  # noqa: F401

        loggers.append(TensorBoardLogger(out, name="tb"))
    except ImportError:
        pass
    callbacks = [ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, every_n_train_steps=args.val_every)]
    try:
        from lightning_pp.callbacks import PipelineMonitor

        monitor = PipelineMonitor(every_n_steps=max(1, args.val_every // 2))
        callbacks.append(monitor)
    except ImportError:
        monitor = None
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                        precision=args.precision, max_steps=args.max_steps, val_check_interval=args.val_every,
                        limit_val_batches=4, check_val_every_n_epoch=None, logger=loggers, callbacks=callbacks,
                        log_every_n_steps=5, enable_progress_bar=not args.no_progress_bar, enable_model_summary=False)
    baseline = data.unigram_baseline()
    start = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    seconds = time.perf_counter() - start
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    steps = trainer.global_step
    dp = args.devices * args.num_nodes // args.pp
    tokens_per_s = steps * args.batch_size * dp * args.context / seconds
    summary = {"unigram_baseline": baseline, "val_loss": val, "steps": steps, "seconds": seconds,
               "tokens_per_s": tokens_per_s}
    stats = monitor.last_stats if monitor is not None else None
    if stats is not None:  # the pipeline summary of the last analysed step
        summary.update(bubble_fraction=stats.bubble_fraction, simulated_bubble_fraction=stats.ideal_bubble)
        if stats.a2a_hidden is not None:
            summary["a2a_hidden_fraction"] = stats.a2a_hidden
    samples = generate(trainer, model, [b"def ", b"import", b"class ", b"    ret"][: args.microbatches] or [b"def "],
                       args.generate) if args.generate else []
    log_dir = trainer.log_dir  # collective: every rank asks
    if trainer.is_global_zero:
        print(f"\nunigram baseline: {baseline:.3f} nats/byte   validation loss: {val:.3f} nats/byte "
              f"({'below' if val < baseline else 'NOT below'} the baseline)")
        print(f"{steps} steps in {seconds:.1f}s, {tokens_per_s:,.0f} tokens/s")
        for key in ("bubble_fraction", "simulated_bubble_fraction", "a2a_hidden_fraction"):
            if key in summary:
                print(f"{key}: {summary[key]:.3f}")
        pictures = sorted(Path(log_dir or out).rglob("pipeline_timeline_step*.png"))
        if pictures:
            print(f"timeline picture: {pictures[-1]}")
        print(f"checkpoints: {out / 'checkpoints'}   logs: {loggers[0].log_dir}")
        for text in samples:
            print("---\n" + text.decode("utf-8", errors="replace"))
    return summary


if __name__ == "__main__":
    main()
