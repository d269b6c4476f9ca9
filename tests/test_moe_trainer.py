"""Trainer.fit of an MoE model with pipeline x expert parallelism and combined 1F1B equals the
same fit on one device (experts unsharded)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from distributed import run_distributed
from moe_models import TinyMoELM
from lightning_pp.runtime import executor_of

TRAINER = dict(accelerator="cpu", max_steps=3, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               use_distributed_sampler=False, gradient_clip_val=0.5)


class MoEModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(21)
        self.net = TinyMoELM(blocks=6, aux=0.0)

    def pipeline_layers(self):
        return self.net.pipeline_layers()

    def pipeline_loss(self, output, batch):
        return self.net.pipeline_loss(output, batch)

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self.net(batch[0]), batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(batch, dp=1, dp_rank=0, n=48, seq=6):
    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, 13, (n, seq), generator=g), torch.randint(0, 13, (n, seq), generator=g)
    if dp > 1:
        rows = [i for s in range(0, n, batch * dp) for i in range(s + dp_rank * batch, s + (dp_rank + 1) * batch)]
        x, y = x[rows], y[rows]
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def _fit(rank, world):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    model = MoEModule()
    strategy = PipelineStrategy(pipeline_parallel_size=2, expert_parallel_size=2, virtual_pipeline_size=2,
                                schedule="combined_1f1b", num_microbatches=4)
    trainer = L.Trainer(devices=world, strategy=strategy, **TRAINER)
    dp = world // 2
    trainer.fit(model, _data(8, dp, (rank % dp)))
    names = executor_of(model).partition.parameter_names
    return {names[id(p)]: p.detach().clone() for p in model.parameters()}, float(trainer.callback_metrics["train_loss_step"])


@pytest.mark.timeout(300)
def test_moe_fit_pp2_ep2_combined_equals_single_device():
    ref = MoEModule()
    trainer = L.Trainer(devices=1, **TRAINER)
    trainer.fit(ref, _data(16))
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    ref_loss = float(trainer.callback_metrics["train_loss"]) if "train_loss" in trainer.callback_metrics else None
    seen = set()
    for params, last_loss in run_distributed(_fit, 4, timeout=260):
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-6, atol=1e-9, msg=name)
            seen.add(name)
        assert last_loss > 0 and (ref_loss is None or last_loss == pytest.approx(ref_loss, rel=1e-6))
    assert seen == set(ref_params)


def _fit_dualpipev_default_sampler(rank, world):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    model = MoEModule()
    strategy = PipelineStrategy(pipeline_parallel_size=2, expert_parallel_size=2, virtual_pipeline_size=2,
                                schedule="dualpipev", num_microbatches=4)
    # The user's own loader over the whole set; Lightning's default distributed sampler shards it
    # over the two data-parallel replicas (and shuffles it with seed 0).
    trainer = L.Trainer(devices=world, strategy=strategy, **dict(TRAINER, use_distributed_sampler=True))
    trainer.fit(model, _data(8))
    names = executor_of(model).partition.parameter_names
    return {names[id(p)]: p.detach().clone() for p in model.parameters()}


@pytest.mark.timeout(300)
def test_moe_fit_dualpipev_on_lightnings_default_sampler_equals_single_device():
    # DualPipeV (fused F&B steps run node by node through the MoE chunks' schedule plans, weight
    # gradients deferred to W inside them), pp 2 x ep 2 (dp 2), Lightning's distributed sampler on.
    # The reference, one device, takes each step the two replicas' batches together, in the order
    # torch's DistributedSampler gives them.
    from torch.utils.data import DistributedSampler

    dataset = _data(8).dataset
    shards = [list(DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]
    order = [i for k in range(0, len(shards[0]), 8) for shard in shards for i in shard[k:k + 8]]
    ref = MoEModule()
    L.Trainer(devices=1, **TRAINER).fit(ref, DataLoader(torch.utils.data.Subset(dataset, order), batch_size=16))
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    seen = set()
    for params in run_distributed(_fit_dualpipev_default_sampler, 4, timeout=260):
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-6, atol=1e-9, msg=name)
            seen.add(name)
    assert seen == set(ref_params)


# -- checkpoints re-shard across expert-parallel (and pipeline) sizes ---------------------------------
RESUME = dict(TRAINER, max_steps=6, enable_checkpointing=True)


def _dp(world, pp):
    return world // pp


def _fit_with_checkpoint(rank, world, ckpt_dir, pp, ep, ckpt_path=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(5 if ckpt_path is None else 6)  # a resumed run's weights must come from the checkpoint
    model = MoEModule()
    strategy = PipelineStrategy(pipeline_parallel_size=pp, expert_parallel_size=ep, virtual_pipeline_size=2,
                                schedule="combined_1f1b", num_microbatches=4)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1)]
    trainer = L.Trainer(devices=world, strategy=strategy, callbacks=callbacks if ckpt_path is None else [],
                        default_root_dir=ckpt_dir, **RESUME)
    dp = _dp(world, pp)
    trainer.fit(model, _data(16 // dp, dp, rank % dp), ckpt_path=ckpt_path)
    names = executor_of(model).partition.parameter_names
    return {names[id(p)]: p.detach().clone() for p in model.parameters()}


def _merged(per_rank):
    return {name: value for params in per_rank for name, value in params.items()}


@pytest.mark.timeout(300)
def test_moe_checkpoint_resumes_at_other_expert_and_pipeline_sizes(tmp_path):
    # pp2 x ep2 (4 processes) trains 6 steps (two epochs), checkpointing after step 3. Resuming
    # that checkpoint at pp1 x ep2 and at pp2 x ep1 (experts re-sharded: each rank now holds all
    # four) must end at the uninterrupted run's weights: model and AdamW state re-sharded alike.
    ckpt = tmp_path / "ckpts"
    full = _merged(run_distributed(_fit_with_checkpoint, 4, str(ckpt), 2, 2, timeout=200))
    assert (ckpt / "step=3.ckpt").is_dir()
    for pp, ep in ((1, 2), (2, 1)):
        resumed = _merged(run_distributed(_fit_with_checkpoint, 2, str(tmp_path / f"r{pp}{ep}"), pp, ep,
                                          str(ckpt / "step=3.ckpt"), timeout=200))
        assert set(resumed) == set(full)
        for name, value in resumed.items():
            torch.testing.assert_close(value, full[name], rtol=1e-9, atol=1e-12, msg=f"pp={pp} ep={ep}: {name}")


# -- Fabric: the same MoE model, pp2 x ep2 combined 1F1B, a hand-written loop -------------------------
def _fabric_moe(rank, world):
    from lightning_pp import FabricPipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    strategy = FabricPipelineStrategy(pipeline_parallel_size=2, expert_parallel_size=2, schedule="combined_1f1b",
                                      num_microbatches=4)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="64-true")
    fabric.launch()
    model = fabric.setup_module(MoEModule())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for x, y in _data(8, 2, rank % 2):
        opt.zero_grad()
        losses.append(float(fabric.strategy.pipeline_step(model, (x, y))))
        fabric.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
    names = executor_of(model).partition.parameter_names
    return losses, {names[id(p)]: p.detach().clone() for p in model.parameters()}


@pytest.mark.timeout(300)
def test_fabric_moe_pp2_ep2_combined_equals_single_device_loop():
    ref = MoEModule().double()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, y in _data(16):
        opt.zero_grad()
        loss = ref.pipeline_loss(ref.net(x), (x, y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_losses.append(float(loss))
    seen = set()
    for losses, params in run_distributed(_fabric_moe, 4, timeout=260):
        assert losses == pytest.approx(ref_losses, rel=1e-9)
        for name, value in params.items():
            torch.testing.assert_close(value, dict(ref.named_parameters())[name].detach(), rtol=1e-6, atol=1e-9, msg=name)
            seen.add(name)
    assert seen == {n for n, _ in ref.named_parameters()}
