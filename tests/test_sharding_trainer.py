"""Sharded stages with the Trainer and Fabric, written as users write them (Lightning's distributed
sampler on, the module's own configure_optimizers): ``data_parallel_sharding="full"`` and the
user's own ``fully_shard`` in ``configure_model`` both train a tied-embedding model at pp=2 x dp=2
as one device (float64, 1e-9) with clipping by the global norm and validation; an MoE model at
pp=2 x ep=2 x dp=2 under combined 1F1B likewise; a checkpoint saved sharded at dp=2 resumes unsharded
at dp=1 and one saved unsharded at dp=1 resumes sharded at dp=2, both equal to an uninterrupted run
(optimizer state included); bad combinations are errors naming both sides. The page is
docs/sharding.md."""

from __future__ import annotations

import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from distributed import DistributedFailure, run_distributed
from moe_models import UserMoE, user_moe_dataset
from lightning_models import BATCH, TRAINER, OneDeviceOrder, TiedLM, gathered, tokens

def one_device(model, epochs: int, replicas: list[int], clip=None, accumulate=1):
    dataset = tokens()
    L.Trainer(devices=1, max_epochs=epochs, use_distributed_sampler=False, gradient_clip_val=clip,
              accumulate_grad_batches=accumulate, **TRAINER).fit(
        model, DataLoader(dataset, batch_size=2 * BATCH, sampler=OneDeviceOrder(dataset, replicas)))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def strategy(**kwargs):
    from lightning_pp import PipelineStrategy

    return PipelineStrategy(pipeline_parallel_size=2, num_microbatches=2, **kwargs)


# -- one launch of four ranks: pp=2 x dp=2 ------------------------------------------------------
def _four(rank, world, ckpt_dir):
    os.environ["LOCAL_RANK"] = str(rank)
    out = {}
    # 1. the option, with clipping by the global norm and a validation loop
    model = TiedLM()
    trainer = L.Trainer(devices=world, max_epochs=1, strategy=strategy(data_parallel_sharding="full"),
                        gradient_clip_val=0.05, accumulate_grad_batches=2, limit_val_batches=2, **TRAINER)
    trainer.fit(model, DataLoader(tokens(), batch_size=BATCH), DataLoader(tokens(16, seed=2), batch_size=BATCH))
    out["kinds"] = sorted({type(p).__name__ for p in model.parameters()})
    out["full"] = gathered(model)
    out["val"] = float(trainer.validate(model, DataLoader(tokens(16, seed=2), batch_size=BATCH), verbose=False)[0]["val_loss"])
    # 2. the user's own fully_shard of the blocks in configure_model
    model = TiedLM(shard_blocks=True)
    L.Trainer(devices=world, max_epochs=1, strategy=strategy(), **TRAINER).fit(model, DataLoader(tokens(), batch_size=BATCH))
    out["user"] = gathered(model)
    # 3. a sharded epoch, saved; then the unsharded dp=1 checkpoint resumed sharded at dp=2
    model = TiedLM()
    trainer = L.Trainer(devices=world, max_epochs=1, strategy=strategy(data_parallel_sharding="full"), **TRAINER)
    trainer.fit(model, DataLoader(tokens(), batch_size=BATCH))
    trainer.save_checkpoint(os.path.join(ckpt_dir, "sharded_dp2"))
    model = TiedLM()
    L.Trainer(devices=world, max_epochs=2, strategy=strategy(data_parallel_sharding="full"), **TRAINER).fit(
        model, DataLoader(tokens(), batch_size=BATCH), ckpt_path=os.path.join(ckpt_dir, "whole_dp1"))
    out["resumed_sharded"] = gathered(model)
    # ... and a one-device .ckpt (model and optimizer) resumed sharded
    model = TiedLM()
    L.Trainer(devices=world, max_epochs=2, strategy=strategy(data_parallel_sharding="full"), **TRAINER).fit(
        model, DataLoader(tokens(), batch_size=BATCH), ckpt_path=os.path.join(ckpt_dir, "one_device.ckpt"))
    out["from_one_device"] = gathered(model)
    # 4. both ways at once is an error naming both
    try:
        L.Trainer(devices=world, max_steps=1, strategy=strategy(data_parallel_sharding="full"), **TRAINER).fit(
            TiedLM(shard_blocks=True), DataLoader(tokens(), batch_size=BATCH))
        out["both"] = None
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        out["both"] = f"{type(exc).__name__}: {exc}"
    return out


