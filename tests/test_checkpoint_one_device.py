"""Checkpoints move between one device and the pipeline, both ways, optimizer included.

A ``.ckpt`` saved by a plain one-device Trainer resumes under the pipeline (weights, loop state,
AdamW moments and learning rate, re-sharded over the stages), and a pipeline checkpoint
directory, consolidated with Lightning's utility, resumes on a plain one-device Trainer. In both
directions the resumed run ends where an uninterrupted one-device run ends (float64, 1e-9). The
same for Fabric: a one-device Fabric file loads into the pipeline, and a pipeline one back."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from distributed import run_distributed
from models import TiedLM
from lightning_pp.runtime import find_executor

STEPS, SAVE_AT = 8, 4  # 4 batches per epoch: the checkpoint is taken at the end of epoch 0
TRAINER = dict(accelerator="cpu", precision="64-true", logger=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
               limit_val_batches=0, max_steps=STEPS)


class TiedLanguageModel(L.LightningModule):
    """TiedLM (embedding shared with the head) inside a LightningModule, its layers one level down
    (``net.*``). AdamW with GPT-style parameter groups: matrices decay, vectors do not."""

    def __init__(self, lr: float = 2e-2, grouped: bool = True):
        super().__init__()
        self.lr, self.grouped = lr, grouped
        self.net = TiedLM(vocab=11, hidden=8, blocks=3)

    def pipeline_layers(self):
        return self.net.pipeline_layers()

    def pipeline_loss(self, logits, batch):
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    def forward(self, tokens):
        return self.net(tokens)

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self):
        if self.grouped:
            groups = [{"params": [p for _, p in self.named_parameters() if p.dim() >= 2], "weight_decay": 0.1},
                      {"params": [p for _, p in self.named_parameters() if p.dim() < 2], "weight_decay": 0.0}]
        else:
            groups = [{"params": list(self.parameters()), "weight_decay": 0.1}]
        opt = torch.optim.AdamW(groups, lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def token_loader(batch_size: int = 8, n: int = 32, seq: int = 6, vocab: int = 11) -> DataLoader:
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return DataLoader(TensorDataset(x, (3 * x + 1) % vocab), batch_size=batch_size, shuffle=False)


# Built in float64: a one-device Trainer restores the weights before precision="64-true" converts
# the module, so a float32 module would round them to float32 (Lightning's order, not ours).
MODELS = {  # (more models cost CI time: the tied one with two parameter groups is the hardest case)
    "tied_lm": (lambda: TiedLanguageModel().double(), token_loader),
}


def _params(module) -> dict[str, torch.Tensor]:
    """Parameters by canonical (one-device) name; on a pipeline rank, this rank's."""
    executor = find_executor(module)
    if executor is None:
        return {n: p.detach().clone() for n, p in module.named_parameters()}
    names = executor.partition.parameter_names
    return {names[id(p)]: p.detach().clone() for p in module.parameters()}


def _lrs(trainer) -> list[float]:
    return [group["lr"] for group in trainer.optimizers[0].param_groups]


