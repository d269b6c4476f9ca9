"""Sharded checkpoints: exact resume, re-sharding across pipeline sizes, consolidation, top-k."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from distributed import run_distributed
from lightning_models import PipeRegressor, loader
from lightning_pp.runtime import find_executor

TRAINER = dict(accelerator="cpu", precision="64-true", logger=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
               limit_val_batches=2)


class Record(L.Callback):
    def __init__(self):
        self.losses, self.epoch0 = [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.epoch0 = _params(pl_module)


def _params(module):
    executor = find_executor(module)
    if executor is None:
        return {n: p.detach().clone() for n, p in module.named_parameters()}
    names = executor.partition.parameter_names
    return {names[id(p)]: p.detach().clone() for p in module.parameters()}


def _strategy(pp):
    from lightning_pp import PipelineStrategy

    return PipelineStrategy(pipeline_parallel_size=pp, num_microbatches=4)


def _train_and_resume(rank, world, ckpt_dir):
    os.environ["LOCAL_RANK"] = str(rank)
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    model, rec = PipeRegressor(), Record()
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1, save_last=True)
    trainer = L.Trainer(devices=world, strategy=_strategy(world), max_epochs=2, callbacks=[rec, checkpoints], **TRAINER)
    trainer.fit(model, loader(8), loader(8))
    uninterrupted = (rec.losses, _params(model))

    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    model2, rec2 = PipeRegressor(), Record()
    trainer2 = L.Trainer(devices=world, strategy=_strategy(world), max_epochs=2, callbacks=[rec2],
                         default_root_dir=str(Path(ckpt_dir) / ".." / "resumed"), **TRAINER)
    trainer2.fit(model2, loader(8), loader(8), ckpt_path=str(Path(ckpt_dir) / "epoch=0.ckpt"))
    return uninterrupted, rec.epoch0, (rec2.losses, _params(model2)), trainer2.global_step


def _resume_at(rank, world, ckpt_path):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(2)
    model, rec = PipeRegressor(), Record()
    trainer = L.Trainer(devices=world, strategy=_strategy(world), max_epochs=2, callbacks=[rec], enable_checkpointing=False,
                        **TRAINER)
    trainer.fit(model, loader(8), loader(8), ckpt_path=ckpt_path)
    return rec.losses, _params(model)


def _load_weights_at(rank, world, ckpt_path):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(3)
    model = PipeRegressor()
    trainer = L.Trainer(devices=world, strategy=_strategy(world), enable_checkpointing=False, **TRAINER)
    metrics = trainer.validate(model, loader(8), ckpt_path=ckpt_path, verbose=False)
    return _params(model), metrics


def _top1(rank, world, d):
    os.environ["LOCAL_RANK"] = str(rank)
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=1, every_n_epochs=1)
    L.Trainer(devices=world, strategy=_strategy(world), max_epochs=3, callbacks=[cb], **TRAINER).fit(
        PipeRegressor(), loader(8), loader(8))
    return Path(cb.best_model_path).name


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("ckpts")
    results = run_distributed(_train_and_resume, 2, str(ckpt_dir), timeout=240)
    return ckpt_dir, results


def _merge(dicts):
    out = {}
    for d in dicts:
        out.update(d)
    return out


@pytest.mark.timeout(300)
def test_resume_reproduces_the_uninterrupted_run_step_for_step(pp2_run):
    _, results = pp2_run
    for (full_losses, full_params), _, (resumed_losses, resumed_params), step in results:
        assert len(full_losses) == 12 and step == 12
        assert resumed_losses == full_losses[6:]  # bitwise: same shards, same order of operations
        for name, value in resumed_params.items():
            assert torch.equal(value, full_params[name]), name


@pytest.mark.timeout(300)
def test_model_checkpoint_directories_and_top_k(pp2_run, tmp_path):
    ckpt_dir, _ = pp2_run
    names = sorted(p.name for p in Path(ckpt_dir).iterdir() if not p.name.startswith("."))
    assert names == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    assert all((Path(ckpt_dir) / n / "meta.pt").is_file() for n in names)
    assert not [p for p in Path(ckpt_dir).iterdir() if ".tmp-" in p.name]  # atomic: no leftovers

    best = run_distributed(_top1, 2, str(tmp_path / "top1"), timeout=200)[0]
    assert [p.name for p in (tmp_path / "top1").iterdir()] == [best]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 4])
def test_pp2_checkpoint_loads_at_other_pipeline_sizes(pp2_run, world):
    ckpt_dir, results = pp2_run
    expected = _merge(r[1] for r in results)  # weights at the end of epoch 0, all stages
    loaded = run_distributed(_load_weights_at, world, str(Path(ckpt_dir) / "epoch=0.ckpt"), timeout=200)
    merged = _merge(params for params, _ in loaded)
    assert set(merged) == set(expected)
    for name, value in merged.items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.timeout(300)
def test_pp2_checkpoint_resumes_training_at_pp1(pp2_run):
    ckpt_dir, results = pp2_run
    full_losses = results[0][0][0]
    (losses, params), = run_distributed(_resume_at, 1, str(Path(ckpt_dir) / "epoch=0.ckpt"), timeout=200)
    assert losses == pytest.approx(full_losses[6:], rel=1e-9)  # optimizer state re-sharded too
    expected = _merge(r[0][1] for r in results)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-12)


@pytest.mark.timeout(300)
def test_consolidated_checkpoint_loads_on_one_device(pp2_run):
    ckpt_dir, results = pp2_run
    src = Path(ckpt_dir) / "epoch=0.ckpt"
    subprocess.run([sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(src)],
                   check=True, capture_output=True, timeout=120)
    model = PipeRegressor.load_from_checkpoint(str(src) + ".consolidated", map_location="cpu")
    expected = _merge(r[1] for r in results)
    for name, value in model.named_parameters():  # the fresh module is float32; the run was float64
        torch.testing.assert_close(value.detach(), expected[name].float(), rtol=0, atol=0, msg=name)