# -- launches of two ranks: pp=2 x dp=1 ---------------------------------------------------------
def _two_first_epoch(rank, world, ckpt_dir):
    os.environ["LOCAL_RANK"] = str(rank)
    model = TiedLM()
    trainer = L.Trainer(devices=world, max_epochs=1, strategy=strategy(data_parallel_sharding="full"), **TRAINER)
    trainer.fit(model, DataLoader(tokens(), batch_size=2 * BATCH))  # dp=1: sharding is a no-op
    trainer.save_checkpoint(os.path.join(ckpt_dir, "whole_dp1"))
    return sorted({type(p).__name__ for p in model.parameters()})


def _two_resume(rank, world, ckpt_dir):
    os.environ["LOCAL_RANK"] = str(rank)
    model = TiedLM()
    L.Trainer(devices=world, max_epochs=2, strategy=strategy(), **TRAINER).fit(
        model, DataLoader(tokens(), batch_size=2 * BATCH), ckpt_path=os.path.join(ckpt_dir, "sharded_dp2"))
    return gathered(model)


def _assert_equal(got: dict, expected: dict, what: str, rank: int, seen: set) -> None:
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-12, msg=f"{what}: {name} on rank {rank}")
        seen.add(name)


@pytest.mark.timeout(420)
def test_trainer_sharded_stages_and_resume_across_sharding_and_data_parallel_sizes(tmp_path):
    ckpt_dir = str(tmp_path)
    one = TiedLM()
    trainer = L.Trainer(devices=1, max_epochs=1, use_distributed_sampler=False, **TRAINER)
    trainer.fit(one, DataLoader(tokens(), batch_size=2 * BATCH, sampler=OneDeviceOrder(tokens(), [2])))
    trainer.save_checkpoint(os.path.join(ckpt_dir, "one_device.ckpt"))
    for kinds in run_distributed(_two_first_epoch, 2, ckpt_dir, timeout=120):
        assert kinds == ["Parameter"], kinds  # dp=1: nothing to shard
    four = run_distributed(_four, 4, ckpt_dir, timeout=300)
    two = run_distributed(_two_resume, 2, ckpt_dir, timeout=120)

    full = one_device(TiedLM(), 1, [2], clip=0.05, accumulate=2)
    plain = one_device(TiedLM(), 1, [2])
    after_dp1 = one_device(TiedLM(), 2, [1, 2])  # epoch 0 at dp=1, epoch 1 at dp=2
    after_dp2 = one_device(TiedLM(), 2, [2, 1])
    uninterrupted = one_device(TiedLM(), 2, [2, 2])
    # The sharded checkpoint consolidated into one file resumes on one device as the one-device
    # checkpoint of the same epoch does.
    src = os.path.join(ckpt_dir, "sharded_dp2")
    subprocess.run([sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", src], check=True,
                   capture_output=True, timeout=120)
    resumed = {}
    for name in ("sharded_dp2.consolidated", "one_device.ckpt"):
        model = TiedLM()
        L.Trainer(devices=1, max_epochs=2, use_distributed_sampler=False, **TRAINER).fit(
            model, DataLoader(tokens(), batch_size=2 * BATCH, sampler=OneDeviceOrder(tokens(), [2, 2])),
            ckpt_path=os.path.join(ckpt_dir, name))
        resumed[name] = dict(model.named_parameters())
    for name, value in resumed["sharded_dp2.consolidated"].items():
        torch.testing.assert_close(value, resumed["one_device.ckpt"][name], rtol=1e-9, atol=1e-12,
                                   msg=f"consolidated: {name}")
    ref = TiedLM()
    L.Trainer(devices=1, max_epochs=1, use_distributed_sampler=False, gradient_clip_val=0.05, accumulate_grad_batches=2,
              **TRAINER).fit(
        ref, DataLoader(tokens(), batch_size=2 * BATCH, sampler=OneDeviceOrder(tokens(), [2])))
    val = L.Trainer(devices=1, **TRAINER).validate(ref, DataLoader(tokens(16, seed=2), batch_size=2 * BATCH),
                                                   verbose=False)[0]["val_loss"]
    seen = {key: set() for key in ("full", "user", "resumed_sharded", "resumed_whole", "from_one_device")}
    for rank, out in enumerate(four):
        assert "DTensor" in out["kinds"], out["kinds"]
        _assert_equal(out["full"], full, "data_parallel_sharding='full'", rank, seen["full"])
        _assert_equal(out["user"], plain, "fully_shard in configure_model", rank, seen["user"])
        _assert_equal(out["resumed_sharded"], after_dp1, "dp=1 checkpoint resumed sharded at dp=2", rank,
                      seen["resumed_sharded"])
        _assert_equal(out["from_one_device"], uninterrupted, "one-device .ckpt resumed sharded", rank,
                      seen["from_one_device"])
        assert out["val"] == pytest.approx(float(val), rel=1e-9), (rank, out["val"], float(val))
        assert out["both"] is not None and "data_parallel_sharding='full'" in out["both"], out["both"]
        assert "already wrapped by fully_shard" in out["both"] and "Block" in out["both"], out["both"]
    for rank, got in enumerate(two):
        _assert_equal(got, after_dp2, "sharded dp=2 checkpoint resumed whole at dp=1", rank, seen["resumed_whole"])
    for key, names in seen.items():
        assert names == set(full), f"{key}: parameters missing from every rank: {set(full) - names}"


# -- MoE: pp=2 x ep=2 x dp=2 under combined 1F1B, and Fabric ------------------------------------
def _moe_and_fabric(rank, world):
    import lightning_pp

    os.environ["LOCAL_RANK"] = str(rank)
    model = UserMoE()
    moe_strategy = lightning_pp.PipelineStrategy(pipeline_parallel_size=2, expert_parallel_size=2, virtual_pipeline_size=2,
                                                 schedule="combined_1f1b", num_microbatches=4, data_parallel_sharding="full")
    L.Trainer(devices=world, strategy=moe_strategy, max_steps=3, **TRAINER).fit(
        model, DataLoader(user_moe_dataset(), batch_size=8))
    moe = gathered(model)
    fabric = L.Fabric(accelerator="cpu", devices=world, precision="64-true", strategy=lightning_pp.FabricPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=2, data_parallel_sharding="full"))
    fabric.launch()
    model = fabric.setup_module(TiedLM())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    loader = fabric.setup_dataloaders(DataLoader(tokens(), batch_size=BATCH, shuffle=True))  # distributed, seed 0
    for batch in loader:
        opt.zero_grad()
        fabric.strategy.pipeline_step(model, batch)
        fabric.clip_gradients(model, opt, max_norm=0.05)
        opt.step()
    return moe, gathered(model._forward_module)


