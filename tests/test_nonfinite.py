"""Non-finite loss or gradients: the decision is collective (it rides on the step's loss
all-reduce), so every rank raises, or skips, at the same step, and the process group stays usable.

One 2-rank run (pp=2) goes through every scenario; the tests below check its parts.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from distributed import run_distributed
from models import ToyRegressor

STEPS = 4
BAD_STEP = 1


def _batches(nan_target_at=None):
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        if step == nan_target_at:
            y[3, 1] = float("nan")  # only the last stage's loss sees it
        out.append((x, y))
    return out


def _run(rank, nonfinite, batches, poison_at=None, schedule="1f1b", poisoned="embed"):
    """Train ``batches``; with ``poison_at``, the gradient of layer ``poisoned``'s weight (on rank 0
    only: the embedding is stage 0; under ``zbv`` rank 0 also holds the head, stage 3) becomes inf
    at that step while the loss stays finite. Returns per step ("ok", loss, skipped) or ("raised",
    message), and the final parameters."""
    from lightning_pp.runtime import NonFiniteError, build_pipeline

    torch.manual_seed(0)
    model = ToyRegressor(blocks=2)
    executor = build_pipeline(model, pipeline_parallel_size=2, num_microbatches=2, nonfinite=nonfinite,
                              schedule=schedule, virtual_pipeline_size=2 if schedule == "zbv" else 1)
    step = {"index": 0}
    if rank == 0 and poison_at is not None:
        getattr(model, poisoned).weight.register_hook(lambda g: g * float("inf") if step["index"] == poison_at else g)
    names = executor.partition.parameter_names
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record = []
    for index, batch in enumerate(batches):
        step["index"] = index
        opt.zero_grad()
        try:
            result = executor.train_step(batch)
        except NonFiniteError as exc:
            grads_left = [p.grad for p in model.parameters() if p.grad is not None]
            record.append(("raised", str(exc), len(grads_left)))
            continue
        opt.step()
        record.append(("ok", float(result.loss), result.skipped))
    executor.close()
    return record, {names[id(p)]: p.detach().clone() for p in model.parameters()}


def _trainer_skip(rank, world):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_models import PipeRegressor
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    x = torch.cat([b[0] for b in _batches(BAD_STEP)])
    y = torch.cat([b[1] for b in _batches(BAD_STEP)])
    class Snapshots(L.Callback):
        params = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.params.append([p.detach().clone() for p in pl_module.parameters()])

    snapshots = Snapshots()
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                        callbacks=[snapshots],
                        strategy=PipelineStrategy(num_microbatches=2, nonfinite="skip"))
    trainer.fit(PipeRegressor(), DataLoader(TensorDataset(x, y), batch_size=8))
    unchanged = all(torch.equal(a, b) for a, b in zip(snapshots.params[BAD_STEP - 1], snapshots.params[BAD_STEP]))
    changed_later = not all(torch.equal(a, b) for a, b in zip(snapshots.params[BAD_STEP], snapshots.params[-1]))
    epoch_loss = float(trainer.callback_metrics["train_loss_epoch"])
    return trainer.strategy.skipped_steps, trainer.global_step, unchanged, changed_later, epoch_loss


def _battery(rank, world):
    clean = _batches()
    return {
        "raise_loss": _run(rank, "raise", _batches(BAD_STEP)),
        "raise_grad": _run(rank, "raise", clean, poison_at=BAD_STEP),
        "raise_grad_zbv": _run(rank, "raise", clean, poison_at=BAD_STEP, schedule="zbv", poisoned="head"),
        "skip_grad": _run(rank, "skip", clean, poison_at=BAD_STEP),
        "skip_reference": _run(rank, "skip", [b for i, b in enumerate(clean) if i != BAD_STEP]),
        "ignore_loss": _run(rank, "ignore", _batches(BAD_STEP)),
        "trainer_skip": _trainer_skip(rank, world),
    }


@pytest.fixture(scope="module")
def battery():
    return run_distributed(_battery, 2, timeout=200)


@pytest.mark.timeout(240)
def test_nonfinite_loss_raises_on_every_rank_at_the_same_step_and_the_group_survives(battery):
    messages = set()
    for rank, results in enumerate(battery):
        record, _ = results["raise_loss"]
        kinds = [entry[0] for entry in record]
        assert kinds == ["ok", "raised", "ok", "ok"], f"rank {rank}: {record}"  # later steps still run
        _, message, grads_left = record[BAD_STEP]
        assert grads_left == 0, "a raised step must leave .grad as it was before the step"
        assert "step 1 is not finite: the batch loss is nan" in message
        assert "gradients hold inf/nan on pipeline rank(s) [0, 1]" in message
        assert "nonfinite='skip'" in message  # names the way out
        messages.add(message)
    assert len(messages) == 1, "every rank must raise the same error"


@pytest.mark.timeout(240)
def test_nonfinite_gradient_on_one_stage_raises_everywhere_naming_that_stage(battery):
    for rank, results in enumerate(battery):
        record, _ = results["raise_grad"]
        assert [entry[0] for entry in record] == ["ok", "raised", "ok", "ok"], f"rank {rank}: {record}"
        message = record[BAD_STEP][1]
        assert "gradients hold inf/nan on pipeline rank(s) [0] (virtual stage(s) [0])" in message, message
        assert "loss" not in message.split(":")[1], message  # the loss itself was finite


@pytest.mark.timeout(240)
def test_nonfinite_gradient_under_a_v_schedule_names_the_stage_that_produced_it(battery):
    # zbv places rank 0's chunks at stages 0 and 3 (a V): the head is the last stage, on rank 0.
    for rank, results in enumerate(battery):
        record, _ = results["raise_grad_zbv"]
        assert [entry[0] for entry in record] == ["ok", "raised", "ok", "ok"], f"rank {rank}: {record}"
        message = record[BAD_STEP][1]
        assert "gradients hold inf/nan on pipeline rank(s) [0] (virtual stage(s) [3])" in message, message


@pytest.mark.timeout(240)
def test_skip_drops_the_step_on_every_rank_and_equals_training_without_that_batch(battery):
    for rank, results in enumerate(battery):
        record, params = results["skip_grad"]
        reference, reference_params = results["skip_reference"]
        # Rank 1's own gradients were finite: it skips because the decision is collective.
        assert [entry[2] for entry in record] == [False, True, False, False], f"rank {rank}: {record}"
        kept = [entry[1] for i, entry in enumerate(record) if i != BAD_STEP]
        assert kept == [entry[1] for entry in reference]  # bitwise: the skipped step changed nothing
        for name, value in params.items():
            assert torch.equal(value, reference_params[name]), name


@pytest.mark.timeout(240)
def test_ignore_lets_nan_through(battery):
    for results in battery:
        record, params = results["ignore_loss"]
        assert [entry[0] for entry in record] == ["ok"] * STEPS
        assert math.isnan(record[BAD_STEP][1])
        assert any(torch.isnan(value).any() for value in params.values())


@pytest.mark.timeout(240)
def test_trainer_skip_leaves_parameters_unchanged_and_keeps_the_logged_loss_finite(battery):
    for rank, results in enumerate(battery):
        skipped, global_step, unchanged, changed_later, epoch_loss = results["trainer_skip"]
        assert skipped == 1 and global_step == STEPS, f"rank {rank}: {results['trainer_skip']}"
        assert unchanged and changed_later
        assert math.isfinite(epoch_loss)
