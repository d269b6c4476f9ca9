"""Lightning's precision plugins under the pipeline: ``bf16-mixed`` (autocast) and ``bf16-true``
(a bfloat16 model, inputs converted) in fit, validate, test and predict, Trainer and Fabric, give
what one device gives: every loop runs under the precision context of the same loop on one device."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distributed import run_distributed
from models import Block

PRECISIONS = ("bf16-mixed", "bf16-true")
TRAINER = dict(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=2)


class Regressor(L.LightningModule):
    """Float inputs (so bf16-true must convert them), the user's own one-device step methods."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Linear(6, 32)
        self.blocks = nn.ModuleList(Block(32) for _ in range(4))
        self.head = nn.Linear(32, 3)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.pipeline_loss(self(batch[0]), batch))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(n=32):
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 6, generator=g) * 3, torch.randn(n, 3, generator=g))


def _trainer_run(precision, devices, strategy=None):
    data = _data()
    # one device gets the order Lightning's distributed sampler gives the (dp=1) pipeline
    train = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0)) if strategy is None \
        else DataLoader(data, batch_size=8)
    model = Regressor()
    kwargs = dict(TRAINER, precision=precision, devices=devices, **({"strategy": strategy} if strategy else {}))
    trainer = L.Trainer(**kwargs)
    # the evaluation loops first, on the initial weights (the same on both sides)
    out = {"validate": trainer.validate(model, DataLoader(data, batch_size=8), verbose=False)[0]["val_loss"]}
    out["test"] = trainer.test(model, DataLoader(data, batch_size=8), verbose=False)[0]["test_loss"]
    out["predict"] = torch.cat(trainer.predict(model, DataLoader(data, batch_size=8))).float()
    trainer.fit(model, train, DataLoader(data, batch_size=8))
    out["fit_val_loss"] = float(trainer.callback_metrics["val_loss"])
    out["params"] = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    return out


def _fabric_run(precision, strategy=None):
    fabric = L.Fabric(accelerator="cpu", devices=1 if strategy is None else 2, precision=precision,
                      **({"strategy": strategy} if strategy else {}))
    fabric.launch()
    module = Regressor()
    x, y = _data().tensors
    if strategy is None:
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    else:
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():  # evaluation first, on the initial weights
        if strategy is None:
            eval_loss = float(module.pipeline_loss(model(x), (x, y)))
            predicted = forwarded = model(x)
        else:
            eval_loss = float(fabric.strategy.pipeline_eval(model, (x, y)))
            predicted = fabric.strategy.pipeline_eval(model, (x, y), collect_outputs=True)
            forwarded = model(x)  # one device's code: the whole model's forward, through the pipeline
    refused = None
    if strategy is not None:  # with gradients on, the pipelined forward names what trains instead
        try:
            model(x)
        except RuntimeError as error:
            refused = str(error)
    losses = []
    for step in range(2):
        batch = (x[8 * step:8 * step + 8], y[8 * step:8 * step + 8])
        optimizer.zero_grad()
        if strategy is None:
            loss = module.pipeline_loss(model(batch[0]), batch)
            fabric.backward(loss)
        else:
            loss = fabric.strategy.pipeline_step(model, batch)
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses, "eval_loss": eval_loss, "predict": predicted.float(), "forward": forwarded.float(),
            "forward_dtype": str(forwarded.dtype), "refused": refused,
            "params": {name: p.detach().float().clone() for name, p in module.named_parameters()}}


def _pipelined(rank, world):
    from lightning_pp import FabricPipelineStrategy, PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    out = {}
    for precision in PRECISIONS:
        strategy = PipelineStrategy(pipeline_parallel_size=2, num_microbatches=2)
        out[("trainer", precision)] = _trainer_run(precision, world, strategy)
        out[("fabric", precision)] = _fabric_run(precision, FabricPipelineStrategy(pipeline_parallel_size=2,
                                                                                   num_microbatches=2))
    return out


def _close(a, b, what, rtol=2e-6, atol=1e-6):
    # Evaluation: the same bfloat16 operations on the same rows (a microbatch's rows are computed as
    # in the whole batch): equal up to the float32 rounding of the loss's sum over microbatches;
    # float32 evaluation of the same model (what an ignored autocast gives) differs by about 1e-4
    # relative here.
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _close_trained(a, b, what):
    # Training: each microbatch's weight gradient is rounded to bfloat16 before the microbatches are
    # summed, where one device rounds the whole batch's once (Megatron's microbatches alike): the
    # gradients differ by bfloat16 rounding, 2**-8 relative, and so do two SGD steps' updates.
    _close(a, b, what, rtol=2e-2, atol=2e-3)


@pytest.mark.timeout(300)
def test_bf16_mixed_and_true_in_every_loop_trainer_and_fabric_equal_one_device():
    reference = {}
    for precision in PRECISIONS:
        reference[("trainer", precision)] = _trainer_run(precision, 1)
        reference[("fabric", precision)] = _fabric_run(precision)
    fp32 = _trainer_run("32-true", 1)
    # the test can tell autocast from none: float32 validation differs from bf16-mixed validation
    assert abs(fp32["validate"] - reference[("trainer", "bf16-mixed")]["validate"]) > 1e-5
    for rank, results in enumerate(run_distributed(_pipelined, 2, timeout=260)):
        for key, expected in reference.items():
            got = results[key]
            # bf16-true computes each loss in bfloat16: a microbatch's mean is rounded to bfloat16
            # (2**-9 relative), where one device rounds the batch's mean once; the means are then
            # combined in float64. Under bf16-mixed the losses are float32.
            loss_rtol = 2.0 ** -8 if key[1] == "bf16-true" else 2e-6
            for field in ("validate", "test", "eval_loss"):
                if field in expected:
                    _close(torch.tensor(got[field]), torch.tensor(expected[field]), f"rank {rank} {key} {field}",
                           rtol=loss_rtol)
            _close(got["predict"], expected["predict"], f"rank {rank} {key} predict")
            if "forward" in expected:
                _close(got["forward"], expected["forward"], f"rank {rank} {key} forward")
                assert got["forward_dtype"] == expected["forward_dtype"], key
                assert "fabric.strategy.pipeline_step(model, batch)" in got["refused"], got["refused"]
            if "losses" in expected:
                _close(torch.tensor(got["losses"][0]), torch.tensor(expected["losses"][0]), f"rank {rank} {key} loss 0",
                       rtol=loss_rtol)
                _close_trained(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), f"rank {rank} {key} losses")
            else:
                _close_trained(torch.tensor(got["fit_val_loss"]), torch.tensor(expected["fit_val_loss"]),
                               f"rank {rank} {key} fit_val_loss")
            for name, value in got["params"].items():
                _close_trained(value, expected["params"][name], f"rank {rank} {key} {name}")