@pytest.mark.timeout(300)
def test_moe_and_fabric_sharded_equal_one_device():
    per_rank = run_distributed(_moe_and_fabric, 4, timeout=260)
    dataset = user_moe_dataset()
    ref = UserMoE()
    L.Trainer(devices=1, max_steps=3, use_distributed_sampler=False, **TRAINER).fit(
        ref, DataLoader(dataset, batch_size=16, sampler=OneDeviceOrder(dataset, [2], global_batch=16)))
    moe_expected = {name: p.detach() for name, p in ref.named_parameters()}
    fabric_expected = one_device(TiedLM(), 1, [2], clip=0.05)
    seen_moe, seen_fabric = set(), set()
    for rank, (moe, fabric) in enumerate(per_rank):
        _assert_equal(moe, moe_expected, "MoE pp=2 x ep=2 x dp=2, combined 1F1B", rank, seen_moe)
        _assert_equal(fabric, fabric_expected, "Fabric", rank, seen_fabric)
    assert seen_moe == set(moe_expected) and seen_fabric == set(fabric_expected)


def _whole_model_sharded(rank, world):
    os.environ["LOCAL_RANK"] = str(rank)

    class WholeModel(TiedLM):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self, mesh=self.device_mesh["dp"])

    L.Trainer(devices=world, max_steps=1, strategy=strategy(), **TRAINER).fit(
        WholeModel(), DataLoader(tokens(), batch_size=BATCH))


@pytest.mark.timeout(200)
def test_fully_shard_of_the_whole_model_is_refused_naming_it():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_whole_model_sharded, 4, timeout=150)
    for rank, error in info.value.errors.items():
        assert "not a pipeline layer" in error and "WholeModel" in error, f"rank {rank}: {error}"
