"""An optional dependency never ends a run: ``PipelineMonitor`` without matplotlib (installed without
the ``plot`` extra) warns once and keeps training, tracing and logging; a trace it cannot write
warns and training goes on."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from distributed import run_distributed

# Nothing at module level may import matplotlib (lightning and torchmetrics do, when it is
# installed): the workers import this module before they hide it.

STEPS = 4
TRACE_STEP = 1
HIDDEN = ("matplotlib", "mpl_toolkits")


def _hide_matplotlib(root: Path) -> None:
    """Make this process an environment without the ``plot`` extra: every ``site-packages`` entry of
    ``sys.path`` is replaced by a directory of links to its contents minus matplotlib (its package
    and its distribution metadata), so ``import matplotlib`` raises ``ModuleNotFoundError`` and
    ``importlib.metadata`` does not know it, as where it was never installed. Must run before
    anything imports matplotlib."""
    import importlib
    import importlib.util
    import sys

    assert not any(name.split(".")[0] in HIDDEN for name in sys.modules), \
        "matplotlib was imported before it could be hidden"
    for index, entry in enumerate(list(sys.path)):
        if not entry.endswith("site-packages") or not os.path.isdir(os.path.join(entry, "matplotlib")):
            continue
        filtered = root / f"site-packages-{index}"
        filtered.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(entry):
            if not name.lower().startswith(HIDDEN) and not (filtered / name).exists():
                (filtered / name).symlink_to(os.path.join(entry, name))
        sys.path[index] = str(filtered)
    importlib.invalidate_caches()
    assert importlib.util.find_spec("matplotlib") is None


def _fit_with_monitor(rank, world, log_root, case):
    if case == "no_matplotlib":
        _hide_matplotlib(Path(log_root) / f"env-rank{rank}")
    import warnings

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    import torch
    from lightning_models import PipeRegressor, loader

    from lightning_pp import PipelineMonitor, PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    dirpath = None
    if case == "unwritable":
        dirpath = Path(log_root) / "not_a_directory"
        dirpath.write_text("a file where the monitor's directory should be")
    monitor = PipelineMonitor(every_n_steps=1, trace_step=TRACE_STEP, dirpath=dirpath)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=STEPS, callbacks=[monitor],
        strategy=PipelineStrategy(pipeline_parallel_size=2, num_microbatches=4),
        logger=CSVLogger(log_root, name="logs", version=0), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every warning: "once" must be the monitor's doing
        trainer.fit(PipeRegressor(), loader(8, n=8 * STEPS))
    import sys

    return {
        "global_step": trainer.global_step,
        "history": list(monitor.history),
        "written": [str(p) for p in monitor.written],
        "log_dir": trainer.log_dir,
        "warnings": [str(w.message) for w in caught],
        "matplotlib_loaded": "matplotlib" in sys.modules,
    }


def _logged_metrics(log_dir: str) -> set:
    with open(Path(log_dir) / "metrics.csv") as f:
        return {name for row in csv.DictReader(f) for name, value in row.items() if value not in ("", None)}


@pytest.mark.timeout(200)
def test_monitor_without_matplotlib_warns_once_and_keeps_training(tmp_path):
    per_rank = run_distributed(_fit_with_monitor, 2, str(tmp_path), "no_matplotlib", timeout=180, start_method="spawn")
    zero = per_rank[0]
    for rank, result in enumerate(per_rank):
        assert result["global_step"] == STEPS, f"rank {rank} stopped at step {result['global_step']}"
        assert not result["matplotlib_loaded"]
        assert len(result["history"]) == STEPS  # every step analysed, on every rank
    log_dir = Path(zero["log_dir"])
    trace = log_dir / f"pipeline_trace_step{TRACE_STEP}.json"
    assert trace.is_file() and trace.stat().st_size > 0
    assert [Path(p) for p in zero["written"]] == [trace]
    assert not list(tmp_path.rglob("*.png")), "a picture was written without matplotlib"
    assert {"pipeline/bubble", "pipeline/ideal_bubble", "pipeline/step_ms"} <= _logged_metrics(log_dir)
    about = [w for w in zero["warnings"] if "matplotlib" in w]
    assert len(about) == 1, zero["warnings"]
    assert "lightning_pp[plot]" in about[0], about[0]
    assert not [w for w in per_rank[1]["warnings"] if "matplotlib" in w]  # rank zero warns


@pytest.mark.timeout(200)
def test_monitor_that_cannot_write_its_files_warns_and_keeps_training(tmp_path):
    per_rank = run_distributed(_fit_with_monitor, 2, str(tmp_path), "unwritable", timeout=180)
    zero = per_rank[0]
    for rank, result in enumerate(per_rank):
        assert result["global_step"] == STEPS, f"rank {rank} stopped at step {result['global_step']}"
        assert len(result["history"]) == STEPS
    assert zero["written"] == []
    assert {"pipeline/bubble", "pipeline/step_ms"} <= _logged_metrics(zero["log_dir"])
    about = [w for w in zero["warnings"] if "not_a_directory" in w]
    assert len(about) == 1, zero["warnings"]
