"""Soak (excluded by default; run with ``pytest -m soak``): 500 Trainer steps, interleaved pp=2 x vp=2,
stopped and resumed from the latest checkpoint every 100 steps in fresh processes, must follow the
uninterrupted run's trajectory bit for bit (loss of every step, final parameters)."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from distributed import run_distributed
from lightning_models import PipeRegressor, regression_data
from lightning_pp.runtime import executor_of

TOTAL_STEPS = 500
SEGMENT = 100
BATCHES_PER_EPOCH = 20  # a segment is exactly 5 epochs, so every checkpoint ends an epoch
TRAINER = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)


class SoakRegressor(PipeRegressor):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=70, gamma=0.7)  # state crosses resumes
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


def _data():
    return DataLoader(regression_data(n=8 * BATCHES_PER_EPOCH), batch_size=8, shuffle=False)


def _train(rank, world, directory, max_steps, resume):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model, losses = SoakRegressor(), Losses()
    callbacks = [losses]
    if directory is not None:
        # Saved at the end of the last batch of an epoch. (Not with every_n_epochs: without a
        # validation loop that saves in on_train_epoch_end, and plain Lightning, one device, then
        # resumes by replaying the epoch's first batch once more: measured, not specific to pipelines.)
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=SEGMENT,
                                         save_top_k=-1, save_last=True, filename="{step}"))
    trainer = L.Trainer(devices=world, max_steps=max_steps, callbacks=callbacks,
                        enable_checkpointing=directory is not None,
                        strategy=PipelineStrategy(pipeline_parallel_size=2, virtual_pipeline_size=2,
                                                  num_microbatches=4, schedule="interleaved"),
                        **TRAINER)
    ckpt_path = str(Path(directory) / "last.ckpt") if resume else None
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    names = executor_of(model).partition.parameter_names
    return trainer.global_step, losses.values, {names[id(p)]: p.detach().clone() for p in model.parameters()}


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_500_steps_resumed_every_100_follow_the_uninterrupted_run(tmp_path):
    uninterrupted = run_distributed(_train, 2, None, TOTAL_STEPS, False, timeout=1200)
    segments = []
    for end in range(SEGMENT, TOTAL_STEPS + 1, SEGMENT):
        segments.append(run_distributed(_train, 2, str(tmp_path), end, end > SEGMENT, timeout=600))
    for rank in range(2):
        steps, full_losses, full_params = uninterrupted[rank]
        assert steps == TOTAL_STEPS and len(full_losses) == TOTAL_STEPS
        resumed_losses = []
        for index, segment in enumerate(segments):
            step, losses, _ = segment[rank]
            assert step == SEGMENT * (index + 1)
            resumed_losses += losses
        assert resumed_losses == full_losses, (
            f"rank {rank}: first divergence at step "
            f"{next(i for i, (a, b) in enumerate(zip(resumed_losses, full_losses)) if a != b)}")
        for name, value in segments[-1][rank][2].items():
            assert torch.equal(value, full_params[name]), f"rank {rank}: {name}"
    assert len(set(uninterrupted[0][1])) > TOTAL_STEPS // 2  # the loss really moves throughout
