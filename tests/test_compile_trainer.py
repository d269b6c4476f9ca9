"""``compile=`` with the Trainer, Fabric and LightningCLI's arguments, written as users write them
(Lightning's distributed sampler on, the module's own configure_optimizers): a tied-embedding model
with a short last batch trains under ``zb1p`` with compiled layers as the uncompiled model on one
device (float64, 1e-9), validates, saves a checkpoint an uncompiled pipeline loads, and
PipelineMonitor reports no recompilation after warm-up beyond the stated bound; a
recompilation after warm-up warns naming the function and the guard; bad values are errors naming
the rule. The page is docs/compile.md."""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from distributed import run_distributed
from lightning_models import BATCH, TRAINER, OneDeviceOrder, TiedLM, gathered, tokens

EAGER_KERNELS = {"backend": "aot_eager"}  # torch's eager kernels: the one-device order of operations
SAMPLES = 30  # batches of 4: the last one has 2


def _pipelined(rank, world, ckpt_dir):
    import lightning_pp
    from lightning_pp.callbacks import PipelineMonitor

    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    out = {}
    model = TiedLM()
    monitor = PipelineMonitor(every_n_steps=4, write_trace=False, write_png=False, prog_bar=False)
    strategy = lightning_pp.PipelineStrategy(pipeline_parallel_size=2, num_microbatches=2, schedule="zb1p",
                                             compile=EAGER_KERNELS)
    trainer = L.Trainer(devices=world, max_epochs=2, strategy=strategy, callbacks=[monitor], **TRAINER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(tokens(SAMPLES), batch_size=BATCH))
    out["recompile_warnings"] = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    out["trainer"] = gathered(model)
    out["metrics"] = monitor.history[-1]
    out["val"] = float(trainer.validate(model, DataLoader(tokens(16, seed=2), batch_size=BATCH), verbose=False)[0]["val_loss"])
    out["names"] = set(model.state_dict())
    trainer.save_checkpoint(os.path.join(ckpt_dir, "compiled"))  # read back by an uncompiled pipeline
    plain = L.Trainer(devices=world, strategy=lightning_pp.PipelineStrategy(pipeline_parallel_size=2, num_microbatches=2),
                      **TRAINER)
    out["val_restored"] = float(plain.validate(TiedLM(), DataLoader(tokens(16, seed=2), batch_size=BATCH), verbose=False,
                                               ckpt_path=os.path.join(ckpt_dir, "compiled"))[0]["val_loss"])
    fabric = L.Fabric(accelerator="cpu", devices=world, precision="64-true", strategy=lightning_pp.FabricPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=2, compile=EAGER_KERNELS))
    fabric.launch()
    model = fabric.setup_module(TiedLM())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    for batch in fabric.setup_dataloaders(DataLoader(tokens(), batch_size=BATCH, shuffle=True)):  # distributed, seed 0
        opt.zero_grad()
        fabric.strategy.pipeline_step(model, batch)
        opt.step()
    out["fabric"] = gathered(model._forward_module)
    return out


def _one_device(loader_kwargs, epochs, dataset):
    model = TiedLM()
    trainer = L.Trainer(devices=1, max_epochs=epochs, use_distributed_sampler=False, **TRAINER)
    trainer.fit(model, DataLoader(dataset, batch_size=BATCH, **loader_kwargs))
    return model, trainer


@pytest.mark.timeout(300)
def test_trainer_and_fabric_with_compiled_layers_equal_one_device_uncompiled(tmp_path):
    # Lightning's distributed sampler shuffles a training loader (seed 0, every epoch anew)
    one, trainer = _one_device({"sampler": OneDeviceOrder(tokens(SAMPLES), [1, 1], BATCH)}, 2, tokens(SAMPLES))
    expected = {name: p.detach() for name, p in one.named_parameters()}
    val = float(trainer.validate(one, DataLoader(tokens(16, seed=2), batch_size=BATCH), verbose=False)[0]["val_loss"])
    fabric_one, _ = _one_device({"sampler": OneDeviceOrder(tokens(), [1], BATCH)}, 1, tokens())
    fabric_expected = {name: p.detach() for name, p in fabric_one.named_parameters()}
    seen = set()
    for rank, out in enumerate(run_distributed(_pipelined, 2, str(tmp_path), timeout=280)):
        for what, got, want in (("trainer", out["trainer"], expected), ("fabric", out["fabric"], fabric_expected)):
            for name, value in got.items():
                torch.testing.assert_close(value, want[name], rtol=1e-9, atol=1e-12,
                                           msg=lambda m, w=what, n=name, r=rank: f"{w}: {n} on rank {r}: {m}")
                seen.add((what, name))
        assert out["val"] == pytest.approx(val, rel=1e-9)
        assert out["val_restored"] == pytest.approx(val, rel=1e-9)  # its checkpoint, loaded uncompiled
        assert out["names"] <= set(one.state_dict()), f"state-dict names changed: {out['names']}"
        metrics = out["metrics"]
        assert metrics["pipeline/compiled_graphs"] > 0, metrics
        # the bound: two per compiled function (embedding, block, head): the short last batch (2
        # samples, microbatches of one, a size torch always specialises), then the symbolic graph
        # for every other size from the next epoch's first batch on
        assert metrics["pipeline/recompiles_after_warmup"] <= 6, (metrics, out["recompile_warnings"])
        assert not out["recompile_warnings"], out["recompile_warnings"]
    assert {n for w, n in seen if w == "trainer"} == set(expected)
    assert {n for w, n in seen if w == "fabric"} == set(fabric_expected)


def test_recompilation_after_warmup_warns_naming_function_and_guard():
    from lightning_pp.runtime.compile.watch import CompileWatch
    from lightning_pp.runtime.compile.layers import compile_layer

    class Scaled(torch.nn.Module):  # a class of its own: no other test's cached graphs for its code
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.linear(x))

    block = compile_layer(Scaled().double(), compiler="aot_eager")
    watch = CompileWatch(warmup_steps=1, warn_after=3)
    block(torch.randn(3, 4, dtype=torch.float64))
    watch.pipeline_step_end(1)
    block(torch.randn(2, 3, 4, dtype=torch.float64))  # another rank of input: a guard fails
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once is expected (a new size), no warning
        watch.pipeline_step_end(2)
    block(torch.randn(2, 3, 4, 4, dtype=torch.float64))  # and again: twice is still the bound
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.pipeline_step_end(3)
    block(torch.randn(2, 3, 4, 4, 4, dtype=torch.float64))  # a third time: it keeps recompiling
    expected = r"compiled .*Scaled.forward \(test_compile_trainer.py:\d+\) recompiled at step 4, at 3 steps after"
    with pytest.warns(UserWarning, match=expected):
        watch.pipeline_step_end(4)
    assert watch.metrics()["pipeline/recompiles_after_warmup"] == 3


@pytest.mark.parametrize("value, match", [
    ("yes", r"compile='yes' is invalid: pass False, True"),
    ({"fullgrph": True}, r"fullgrph is not one of the torch.compile keyword arguments.*fullgraph"),
    ({"mode": "max-autotune", "options": {"a": 1}}, r"give mode or options, not both"),
    ({"backend": "aot_eager", "mode": "max-autotune"}, r"mode and options are inductor's; the backend 'aot_eager'"),
])
def test_bad_compile_values_are_errors_naming_the_rule(value, match):
    import lightning_pp

    for make in (lightning_pp.PipelineStrategy, lightning_pp.FabricPipelineStrategy):
        with pytest.raises(ValueError, match=match):
            make(pipeline_parallel_size=2, compile=value)
