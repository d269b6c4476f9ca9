"""The user's own ``validation_step``, ``test_step`` and ``predict_step``, written for one device, run
as written under the pipeline: ``self(x)`` in them is the whole model (called twice for test-time
augmentation, its output a tuple), metrics logged there (a torchmetrics ``Accuracy`` and plain
tensors) reach every rank's ``callback_metrics`` with one device's names and values,
``EarlyStopping`` on one of them stops at the same epoch, and the predictions equal one device's.
One launch also checks the papercuts of issue 32 that show in such a run: ``pipeline_loss``'s
``self.log`` gives one device's names with no ``sync_dist`` advice where nothing is to be synced,
and ``schedule="zbv"`` needs no ``virtual_pipeline_size``."""

from __future__ import annotations

import logging
import os
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distributed import run_distributed


class Head(nn.Module):
    """The classifier's last layer: the logits and the features they came from (a tuple)."""

    def __init__(self, hidden: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, h):
        h = self.norm(h)
        return self.out(h), h


class Classifier(L.LightningModule):
    def __init__(self, features: int = 6, hidden: int = 16, classes: int = 3, blocks: int = 4):
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(blocks))
        self.head = Head(hidden, classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=classes)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output, batch):
        logits, _ = output
        loss = F.cross_entropy(logits, batch[1])
        self.log("train_loss", loss)  # on one device: in training_step
        self.log("train_acc", (logits.argmax(-1) == batch[1]).double().mean(), on_epoch=True)
        return loss

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits, features = self(x)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_feature_norm", features.norm(dim=-1).mean(), reduce_fx="max")

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = (self(x)[0] + self(x.flip(-1))[0]) / 2  # test-time augmentation: two forwards
        self.log_dict({"test_acc": (logits.argmax(-1) == y).double().mean(), "test_loss": F.cross_entropy(logits, y)})

    def predict_step(self, batch, batch_idx):
        probabilities = self(batch[0])[0].softmax(-1)
        return {"label": probabilities.argmax(-1), "confidence": probabilities.max(-1).values}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    flip = torch.rand(n, generator=g) < 0.25  # label noise, so validation accuracy stops improving
    return TensorDataset(x, torch.where(flip, (y + 1) % 3, y))


# 22 validation and 10 prediction samples in batches of 8: short last batches, split unevenly
TRAIN, VAL, PREDICT = dataset(48, 1), dataset(22, 2), dataset(10, 3)
TRAINER = dict(accelerator="cpu", max_epochs=12, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _early_stopping():
    return L.pytorch.callbacks.EarlyStopping("val_acc", mode="max", patience=2)


def _run(trainer, train_loader):
    torch.manual_seed(0)
    model = Classifier()
    trainer.fit(model, train_loader, DataLoader(VAL, batch_size=8))
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    epochs = trainer.current_epoch
    validated = trainer.validate(model, DataLoader(VAL, batch_size=8), verbose=False)[0]
    tested = trainer.test(model, DataLoader(VAL, batch_size=8), verbose=False)[0]
    predicted = trainer.predict(model, DataLoader(PREDICT, batch_size=8))
    return fit_metrics, epochs, validated, tested, predicted


def _one_device():
    trainer = L.Trainer(devices=1, callbacks=[_early_stopping()], **TRAINER)
    # Lightning's distributed sampler (in place under any distributed strategy) shuffles the
    # training data with seed 0: one device reads it in the same order with the same sampler.
    train = DataLoader(TRAIN, batch_size=8, sampler=DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0))
    return _run(trainer, train)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _pipelined(rank, world):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    strategy = PipelineStrategy(schedule="zbv", num_microbatches=4)  # zbv's own two chunks per rank
    trainer = L.Trainer(devices=world, strategy=strategy, callbacks=[_early_stopping()],
                        **{**TRAINER, "enable_model_summary": True})
    printed = _Lines()
    logging.getLogger("lightning.pytorch").addHandler(printed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _run(trainer, DataLoader(TRAIN, batch_size=8, shuffle=True))
    return result, [str(w.message) for w in caught], strategy.resolved.schedule.vp, printed.lines


@pytest.mark.timeout(300)
def test_users_evaluation_methods_run_as_written_and_equal_one_device():
    ref_fit, ref_epochs, ref_validated, ref_tested, ref_predicted = _one_device()
    assert ref_epochs < TRAINER["max_epochs"]  # EarlyStopping stopped the reference early
    assert {"val_acc", "val_loss", "val_feature_norm", "train_loss", "train_acc_epoch"} <= set(ref_fit)
    whole = sum(p.numel() for p in Classifier().parameters())
    for rank, (result, messages, vp, printed) in enumerate(run_distributed(_pipelined, 2, timeout=280)):
        fit, epochs, validated, tested, predicted = result
        assert vp == 2, "zbv takes its own chunk count"
        assert epochs == ref_epochs, f"rank {rank}: EarlyStopping stopped at epoch {epochs}, one device at {ref_epochs}"
        for got, expected, what in ((fit, ref_fit, "fit"), (validated, ref_validated, "validate"),
                                    (tested, ref_tested, "test")):
            assert set(got) == set(expected), (rank, what, sorted(got), sorted(expected))
            for name, value in expected.items():
                assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (rank, what, name)
        assert len(predicted) == len(ref_predicted)
        for got, expected in zip(predicted, ref_predicted):
            assert torch.equal(got["label"], expected["label"])
            torch.testing.assert_close(got["confidence"], expected["confidence"], rtol=1e-9, atol=1e-12)
        if rank == 0:
            # the model summary (rank 0's) says it shows this rank's stage, next to the whole model's size
            (note,) = [line for line in printed if "model summary" in line]
            assert "shows this rank's pipeline stage only" in note and f"of the whole model's {whole:,}" in note, note
            # training_step alone is named as not called (pipeline_loss does its work)
            assert [m.split(" is not called")[0] for m in messages if "is not called" in m] == ["Classifier.training_step"]
        assert not [m for m in messages if "sync_dist=True" in m], messages
