"""Trainer.fit with the pipeline strategy equals the same fit on one device."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from distributed import run_distributed
from lightning_models import PipeRegressor, loader

COMMON = dict(accelerator="cpu", max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05,
              precision="64-true", limit_val_batches=2, val_check_interval=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=1, use_distributed_sampler=False)


def _reference(global_batch, sampler_order=False, **overrides):
    """One device. ``sampler_order``: its training batches in the order Lightning's distributed
    sampler gives a multi-device run by default (it shuffles the training set with seed 0 even when
    the user's loader does not), built independently with torch's DistributedSampler."""
    torch.manual_seed(0)
    model = PipeRegressor()
    grad_norms = []

    class Norms(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
            grad_norms.append(float(torch.stack(grads).norm()))

    trainer = L.Trainer(devices=1, callbacks=[Norms()], **{**COMMON, **overrides})
    train = loader(global_batch)
    if sampler_order:
        sampler = DistributedSampler(train.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        train = DataLoader(train.dataset, batch_size=global_batch, sampler=sampler)
    trainer.fit(model, train, loader(global_batch))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return params, metrics, grad_norms, dict(model.hook_calls)


def _fit(rank, world, strategy_spec, local_batch, overrides=None):
    from lightning_pp import PipelineStrategy
    from lightning_pp.runtime import executor_of

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = PipeRegressor()
    strategy = strategy_spec if isinstance(strategy_spec, str) else PipelineStrategy(**strategy_spec)
    trainer = L.Trainer(devices=world, strategy=strategy, **{**COMMON, **(overrides or {})})
    dp = world // strategy.config.dims(world).pp if not isinstance(strategy, str) else 1
    data = loader(local_batch, dp=dp, dp_rank=rank % dp)
    trainer.fit(model, data, data)
    names = executor_of(model).partition.parameter_names
    params = {names[id(p)]: p.detach().clone() for p in model.parameters()}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    prog = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
    return params, metrics, prog, dict(model.hook_calls), trainer.global_step


def _compare(ref, per_rank, rtol=1e-6):
    ref_params, ref_metrics, ref_norms, ref_hooks = ref
    assert max(ref_norms) > 0.05 * 2, f"clipping must actually clip: reference norms {ref_norms}"
    seen = set()
    for rank, (params, metrics, prog, hooks, step) in enumerate(per_rank):
        assert step == 3
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=rtol, atol=1e-9, msg=f"{name} on rank {rank}")
            seen.add(name)
        # The real batch loss (not 0, not a stage-local value) is what every rank logs.
        assert metrics["train_loss_step"] == pytest.approx(ref_metrics["train_loss_step"], rel=1e-6)
        assert metrics["val_loss"] == pytest.approx(ref_metrics["val_loss"], rel=1e-6)
        assert metrics["mae"] == pytest.approx(ref_metrics["mae"], rel=1e-6)  # self.log in pipeline_loss
        assert metrics["mse_metric"] == pytest.approx(ref_metrics["mse_metric"], rel=1e-6)  # torchmetrics
        assert "train_loss_step" in prog
        assert hooks == ref_hooks  # on_after_backward per batch, on_before_optimizer_step per step
    assert seen == set(ref_params)


@pytest.mark.timeout(240)
def test_fit_by_registered_name_equals_single_device():
    ref = _reference(global_batch=8)
    per_rank = run_distributed(_fit, 2, "pp_1f1b", 8, timeout=200)
    _compare(ref, per_rank)


@pytest.mark.timeout(240)
def test_fit_zero_bubble_v_schedule_by_registered_name_equals_single_device():
    # pp_zbv: two chunks per rank in a V, backward split into B and a deferred W; with gradient
    # accumulation and clipping (the clipped norm is taken after every W has run).
    # Lightning's default data path: the distributed sampler on (one pipeline: one replica), so
    # the reference sees the training set in that sampler's order.
    ref = _reference(global_batch=8, sampler_order=True)
    per_rank = run_distributed(_fit, 2, "pp_zbv", 8, {"use_distributed_sampler": True}, timeout=200)
    _compare(ref, per_rank)


@pytest.mark.timeout(300)
def test_fit_interleaved_with_data_parallel_equals_single_device():
    ref = _reference(global_batch=16)
    spec = dict(pipeline_parallel_size=2, virtual_pipeline_size=2, schedule="interleaved", num_microbatches=4)
    per_rank = run_distributed(_fit, 4, spec, 8, timeout=260)
    _compare(ref, per_rank)
