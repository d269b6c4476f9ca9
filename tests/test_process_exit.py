"""A job launched the way users launch it (``python train.py``, Lightning's launcher starting the
other ranks) ends cleanly: the process groups are destroyed before the interpreter shuts down.

Lightning destroys them at exit for NCCL only. A gloo group left alive at interpreter shutdown can
abort the process (``terminate called without an active exception``, exit code -6) after a
successful run, as torch documents for ``destroy_process_group``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, sys

    import torch.distributed as dist

    def record():  # registered first, so it runs after every handler Lightning and lightning_pp register
        rank = os.environ.get("LOCAL_RANK", "0")
        with open(os.path.join({out!r}, "rank" + rank + ".txt"), "w") as f:
            f.write("initialized" if dist.is_available() and dist.is_initialized() else "destroyed")

    atexit.register(record)
    sys.path.insert(0, {tests!r})

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_models import PipeRegressor, regression_data
    from lightning_pp import PipelineStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=PipelineStrategy({strategy}))
    trainer.fit(PipeRegressor(), DataLoader(regression_data(32), batch_size=8))
    {after}
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["clean", "user_destroys"])
def test_a_finished_job_destroys_its_process_groups_before_the_interpreter_exits(tmp_path, case):
    after = "dist.destroy_process_group()" if case == "user_destroys" else "pass"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(out=str(tmp_path), tests=str(Path(__file__).parent), after=after,
                                    strategy="pipeline_parallel_size=2, num_microbatches=4"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        state = (tmp_path / f"rank{rank}.txt").read_text()
        assert state == "destroyed", f"rank {rank}: the process group was still {state} at interpreter exit"
