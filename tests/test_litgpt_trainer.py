"""litgpt's GPT through the ready LightningModule (``LitGPT``) and ``Trainer.fit``, as a user runs it:
built on the meta device in ``configure_model``, each rank materialising only the layers it keeps,
trained equal to the same LightningModule on one device; its state dict keys are litgpt's; a
litgpt checkpoint (``lit_model.pth``) made on one device loads into the pipelined model."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

pytest.importorskip("litgpt")

from distributed import run_distributed  # noqa: E402
from lightning_pp.runtime import executor_of

CONFIG = dict(n_layer=4, n_embd=32, n_head=4, block_size=32, padded_vocab_size=64, vocab_size=64, intermediate_size=64)
TRAINER = dict(accelerator="cpu", precision="64-true", max_steps=4, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2)


def _data(n=32, seq=12):
    g = torch.Generator().manual_seed(2)
    return list(torch.randint(0, 64, (n, seq + 1), generator=g))  # pretraining samples: T + 1 tokens


def _model(**kwargs):
    from lightning_pp.integrations.litgpt import LitGPT

    class Recorded(LitGPT):
        """Keeps a reference to every block as configure_model built it (on the meta device)."""

        def configure_model(self):
            super().configure_model()
            self.built_blocks = list(self.model.transformer.h)

    return Recorded(name="pythia-14m", config=CONFIG, learning_rate=0.01, **kwargs)


def _one_device(tmp):
    torch.manual_seed(0)
    model = _model()
    trainer = L.Trainer(devices=1, **TRAINER)
    # the order Lightning's distributed sampler gives the pipelined run (see README, exactness)
    data = _data()
    trainer.fit(model, DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0)),
                DataLoader(_data(8), batch_size=4))
    path = os.path.join(tmp, "lit_model.pth")
    torch.save(model.model.state_dict(), path)  # litgpt's checkpoint format
    validated = L.Trainer(devices=1, **TRAINER).validate(_model(checkpoint=path), DataLoader(_data(8), batch_size=4),
                                                         verbose=False)
    return ({n: p.detach().clone() for n, p in model.named_parameters()}, set(model.state_dict()),
            validated[0]["val_loss"], path)


def _pipelined(rank, world, path):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = _model()
    trainer = L.Trainer(devices=world, strategy=PipelineStrategy(num_microbatches=2), **TRAINER)
    trainer.fit(model, DataLoader(_data(), batch_size=4), DataLoader(_data(8), batch_size=4))
    names = executor_of(model).partition.parameter_names
    params = {names[id(p)]: p.detach().clone() for p in model.parameters() if id(p) in names}
    kept = [i for i, block in enumerate(model.built_blocks) if not any(p.is_meta for p in block.parameters())]
    real = all(not p.is_meta and p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    keys = set(model.state_dict())
    # a one-device litgpt checkpoint, loaded with mmap into a pipelined model (each rank its own part)
    validated = L.Trainer(devices=world, strategy=PipelineStrategy(num_microbatches=2), **TRAINER).validate(
        _model(checkpoint=path), DataLoader(_data(8), batch_size=4), verbose=False)
    return params, kept, real, keys, validated[0]["val_loss"]


@pytest.mark.timeout(240)
def test_litgpt_module_built_on_meta_trains_as_one_device_and_loads_litgpt_checkpoints(tmp_path):
    ref_params, ref_keys, ref_val, path = _one_device(str(tmp_path))
    per_rank = run_distributed(_pipelined, 2, path, timeout=200)
    seen, keys = set(), set()
    for rank, (params, kept, real, rank_keys, val_loss) in enumerate(per_rank):
        # materialised: only this rank's stage (2 of the 4 blocks), with real storage
        assert kept == ([0, 1] if rank == 0 else [2, 3]), (rank, kept)
        assert real
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-9, atol=1e-12, msg=f"{name} on rank {rank}")
            seen.add(name)
        keys |= rank_keys
        assert val_loss == pytest.approx(ref_val, rel=1e-9)
    assert seen == set(ref_params)
    assert keys == ref_keys  # the one-device (litgpt) names, no key map


@pytest.mark.timeout(240)
def test_litgpt_example_makes_a_checkpoint_and_fine_tunes_it_from_lightningcli(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    checkpoint = tmp_path / "litgpt" / "lit_model.pth"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(root / "examples" / "litgpt_finetune.py"), "fit", "--config",
           str(root / "examples" / "litgpt.yaml"), f"--model.init_args.checkpoint={checkpoint}",
           "--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
           "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert checkpoint.is_file() and (checkpoint.parent / "model_config.yaml").is_file()
    assert "validation loss (nats/byte):" in out and "after fine-tuning" in out
