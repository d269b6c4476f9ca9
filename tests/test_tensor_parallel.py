"""Tensor parallelism inside pipeline stages (issue 37, the user's ``parallelize_module`` route).

A Llama-style decoder written as users write it for Lightning's ``ModelParallelStrategy``: its
``configure_model`` splits every block's attention (q/k/v column-wise, o row-wise) and MLP
(gate/up column-wise, down row-wise) over ``self.device_mesh["tensor_parallel"]``; the embedding
and the head are tied. Trained with ``Trainer.fit`` and Lightning's defaults at pp=2 x tp=2 under
several schedules in one launch, against the same Trainer on one device (float64), with gradient
clipping by the global norm (which must count each tensor-parallel shard once and each replicated
parameter once): parameters after ``fit`` and the consolidated checkpoint (one device's names and
optimizer format) equal one device's.
The same launch checks the errors: a head count that the tensor-parallel size does not divide, and
DTensors over a mesh other than the tensor-parallel one; resuming from a checkpoint, exactly at the
same tensor-parallel size and refused at another; the same model under Fabric."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from distributed import run_distributed

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("gpipe", 1), ("zb1p", 1),
             ("combined_1f1b", 1)]
TRAINER = dict(accelerator="cpu", max_epochs=1, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=0.05)
SAMPLES, BATCH, SEQ, VOCAB = 16, 8, 6, 11  # two steps of 4 microbatches of 2


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: the heads this rank holds once q/k/v are split column-wise (torchtitan's way)
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = Attention(dim, n_heads), MLP(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


def parallelize(blocks, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel()}
    for block in blocks:
        parallelize_module(block, mesh, plan)


class Llama(L.LightningModule):
    def __init__(self, n_heads=4, dim=16, n_layers=4, mesh_dim="tensor_parallel", loss_parallel=False):
        super().__init__()
        self.mesh_dim, self.loss_parallel = mesh_dim, loss_parallel
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.head = Head(dim)
        if not loss_parallel:
            self.head.out.weight = self.embed.weight  # tied

    def configure_model(self):
        if self.device_mesh is None or self.mesh_dim is None:  # one device, or no tensor parallelism
            return
        parallelize(self.blocks, self.device_mesh[self.mesh_dim])
        if self.loss_parallel:  # the head's logits left sharded over the vocabulary
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

            parallelize_module(self.head.out, self.device_mesh[self.mesh_dim],
                               ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pipeline_loss(self, logits, batch):
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.5)


def _data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def _make(**kwargs):
    torch.manual_seed(0)
    return Llama(**kwargs).double()


def _full(state):
    return {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for n, v in state.items()}


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def _fit(rank, world, schedules, checkpoint_root):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    results = {}
    for schedule, vp in schedules:
        model = _make()
        strategy = PipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, virtual_pipeline_size=vp,
                                    schedule=schedule, num_microbatches=4)
        trainer = L.Trainer(devices=world, strategy=strategy, **TRAINER)
        trainer.fit(model, DataLoader(_data(), batch_size=BATCH))  # the user's own loader
        trainer.save_checkpoint(os.path.join(checkpoint_root, schedule))
        results[schedule] = _full(model.state_dict())

    def fit(**kwargs):
        strategy = PipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4)
        L.Trainer(devices=world, strategy=strategy, **TRAINER).fit(_make(**kwargs), DataLoader(_data(), batch_size=BATCH))

    # Resumed from the 1f1b run's checkpoint for a second epoch, optimizer included; at another
    # tensor-parallel size, refused.
    model = _make()
    strategy = PipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4)
    L.Trainer(devices=world, strategy=strategy, **{**TRAINER, "max_epochs": 2}).fit(
        model, DataLoader(_data(), batch_size=BATCH), ckpt_path=os.path.join(checkpoint_root, "1f1b"))
    results["resumed"] = _full(model.state_dict())
    results["fabric"] = _fabric(world)  # before the errors below, which a Fabric run would inherit
    strategy = PipelineStrategy(pipeline_parallel_size=2, num_microbatches=4)
    results["other tp"] = _error(lambda: L.Trainer(devices=world, strategy=strategy, **{**TRAINER, "max_epochs": 2}).fit(
        _make(mesh_dim=None), DataLoader(_data(), batch_size=BATCH), ckpt_path=os.path.join(checkpoint_root, "1f1b")))
    results["heads"] = _error(lambda: fit(n_heads=1))
    results["other mesh"] = _error(lambda: fit(mesh_dim="dp"))
    return results


def _one_device(epochs):
    from lightning_models import OneDeviceOrder

    model = _make()
    trainer = L.Trainer(devices=1, **{**TRAINER, "max_epochs": epochs})
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH, sampler=OneDeviceOrder(_data(), [1] * epochs, BATCH)))
    momentum = {i: s["momentum_buffer"] for i, s in trainer.optimizers[0].state_dict()["state"].items()}
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, momentum


def _fabric(world):
    """The same model under Fabric: split before setup_module over the strategy's mesh, one epoch in
    the Trainer's order, clipped by the global norm."""
    from lightning_pp import FabricPipelineStrategy

    strategy = FabricPipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="64-true")
    fabric.launch()
    model = _make()
    parallelize(model.blocks, fabric.strategy.device_mesh["tensor_parallel"])
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(model.configure_optimizers())
    order = list(DistributedSampler(_data(), num_replicas=1, rank=0, shuffle=True, seed=0))
    for batch in DataLoader(Subset(_data(), order), batch_size=BATCH):
        optimizer.zero_grad()
        fabric.strategy.pipeline_step(model, batch)
        fabric.clip_gradients(model, optimizer, max_norm=TRAINER["gradient_clip_val"])
        optimizer.step()
    return _full(model.state_dict())