def _one_device_fit(kind: str, root: Path, ckpt_path=None, seed: int = 0):
    """A plain one-device Trainer fits STEPS steps (checkpoints every SAVE_AT steps into root)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    make_model, make_loader = MODELS[kind]
    torch.manual_seed(seed)
    model = make_model()
    checkpoints = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=SAVE_AT, save_top_k=-1)
    trainer = L.Trainer(devices=1, callbacks=[checkpoints], default_root_dir=str(root), **TRAINER)
    trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
    return _params(model), _lrs(trainer), trainer.global_step


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """Per model: the uninterrupted one-device run, and its checkpoint after SAVE_AT steps."""
    runs = {}
    for kind in MODELS:
        root = tmp_path_factory.mktemp(f"one_device_{kind}")
        params, lrs, _ = _one_device_fit(kind, root)
        runs[kind] = (root / f"step={SAVE_AT}.ckpt", params, lrs)
    return runs


def _pipeline_strategy():
    from lightning_pp import PipelineStrategy

    return PipelineStrategy(pipeline_parallel_size=2, num_microbatches=4)


def _pipeline_resume(rank, world, kind, ckpt_path, root):
    os.environ["LOCAL_RANK"] = str(rank)
    make_model, make_loader = MODELS[kind]
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = make_model()
    trainer = L.Trainer(devices=world, strategy=_pipeline_strategy(), enable_checkpointing=False,
                        default_root_dir=root, **TRAINER)
    trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
    resumed = (_params(model), _lrs(trainer), trainer.global_step)

    mismatch = None
    if kind == "tied_lm":  # the checkpoint's two parameter groups cannot fill a one-group optimizer
        trainer = L.Trainer(devices=world, strategy=_pipeline_strategy(), enable_checkpointing=False,
                            default_root_dir=root, **TRAINER)
        try:
            trainer.fit(TiedLanguageModel(grouped=False).double(), make_loader(), ckpt_path=ckpt_path)
        except ValueError as exc:
            mismatch = str(exc)
    return resumed, mismatch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(MODELS))
def test_one_device_checkpoint_resumes_under_the_pipeline_with_its_optimizer(one_device, kind, tmp_path):
    ckpt_path, expected, expected_lrs = one_device[kind]
    results = run_distributed(_pipeline_resume, 2, kind, str(ckpt_path), str(tmp_path), timeout=100)
    merged = {}
    for (params, lrs, step), _ in results:
        assert step == STEPS
        assert lrs == pytest.approx(expected_lrs, rel=1e-12)  # restored from the file, then scheduled
        merged.update(params)
    assert set(merged) == set(expected)
    for name, value in merged.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-12, msg=name)
    if kind == "tied_lm":
        for _, mismatch in results:
            assert mismatch is not None, "a checkpoint with other parameter groups was accepted"
            assert "it has 2 parameter group(s), this optimizer 1 (group sizes [7, 12] there, [19] here" in mismatch
            assert "configure_optimizers must build the same parameter groups" in mismatch


def _pipeline_fit_and_save(rank, world, kind, ckpt_dir):
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ["LOCAL_RANK"] = str(rank)
    make_model, make_loader = MODELS[kind]
    torch.manual_seed(0)
    model = make_model()
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=SAVE_AT, save_top_k=-1)
    trainer = L.Trainer(devices=world, strategy=_pipeline_strategy(), callbacks=[checkpoints],
                        default_root_dir=ckpt_dir, **dict(TRAINER, max_steps=SAVE_AT))
    trainer.fit(model, make_loader())
    return trainer.global_step


def _consolidate(directory: Path) -> Path:
    """What ``python -m lightning.pytorch.utilities.consolidate_checkpoint <dir>`` does."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    output = directory.with_name(directory.name + ".consolidated")
    torch.save(_format_checkpoint(_load_distributed_checkpoint(directory)), output)
    return output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(MODELS))
def test_consolidated_pipeline_checkpoint_resumes_on_one_device_with_its_optimizer(one_device, kind, tmp_path):
    one_device_ckpt, expected, expected_lrs = one_device[kind]
    assert run_distributed(_pipeline_fit_and_save, 2, kind, str(tmp_path / "pp"), timeout=100) == [SAVE_AT] * 2
    consolidated = _consolidate(tmp_path / "pp" / f"step={SAVE_AT}.ckpt")

    # The file holds the optimizer as a one-device Trainer saves it (DCP turns the integer keys
    # into strings, so "params" lists the same strings), with the same state to 1e-9.
    saved = torch.load(consolidated, weights_only=False)["optimizer_states"]
    reference = torch.load(one_device_ckpt, weights_only=False)["optimizer_states"]
    assert len(saved) == len(reference) == 1
    (saved,), (reference,) = saved, reference
    assert [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in reference["param_groups"]]
    assert [g["params"] for g in saved["param_groups"]] == \
        [[str(i) for i in g["params"]] for g in reference["param_groups"]]
    assert sorted(saved["state"]) == sorted(str(i) for i in reference["state"])
    for index, state in reference["state"].items():
        assert set(saved["state"][str(index)]) == set(state)
        for key, value in state.items():
            torch.testing.assert_close(saved["state"][str(index)][key], value, rtol=1e-9, atol=1e-12)

    params, lrs, step = _one_device_fit(kind, tmp_path / "resumed", ckpt_path=str(consolidated), seed=1)
    assert step == STEPS
    assert lrs == pytest.approx(expected_lrs, rel=1e-12)
    assert set(params) == set(expected)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-12, msg=name)


