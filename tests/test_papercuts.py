"""What a new user trips over before the first pipelined step (issue 32), each answered where they
meet it: an unknown ``pp_*`` name, a layer listed twice, LightingCLI's ``--help`` for the strategy's
options. (The rest is checked in the multi-process run of ``test_eval_methods.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from torch import nn

import lightning_pp
from lightning_pp.runtime.config import option_descriptions
from lightning_pp.runtime.cut.partition import layer_list

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("make", [L.Trainer, L.Fabric], ids=["Trainer", "Fabric"])
def test_an_unknown_pipeline_name_lists_the_pipeline_names(make):
    with pytest.raises(ValueError) as caught:
        make(accelerator="cpu", devices=2, strategy="pp_zbvv")
    message = str(caught.value)
    assert "did you mean 'pp_zbv'" in message
    for name in ("pp_1f1b", "pp_interleaved", "pp_combined_1f1b", "pp_gpipe", "pp_zb1p", "pp_zbv", "pp_dualpipev"):
        assert name in message


class SharedBlockModel(L.LightningModule):
    """A user's first try at a block that runs twice (weights shared between two steps)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def pipeline_layers(self):
        return [self.embed, self.shared, self.shared, self.head]

    def pipeline_loss(self, output, batch):
        return output.sum()


def test_a_module_listed_twice_is_named():
    with pytest.raises(ValueError, match=r"lists the module 'shared' \(Linear\) 2 times, at positions 1, 2"):
        layer_list(SharedBlockModel())


@pytest.mark.timeout(120)
def test_cli_help_describes_every_strategy_option():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "examples" / "cli.py"), "fit", "--trainer.strategy.help", "lightning_pp.PipelineStrategy"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    squeezed = "".join(proc.stdout.split())  # argparse wraps lines (and breaks words at hyphens)
    descriptions = option_descriptions()
    assert set(descriptions) >= {"pipeline_parallel_size", "schedule", "pipeline_timeout", "pipeline_watchdog", "compile"}
    for name, description in descriptions.items():
        assert f"--trainer.strategy.{name}" in proc.stdout
        assert "".join(description.split()) in squeezed, name
    assert lightning_pp.PipelineStrategy.__init__.__doc__.count(":") >= len(descriptions)
