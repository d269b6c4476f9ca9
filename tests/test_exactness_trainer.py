"""The Trainer as users write for it, against the same Trainer on one device: Lightning's defaults
(``use_distributed_sampler``, ``drop_last=False``), a model kept where the user keeps it
(``self.model``) with an adapter made on the fly, a fully frozen stage, ``training_step``,
``validation_step`` and ``predict_step`` overridden, metrics and ``train_loss`` logged in
``pipeline_loss``, ``EarlyStopping`` on a metric logged there, and a Dataset whose randomness
differs between ranks."""

from __future__ import annotations

import os
import random
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from distributed import DistributedFailure, run_distributed
from models import Block
from lightning_pp.runtime import executor_of


class Backbone(nn.Module):
    """A model the user already has."""

    def __init__(self, dim_in: int = 5, hidden: int = 8, dim_out: int = 3, blocks: int = 4, fused_head: bool = False):
        super().__init__()
        self.embed = nn.Linear(dim_in, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        if fused_head:  # norm and head in one module of their own
            self.norm_head = NormHead(nn.LayerNorm(hidden), nn.Linear(hidden, dim_out))
        else:
            self.norm = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, dim_out)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm_head(x) if hasattr(self, "norm_head") else self.head(self.norm(x))


class NormHead(nn.Module):
    """An adapter over two modules of the backbone, built on the fly by ``pipeline_layers``."""

    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h):
        return self.head(self.norm(h))


class UserRegressor(L.LightningModule):
    """``adapter``: ``"on_the_fly"`` (made by ``pipeline_layers``), ``"registered"`` (an attribute
    made in ``__init__``, so the backbone's norm and head are reachable under two names), or
    ``"fused"`` (no adapter: the backbone's own norm-and-head module is the last layer)."""

    def __init__(self, frozen_blocks: tuple = (), lr: float = 0.02, adapter: str = "on_the_fly",
                 log_train_loss: bool = True):
        super().__init__()
        self.model = Backbone(fused_head=adapter == "fused")
        for i in frozen_blocks:
            (self.model.embed if i == "embed" else self.model.blocks[i]).requires_grad_(False)
        self.lr = lr
        self.adapter = NormHead(self.model.norm, self.model.head) if adapter == "registered" else None
        self.log_train_loss = log_train_loss

    # -- the pipeline protocol: layers that live inside self.model ------------------------------
    def pipeline_layers(self):
        if hasattr(self.model, "norm_head"):
            head = self.model.norm_head
        else:
            head = self.adapter if self.adapter is not None else NormHead(self.model.norm, self.model.head)
        return [self.model.embed, *self.model.blocks, head]

    def pipeline_loss(self, output, batch):
        loss = F.mse_loss(output, batch[1])
        if self.training:
            if self.log_train_loss:
                self.log("train_loss", loss, prog_bar=True)  # the name the strategy logs by itself too
        else:
            self.log("val_acc", (output - batch[1]).abs().lt(1.0).double().mean(), sync_dist=True)
        return loss

    def pipeline_predict(self, output, batch):
        return output.argmax(-1)

    # -- the single-device code, unchanged ----------------------------------------------------
    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def validation_step(self, batch, batch_idx):
        self.pipeline_loss(self(batch[0]), batch)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.1)


class Regression(Dataset):
    """``augment``: None; ``"unseeded"``: noise from Python's global ``random`` (differs between
    processes unless seeded); ``"per_rank"``: noise seeded by the process's RANK and the index."""

    def __init__(self, n: int = 22, augment=None):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 5, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, 3, generator=g, dtype=torch.float64) + self.x[:, :3]
        self.augment = augment

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if self.augment == "unseeded":
            x = x + random.gauss(0.0, 0.5)
        elif self.augment == "per_rank":
            x = x + random.Random(int(os.environ.get("RANK", "0")) * 100_003 + i).gauss(0.0, 0.5)
        return x, self.y[i]


def loader(batch_size=4, n=22, augment=None):
    return DataLoader(Regression(n, augment), batch_size=batch_size)  # drop_last=False: a short last batch


def one_device_train_loader(batch_size=4, n=22, augment=None):
    """One device's view of the same training data: Lightning's distributed sampler (which every
    distributed strategy, DDP's like this one, puts in place) shuffles training data with seed 0,
    so one device gets that order by using the same sampler."""
    data = Regression(n, augment)
    return DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))