def _assert_matches(held, reference, initial, what):
    """Equal to one device within 1e-9 of the update's size."""
    for key, value in held.items():
        update = (reference[key] - initial[key]).abs().max().item()
        error = (value - reference[key]).abs().max().item()
        assert error <= 1e-9 * max(update, 1e-12), f"{what}: {key} differs by {error:.3e} (update {update:.3e})"


def _consolidated(directory):
    """The checkpoint as Lightning's consolidate_checkpoint makes it: a one-device checkpoint."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    return _format_checkpoint(_load_distributed_checkpoint(Path(directory)))


@pytest.mark.timeout(500)
def test_tensor_parallel_stages_equal_one_device_and_bad_plans_are_refused(tmp_path):
    initial = {n: p.detach().clone() for n, p in _make().state_dict().items()}
    # Lightning's distributed sampler shuffles with seed 0 under a distributed strategy (one
    # data-parallel replica here), reshuffled every epoch: one device reads the samples in that order.
    reference, momentum = _one_device(epochs=1)
    two_epochs, _ = _one_device(epochs=2)
    per_rank = run_distributed(_fit, 4, SCHEDULES, str(tmp_path), timeout=480)
    for schedule, _ in SCHEDULES:
        held = [r[schedule] for r in per_rank]
        assert set().union(*held) == set(reference), schedule
        for rank, state in enumerate(held):
            _assert_matches(state, reference, initial, f"{schedule}, rank {rank}")
        checkpoint = _consolidated(os.path.join(str(tmp_path), schedule))
        saved = checkpoint["state_dict"]
        assert set(saved) == set(reference), (schedule, set(saved) ^ set(reference))
        _assert_matches(saved, reference, initial, f"{schedule}, consolidated checkpoint")
        (optimizer,) = checkpoint["optimizer_states"]  # one device's format, the tensor-parallel shards joined
        assert sorted(optimizer["state"]) == sorted(str(i) for i in momentum), schedule
        for i, value in momentum.items():
            torch.testing.assert_close(optimizer["state"][str(i)]["momentum_buffer"], value, rtol=1e-9, atol=1e-12,
                                       msg=f"{schedule}: momentum of parameter {i}")
    for rank, result in enumerate(per_rank):
        _assert_matches(result["fabric"], reference, initial, f"Fabric, rank {rank}")
        _assert_matches(result["resumed"], two_epochs, reference, f"resumed for a second epoch, rank {rank}")
        assert "saved at tensor_parallel_size=2 and this run has tensor_parallel_size=1" in (result["other tp"] or ""), \
            result["other tp"]
    for result in per_rank:  # every rank raises the same error at setup
        assert "n_heads=1 is not divisible by tensor_parallel_size=2" in (result["heads"] or ""), result["heads"]
        other = result["other mesh"] or ""
        assert "over a mesh other than the tensor-parallel one" in other and "blocks." in other, other
        assert "'dp'" in other and "self.device_mesh['tensor_parallel']" in other, other


def test_a_tensor_parallel_size_that_does_not_divide_the_world_is_refused_before_processes_start():
    from lightning_pp.runtime import PipelineConfig

    with pytest.raises(ValueError, match=r"world size 4 is not divisible by .* = 2 \* 3 \* 1.*tensor_parallel_size in \[1, 2\]"):
        PipelineConfig(pipeline_parallel_size=2, tensor_parallel_size=3).resolve(4)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with data_parallel_sharding='full' is not supported yet"):
        PipelineConfig(tensor_parallel_size=2, data_parallel_sharding="full").resolve(8)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with expert_parallel_size=2 is not supported yet"):
        PipelineConfig(tensor_parallel_size=2, expert_parallel_size=2).resolve(8)


def _fit_loss_parallel(rank, world):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    strategy = PipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4)
    L.Trainer(devices=world, strategy=strategy, **TRAINER).fit(_make(loss_parallel=True),
                                                                DataLoader(_data(), batch_size=BATCH))


@pytest.mark.timeout(150)
def test_logits_left_distributed_for_loss_parallelism_are_refused_at_the_first_step():
    """Loss parallelism is not in this slice: the head's DTensor logits are refused before
    pipeline_loss sees them (the first stage's ranks, blocked in the step, are ended by the watchdog)."""
    from distributed import DistributedFailure

    with pytest.raises(DistributedFailure, match=r"given to pipeline_loss, is a DTensor.*Loss parallelism .*not supported yet"):
        run_distributed(_fit_loss_parallel, 4, timeout=120)
