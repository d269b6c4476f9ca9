"""Fabric with the pipeline strategy equals the same loop on one device."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed
from lightning_models import PipeRegressor, loader
from lightning_pp.runtime import executor_of

STEPS = 4


def _reference():
    torch.manual_seed(0)
    model = PipeRegressor().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step, (x, y) in enumerate(loader(8)):
        if step == STEPS:
            break
        x, y = x.double(), y.double()
        loss = model.pipeline_loss(model(x), (x, y))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _fabric_run(rank, world, strategy_spec, ckpt_dir):
    import lightning as L

    import lightning_pp

    os.environ["LOCAL_RANK"] = str(rank)
    strategy = strategy_spec if isinstance(strategy_spec, str) else lightning_pp.FabricPipelineStrategy(**strategy_spec)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="64-true")
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(PipeRegressor())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    losses, norms = [], []
    for step, batch in enumerate(loader(8)):
        if step == STEPS:
            break
        batch = fabric.to_device(batch)
        opt.zero_grad()
        loss = fabric.strategy.pipeline_step(model, batch)
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.05)))
        opt.step()
        losses.append(float(loss))
        if step == 1:
            fabric.save(ckpt_dir, {"model": model, "optimizer": opt, "step": step})
    names = executor_of(model).partition.parameter_names
    params = {names[id(p)]: p.detach().clone() for p in model.parameters()}
    # Resume from the step-1 checkpoint into a fresh model and continue: same trajectory.
    torch.manual_seed(1)
    model2 = fabric.setup_module(PipeRegressor())
    opt2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.01))
    state = {"model": model2, "optimizer": opt2, "step": None}
    fabric.load(ckpt_dir, state)
    resumed = []
    for step, batch in enumerate(loader(8)):
        if step <= state["step"]:
            continue
        if step == STEPS:
            break
        batch = fabric.to_device(batch)
        opt2.zero_grad()
        loss = fabric.strategy.pipeline_step(model2, batch)
        fabric.clip_gradients(model2, opt2, max_norm=0.05)
        opt2.step()
        resumed.append(float(loss))
    try:
        early = PipeRegressor()
        fabric.setup(early, torch.optim.SGD(early.parameters(), lr=0.1))  # optimizer made before the cut
        joint_error = None
    except RuntimeError as exc:
        joint_error = str(exc)
    return losses, params, norms, resumed, joint_error


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec", ["pp_1f1b", dict(pipeline_parallel_size=2, virtual_pipeline_size=2, schedule="interleaved")])
def test_fabric_pipeline_step_equals_single_device(spec, tmp_path):
    ref_losses, ref_params = _reference()
    per_rank = run_distributed(_fabric_run, 2, spec, str(tmp_path / "ckpt"), timeout=200)
    for losses, params, norms, resumed, joint_error in per_rank:
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        assert max(norms) > 0.05  # clipping was active, and the norm is the global one on every rank
        assert norms == per_rank[0][2]
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-6, atol=1e-9)
        assert resumed == pytest.approx(ref_losses[2:], rel=1e-9)
        assert "fabric.setup_module(model)" in joint_error