# -- Fabric: a one-device Fabric file loads into the pipeline, and back after consolidation ----------
FABRIC_STEPS, FABRIC_SAVE_AT, FABRIC_HANDOVER = 6, 2, 4


def _grouped_adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(module.named_parameters())
    return torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=2e-2)


def _one_device_fabric(first: int, last: int, load=None, save=None):
    """A one-device Fabric loop over steps [first, last) of TiedLM; loads ``load``, saves ``save``
    after step FABRIC_SAVE_AT."""
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="64-true")
    torch.manual_seed(0 if load is None else 1)
    module = TiedLM().double()
    model, optimizer = fabric.setup(module, _grouped_adamw(module))
    if load is not None:
        state = {"model": model, "optimizer": optimizer, "step": None}
        fabric.load(load, state)
        assert state["step"] == first
    for step, (x, y) in enumerate(token_loader()):
        if first <= step < last:
            optimizer.zero_grad()
            fabric.backward(model.pipeline_loss(model(x), (x, y)))
            optimizer.step()
            if save is not None and step + 1 == FABRIC_SAVE_AT:
                fabric.save(save, {"model": model, "optimizer": optimizer, "step": step + 1})
    return _params(module)


def _pipeline_fabric(rank, world, load, save):
    from lightning_pp import FabricPipelineStrategy
    from lightning_pp.strategies.checkpoint import optimizer_state

    os.environ["LOCAL_RANK"] = str(rank)
    fabric = L.Fabric(accelerator="cpu", devices=world, precision="64-true",
                      strategy=FabricPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4))
    fabric.launch()
    torch.manual_seed(1)
    model = fabric.setup_module(TiedLM().double())
    optimizer = fabric.setup_optimizers(_grouped_adamw(model))
    state = {"model": model, "optimizer": optimizer, "step": None}
    fabric.load(load, state)  # the one-device Fabric's file
    loaded = copy.deepcopy(optimizer_state(model, optimizer))  # this rank's part, by one-device index
    for step, batch in enumerate(token_loader()):
        if state["step"] <= step < FABRIC_STEPS:
            optimizer.zero_grad()
            fabric.strategy.pipeline_step(model, batch)
            optimizer.step()
            if step + 1 == FABRIC_HANDOVER:
                fabric.save(save, {"model": model, "optimizer": optimizer, "step": step + 1})
    return _params(model), loaded


@pytest.mark.timeout(120)
def test_one_device_fabric_file_loads_into_the_pipeline_and_back(tmp_path):
    expected = _one_device_fabric(0, FABRIC_STEPS, save=tmp_path / "one_device.pt")
    results = run_distributed(_pipeline_fabric, 2, str(tmp_path / "one_device.pt"), str(tmp_path / "pp"), timeout=100)

    # What each rank loaded is exactly its parameters' part of the one-device optimizer.
    saved = torch.load(tmp_path / "one_device.pt", weights_only=False)["optimizer"]
    loaded_indices = set()
    for _, loaded in results:
        assert loaded["param_groups"] == [dict(g, params=[str(i) for i in g["params"]]) for g in saved["param_groups"]]
        for index, state in loaded["state"].items():
            loaded_indices.add(int(index))
            assert set(state) == set(saved["state"][int(index)])
            assert all(torch.equal(value, saved["state"][int(index)][key]) for key, value in state.items())
    assert loaded_indices == set(saved["state"])  # the tied embedding on both stages, once here

    # Training goes on as on one device. (Parameters agree to 1e-6, not 1e-9: gradients agree to
    # 1e-16, but six AdamW steps at a constant lr amplify that rounding to about 1e-7 here, with or
    # without a checkpoint; a lost optimizer state would move them by about the lr, 2e-2.)
    merged = {name: value for params, _ in results for name, value in params.items()}
    assert set(merged) == set(expected)
    for name, value in merged.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-9, msg=name)

    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    torch.save(_load_distributed_checkpoint(tmp_path / "pp"), tmp_path / "consolidated.pt")
    resumed = _one_device_fabric(FABRIC_HANDOVER, FABRIC_STEPS, load=tmp_path / "consolidated.pt")
    for name, value in resumed.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-9, msg=name)