TRAINER = dict(accelerator="cpu", max_epochs=2, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _callbacks(model_kwargs):
    # EarlyStopping on a metric logged in pipeline_loss (the full scenario only)
    full = model_kwargs.get("log_train_loss", True)
    return [L.pytorch.callbacks.EarlyStopping("val_acc", mode="max", patience=50)] if full else []


def _sizes(model_kwargs):
    """Samples for fit, validation and prediction: with short last batches in the full scenario."""
    return (22, 22, 10) if model_kwargs.get("log_train_loss", True) else (24, 24, 12)


def _one_device(model_kwargs, augment=None):
    torch.manual_seed(0)
    model = UserRegressor(**model_kwargs)
    trainer = L.Trainer(devices=1, callbacks=_callbacks(model_kwargs), **TRAINER)
    fit_n, val_n, predict_n = _sizes(model_kwargs)
    trainer.fit(model, one_device_train_loader(n=fit_n, augment=augment), loader(n=val_n))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    preds = trainer.predict(model, loader(n=predict_n))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics, torch.cat(preds)


def _pipelined(rank, world, model_kwargs, strategy_kwargs, augment, checkpoint_dir):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = UserRegressor(**model_kwargs)
    trainer = L.Trainer(devices=world, strategy=PipelineStrategy(num_microbatches=4, **strategy_kwargs),
                        callbacks=_callbacks(model_kwargs), **TRAINER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_n, val_n, predict_n = _sizes(model_kwargs)
        trainer.fit(model, loader(n=fit_n, augment=augment), loader(n=val_n))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if checkpoint_dir:
            trainer.save_checkpoint(checkpoint_dir)
        preds = torch.cat(trainer.predict(model, loader(n=predict_n)))
    names = executor_of(model).partition.parameter_names
    params = {names[id(p)]: p.detach().clone() for p in model.parameters() if id(p) in names}
    held = {n for n, _ in model.named_parameters()}
    return params, held, metrics, preds, [str(w.message) for w in caught], trainer.global_step


def _compare(reference, per_rank):
    ref_params, ref_metrics, ref_preds = reference
    seen = set()
    for rank, (params, _held, metrics, preds, _, steps) in enumerate(per_rank):
        assert steps == 2 * 6  # two epochs of 22 (or 24) samples in batches of 4 (a short last batch ran)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-9, atol=1e-12, msg=f"{name} on rank {rank}")
            seen.add(name)
        for name in ("val_acc", "train_loss"):  # train_loss: where the user logs it
            if name in ref_metrics:
                assert metrics[name] == pytest.approx(ref_metrics[name], rel=1e-9), name
        assert torch.equal(preds, ref_preds)  # every sample, post-processed by the user's predict_step
    assert seen == set(ref_params)
    # each rank holds only its own stage's parameters (the cut reached into self.model)
    held = [{n for n in r[1] if not n.startswith("_lpp")} for r in per_rank]
    assert held[0] | held[1] == set(ref_params) and not held[0] & held[1], held


@pytest.fixture(scope="module")
def user_fit(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "user.ckpt")
    reference = _one_device({})
    per_rank = run_distributed(_pipelined, 2, {}, {}, None, ckpt, timeout=200)
    return reference, per_rank, ckpt


@pytest.mark.timeout(240)
def test_model_kept_in_self_model_with_an_adapter_trains_as_one_device(user_fit):
    reference, per_rank, _ = user_fit
    _compare(reference, per_rank)


@pytest.mark.timeout(240)
def test_checkpoint_holds_every_trained_weight_once(user_fit):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reference, _, ckpt = user_fit
    out = ckpt + ".pt"
    dcp_to_torch_save(ckpt, out)
    saved = torch.load(out, weights_only=False)["model"]
    assert set(saved) == set(reference[0]) | {k for k in saved if not k.startswith("model.")}
    for name, value in reference[0].items():
        torch.testing.assert_close(saved[name], value, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.timeout(240)
def test_only_training_step_is_named_as_not_called(user_fit):
    _, per_rank, _ = user_fit
    messages = per_rank[0][4]
    # validation_step and predict_step ran as written (their self(x) through the pipeline)
    assert [m.split(" is not called")[0] for m in messages if "is not called" in m] == ["UserRegressor.training_step"]
    # the strategy's own loss logging neither clashed with the user's train_loss nor asked for sync_dist
    assert not [m for m in messages if "sync_dist=True" in m], messages
    # the user's validation_step logs val_acc and no val_loss, as on one device
    assert "val_acc" in per_rank[0][2] and "train_loss" in per_rank[0][2] and "val_loss" not in per_rank[0][2]


# Each of the next runs changes one thing from a configuration the pipeline always handled (layers
# that are the backbone's own modules, no train_loss logged by the user, no short batch), so it
# fails on older code for its own reason only.
PLAIN = dict(adapter="fused", log_train_loss=False)


@pytest.mark.timeout(240)
def test_fully_frozen_stage_trains_as_one_device():
    frozen = dict(PLAIN, frozen_blocks=("embed", 0, 1))  # stage 0 of 2 holds exactly these layers
    reference = _one_device(frozen)
    per_rank = run_distributed(_pipelined, 2, frozen, {}, None, None, timeout=200)
    _compare(reference, per_rank)


@pytest.mark.timeout(240)
def test_registered_adapter_into_self_model_leaves_no_stale_copies():
    registered = dict(PLAIN, adapter="registered")
    reference = _one_device(registered)
    per_rank = run_distributed(_pipelined, 2, registered, {}, None, None, timeout=200)
    _compare(reference, per_rank)


@pytest.mark.timeout(240)
def test_stages_given_different_batches_fail_naming_the_cause():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_pipelined, 2, PLAIN, {}, "unseeded", None, timeout=200)
    assert set(info.value.errors) == {0, 1}
    for message in info.value.errors.values():
        assert "different batches" in message and "pipeline rank(s) [1]" in message, message
        assert "broadcast_batches=True" in message


@pytest.mark.timeout(240)
def test_broadcast_batches_trains_on_pipeline_rank_zeros_batch():
    reference = _one_device(PLAIN, augment="per_rank")  # one device: RANK 0's augmentation
    per_rank = run_distributed(_pipelined, 2, PLAIN, {"broadcast_batches": True}, "per_rank", None, timeout=200)
    _compare(reference, per_rank)
