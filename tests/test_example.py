"""The main job, end to end with tiny settings: the README command's script trains, validates,
checkpoints, resumes and generates through the pipeline."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--hidden", "32", "--blocks", "2", "--context", "16", "--batch-size", "8", "--val-every", "3",
        "--generate", "4", "--no-progress-bar"]


def _run(tmp_path, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe_gpt.py"), *TINY, "--out", str(tmp_path / "out"),
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.timeout(420)
def test_example_trains_checkpoints_resumes_and_generates(tmp_path):
    out = _run(tmp_path, "--max-steps", "3")
    assert re.search(r"unigram baseline: [\d.]+ nats/byte\s+validation loss: [\d.]+", out)
    assert "3 steps in" in out and out.count("\n---\n") == 4  # four generated samples
    last = tmp_path / "out" / "checkpoints" / "last.ckpt"
    assert (last / "meta.pt").is_file()
    (metrics,) = (tmp_path / "out" / "logs").rglob("metrics.csv")
    assert any(row.get("val_loss") for row in csv.DictReader(open(metrics)))

    resumed = _run(tmp_path, "--max-steps", "5", "--resume", str(last))
    assert "5 steps in" in resumed
