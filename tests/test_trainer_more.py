"""Trainer: evaluation/prediction through the pipeline, manual optimization, and bad input
answered before training starts."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch import nn

from distributed import DistributedFailure, run_distributed
from lightning_models import PipeRegressor, loader
from lightning_pp.runtime import executor_of

QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
             enable_checkpointing=False, use_distributed_sampler=False, precision="64-true")


def _strategy(**kw):
    from lightning_pp import PipelineStrategy

    return PipelineStrategy(**kw)


def _predict_and_test(rank, world):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = PipeRegressor()
    trainer = L.Trainer(devices=world, strategy=_strategy(num_microbatches=3), **QUIET)
    preds = trainer.predict(model, loader(6, n=12))
    tested = trainer.test(model, loader(6, n=12), verbose=False)
    return [p.clone() for p in preds], tested


def test_predict_and_test_run_through_the_pipeline():
    torch.manual_seed(0)
    ref = PipeRegressor().double()
    data = list(loader(6, n=12))
    with torch.no_grad():
        ref_preds = [ref(x.double()) for x, _ in data]
        ref_loss = sum(float(ref.pipeline_loss(ref(x.double()), (x, y.double()))) for x, y in data) / len(data)
    for preds, tested in run_distributed(_predict_and_test, 2, timeout=200):
        assert len(preds) == len(ref_preds)
        for got, want in zip(preds, ref_preds):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        assert tested[0]["test_loss"] == pytest.approx(ref_loss, rel=1e-9)


class ManualModule(PipeRegressor):
    def __init__(self, use_manual_backward: bool):
        super().__init__()
        self.automatic_optimization = False
        self.use_manual_backward = use_manual_backward
        self.losses = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        if self.use_manual_backward:
            loss = self.pipeline_loss(self(batch[0]), batch)
            self.manual_backward(loss)
        else:
            loss = self.trainer.strategy.pipeline_step(batch)
        opt.step()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _manual(rank, world, use_manual_backward):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = ManualModule(use_manual_backward)
    trainer = L.Trainer(devices=world, strategy=_strategy(num_microbatches=2), max_steps=3, **QUIET)
    trainer.fit(model, loader(8))
    return model.losses


def test_manual_optimization_uses_pipeline_step():
    torch.manual_seed(0)
    ref = ManualModule(False).double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for step, (x, y) in enumerate(loader(8)):
        if step == 3:
            break
        loss = ref.pipeline_loss(ref(x.double()), (x, y.double()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(float(loss))
    for losses in run_distributed(_manual, 2, False, timeout=200):
        assert losses == pytest.approx(ref_losses, rel=1e-9)


def test_manual_backward_is_refused_with_the_fix():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_manual, 2, True, timeout=200)
    assert all("pipeline_step(batch)" in message for message in info.value.errors.values()), info.value.errors


class NoProtocol(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 3)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_bad(rank, world, what):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model, data, strategy = NoProtocol(), loader(8), _strategy()
    L.Trainer(devices=world, strategy=strategy, max_steps=2, **QUIET).fit(model, data)
    return "trained"


@pytest.mark.parametrize("what,needle", [
    ("protocol", "missing `pipeline_layers`, `pipeline_loss`"),
])
def test_bad_input_fails_on_every_rank_before_training(what, needle):
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_fit_bad, 2, what, timeout=120)
    assert set(info.value.errors) == {0, 1}
    assert all(needle in message for message in info.value.errors.values()), info.value.errors


def test_indivisible_devices_fail_before_any_process_starts():
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by .* 2 \* 1"):
        L.Trainer(devices=3, strategy=_strategy(pipeline_parallel_size=2), **QUIET)


def test_invalid_schedule_fails_in_the_constructor():
    with pytest.raises(ValueError, match="virtual_pipeline_size=1 is invalid for schedule='interleaved'"):
        _strategy(pipeline_parallel_size=2, virtual_pipeline_size=1, schedule="interleaved")
    # not given: the schedule's own chunk count
    for schedule in ("interleaved", "zbv", "dualpipev", "1f1b"):
        strategy = _strategy(pipeline_parallel_size=2, schedule=schedule)
        assert strategy.engine.resolve(2).schedule.vp == (1 if schedule == "1f1b" else 2), schedule
    with pytest.raises(ValueError, match="num_microbatches=0"):
        _strategy(pipeline_parallel_size=2, num_microbatches=0)


class SGDRegressor(PipeRegressor):
    """PipeRegressor with plain SGD (bf16 rounding differences stay proportional, unlike Adam's)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _linear_dtypes(model):
    seen = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    return seen


BF16 = dict(QUIET, precision="bf16-mixed", max_steps=4)


def _fit_bf16(rank, world):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = SGDRegressor()
    dtypes = _linear_dtypes(model)
    trainer = L.Trainer(devices=world, strategy=_strategy(num_microbatches=4), **BF16)
    trainer.fit(model, loader(8, n=32))
    names = executor_of(model).partition.parameter_names
    return dtypes, {names[id(p)]: p.detach().clone() for p in model.parameters()}


@pytest.mark.timeout(200)
def test_bf16_mixed_precision_runs_every_stage_under_autocast():
    torch.manual_seed(0)
    ref = SGDRegressor()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_dtypes = _linear_dtypes(ref)
    L.Trainer(devices=1, **BF16).fit(ref, loader(8, n=32))
    assert ref_dtypes == {torch.bfloat16}
    for dtypes, params in run_distributed(_fit_bf16, 2, timeout=160):
        assert dtypes == {torch.bfloat16}  # this stage's layers ran under the precision plugin's autocast
        for name, value in params.items():
            assert value.dtype == torch.float32  # the weights stay float32 ("mixed")
            step = dict(ref.named_parameters())[name].detach() - init[name]
            # Microbatches round differently from the whole batch in bfloat16 (measured: within 4 %
            # of the largest update); a wrong loss scale or a missed microbatch is off by far more.
            torch.testing.assert_close(value - init[name], step, rtol=0.05, atol=0.05 * float(step.abs().max()), msg=name)
