"""A training job as users launch it, for the preemption tests (``test_preemption.py``): pp=2
through the Trainer, ``ModelCheckpoint`` every 5 steps with ``save_last``, one batch per epoch (so
every checkpoint, and every step boundary, ends an epoch: Lightning resumes a plain DataLoader
exactly only there).

``python preemption_job.py OUT CASE`` under Lightning's own launcher (it starts rank 1), or one
process per rank with SLURM's variables (``CASE=slurm``: ``SLURMEnvironment(auto_requeue=True)``).
Every rank writes ``OUT/rank<r>.json`` (its pid and the step it is about to run) at the start of
each batch, and at the end of a finished fit ``OUT/params<r>.pt``. With ``CASE=in_save`` rank 1 waits
inside the save of step ``SAVE_STEP`` until it has received a signal (the test sends it once it sees
``OUT/saving``), so the signal lands in the middle of a checkpoint save."""

from __future__ import annotations

import json
import os
import sys
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pp import PipelineStrategy

MAX_STEPS = 24
EVERY = 5
SAVE_STEP = 10


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 16), *(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)),
                                     nn.Linear(16, 3)])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def forward(self, x):  # the one-device code, unchanged
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)  # its state crosses the resume
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 5, generator=g)
    y = torch.randn(64, 3, generator=g) + x[:, :3]
    # shuffle=True: Lightning's distributed sampler draws each epoch's (one) batch from seed and epoch
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


class Start(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        _write(os.path.join(self.out, f"start{trainer.global_rank}.json"), json.dumps(trainer.global_step))


def _write(path: str, text: str) -> None:
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)


class Progress(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _write(os.path.join(self.out, f"rank{trainer.global_rank}.json"),
               json.dumps({"pid": os.getpid(), "step": trainer.global_step}))


class SignalledInSave(ModelCheckpoint):
    """Rank 1 waits, inside the save of step ``SAVE_STEP``, for the signal the test sends."""

    def __init__(self, out: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def _save_checkpoint(self, trainer, filepath):
        if trainer.global_rank == 1 and trainer.global_step == SAVE_STEP:
            _write(os.path.join(self.out, "saving"), str(os.getpid()))
            deadline = time.monotonic() + 30
            while trainer._signal_connector.pending_stop is None and time.monotonic() < deadline:
                time.sleep(0.01)
        super()._save_checkpoint(trainer, filepath)


def trainer_for(out: str, case: str, max_steps: int = MAX_STEPS, callbacks=(), checkpoints: bool = True,
                **strategy) -> L.Trainer:
    callbacks = list(callbacks)
    if checkpoints:
        kind = SignalledInSave if case == "in_save" else ModelCheckpoint
        extra = {"out": out} if case == "in_save" else {}
        callbacks.append(kind(dirpath=os.path.join(out, "checkpoints"), every_n_train_steps=EVERY, save_last=True,
                              **extra))
    plugins = [SLURMEnvironment(auto_requeue=True)] if case == "slurm" else []
    return L.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, limit_train_batches=1,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=checkpoints, default_root_dir=out, callbacks=callbacks, plugins=plugins,
                     strategy=PipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, **strategy))


def parameters(model: nn.Module) -> dict:
    from lightning_pp.runtime import executor_of

    names = executor_of(model).partition.parameter_names
    return {names[id(p)]: p.detach().clone() for p in model.parameters()}


def main(out: str, case: str) -> None:
    torch.manual_seed(0)
    model = Regressor()
    trainer = trainer_for(out, case, callbacks=[Progress(out), Start(out)])
    trainer.fit(model, data())  # CASE=slurm: a requeued run resumes from hpc_ckpt_<n>.ckpt by itself
    torch.save(parameters(model), os.path.join(out, f"params{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
