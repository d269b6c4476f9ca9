"""LightningCLI from the YAML, with the strategy by class path and by registered name. Runs the
real user command (Lightning's own launcher starts the second process)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_cli(tmp_path, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "examples" / "cli.py"), "fit", "--config", str(ROOT / "examples" / "pipeline.yaml"),
           "--trainer.max_steps=4", "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}",
           "--trainer.enable_progress_bar=false",
           "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path}", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train_losses(tmp_path):
    (metrics,) = Path(tmp_path).rglob("metrics.csv")
    rows = list(csv.DictReader(open(metrics)))
    return [float(r["train_loss_step"]) for r in rows if r.get("train_loss_step")]


@pytest.mark.timeout(300)
def test_cli_with_class_path_strategy(tmp_path):
    # Also sets the strategy's own options from the command line, every one build_pipeline takes
    # that a user may need (static_shapes used to be refused by the strategy, though the README and
    # StageBoundaryError prescribe it).
    _run_cli(tmp_path, "--trainer.strategy.init_args.activation_checkpointing=true",
             "--trainer.strategy.init_args.static_shapes=false", "--trainer.strategy.init_args.check_batches=warn",
             "--trainer.strategy.init_args.broadcast_batches=true", "--trainer.strategy.init_args.nonfinite=skip",
             "--trainer.strategy.init_args.pipeline_timeout=0:05:00",
             "--trainer.strategy.init_args.data_parallel_sharding=full",  # one replica per stage: a no-op
             "--trainer.strategy.init_args.compile={backend: aot_eager}")  # torch.compile's keyword arguments
    losses = _train_losses(tmp_path)
    assert losses and all(math.isfinite(loss) and loss > 0 for loss in losses)
    ckpts = list(Path(tmp_path).rglob("*.ckpt"))
    assert ckpts and all((c / "meta.pt").is_file() for c in ckpts)  # sharded directory checkpoints


@pytest.mark.timeout(300)
def test_cli_with_registered_name(tmp_path):
    proc = _run_cli(tmp_path, "--trainer.strategy=pp_1f1b")
    assert _train_losses(tmp_path)
    assert "GLOBAL_RANK: 1" in proc.stdout + proc.stderr
