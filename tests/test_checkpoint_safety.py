"""Checkpoint safety: a process killed in the middle of a save leaves the previous checkpoint
loadable (and resumed from by ``ckpt_path="last"``), nothing half-written is picked up, leftovers
are tidied by the next save, and a checkpoint that does not fit the model fails on every rank with
a message naming both layouts."""

from __future__ import annotations

import multiprocessing as mp
from contextlib import nullcontext
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from distributed import DistributedFailure, run_distributed
from lightning_models import PipeRegressor, loader
from lightning_pp.runtime import executor_of

TRAINER = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, use_distributed_sampler=False)


def _strategy():
    from lightning_pp import PipelineStrategy

    return PipelineStrategy(pipeline_parallel_size=2, num_microbatches=4)


def _params(module):
    names = executor_of(module).partition.parameter_names
    return {names[id(p)]: p.detach().clone() for p in module.parameters()}


def _lightning_last(directory: Path) -> list[str]:
    """What ``ckpt_path="last"`` can pick: Lightning's own lookup of ``last*.ckpt``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = type("T", (), {"default_root_dir": str(directory), "loggers": []})()
    return sorted(Path(p).name for p in ModelCheckpoint(dirpath=directory)._find_last_checkpoints(trainer))


def _save_then_die_mid_save(rank, world, directory):
    from torch.distributed.checkpoint import filesystem

    os.environ["LOCAL_RANK"] = str(rank)
    directory = Path(directory)
    torch.manual_seed(0)
    model = PipeRegressor()
    trainer = L.Trainer(devices=world, strategy=_strategy(), max_steps=2, enable_checkpointing=False, **TRAINER)
    trainer.fit(model, loader(8))
    trainer.save_checkpoint(directory / "last.ckpt")
    torch.save(_params(model), directory / f"saved_rank{rank}.pt")

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the interrupted save would hold different weights
    if rank == 1:
        real_write = filesystem._FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            real_write(self, plan, planner).wait()  # this rank's shards are on disk...
            os.kill(os.getpid(), signal.SIGKILL)  # ...and it dies before the save completes

        filesystem._FileSystemWriter.write_data = write_then_die
    trainer.save_checkpoint(directory / "last.ckpt")
    return "the save was not interrupted"


def _resume_last_and_load_a_misfit(rank, world, directory):
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ["LOCAL_RANK"] = str(rank)
    directory = Path(directory)
    torch.manual_seed(7)  # different initial weights: they must all come from the checkpoint
    model = PipeRegressor()
    trainer = L.Trainer(devices=world, strategy=_strategy(), max_steps=2, default_root_dir=str(directory / "run"),
                        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)], **TRAINER)
    trainer.fit(model, loader(8), ckpt_path="last")
    resumed = (trainer.global_step, _params(model))

    try:
        L.Trainer(devices=world, strategy=_strategy(), enable_checkpointing=False, **TRAINER).validate(
            PipeRegressor(blocks=8), loader(8), ckpt_path=str(directory / "last.ckpt"), verbose=False)
        misfit = "loaded"
    except ValueError as exc:
        misfit = str(exc)

    trainer.save_checkpoint(directory / "last.ckpt")  # a later save of the same path tidies up
    return resumed, misfit


@pytest.mark.timeout(300)
def test_killed_save_keeps_the_previous_checkpoint_and_resume_from_last_uses_it(tmp_path):
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_save_then_die_mid_save, 2, str(tmp_path), timeout=150)
    assert info.value.exitcodes[1] == -9, info.value.exitcodes
    partial = tmp_path / ".lightning_pp-partial"
    leftovers = [p.name for p in partial.iterdir() if p.name.startswith("last.ckpt.tmp-")] if partial.is_dir() else []
    assert leftovers, "the interrupted save should have left its temporary directory"
    assert _lightning_last(tmp_path) == ["last.ckpt"]  # the half-written one is not a candidate

    results = run_distributed(_resume_last_and_load_a_misfit, 2, str(tmp_path), timeout=150)
    saved = {}
    for rank in range(2):
        saved.update(torch.load(tmp_path / f"saved_rank{rank}.pt"))
    for rank, ((global_step, params), misfit) in enumerate(results):
        assert global_step == 2, f"rank {rank} did not resume from the previous checkpoint"
        for name, value in params.items():
            assert torch.equal(value, saved[name]), f"rank {rank}: {name}"
        assert "does not fit this model, so it cannot be re-sharded" in misfit, misfit
        assert "model.blocks.6.fc1.weight is missing from the checkpoint" in misfit, misfit
        assert ("saved with layout pp=2 x vp=1 (layers per virtual stage [4, 4], 8 layers), ep=1, dp=1, "
                "world size 2") in misfit, misfit
        assert "this run has layout pp=2 x vp=1 (layers per virtual stage [5, 5], 10 layers)" in misfit, misfit
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name or "partial" in p.name]


# -- the final swap, killed at each instant (single process, forked: no distributed set-up) --------

def _save(path, value):
    from lightning_pp.strategies import checkpoint as ckpt

    ckpt.save(path, {"model": {"weight": torch.full((3,), float(value))}}, {"version": value})


def _load(path):
    from lightning_pp.strategies import checkpoint as ckpt

    shards = {"model": {"weight": torch.zeros(3)}}
    meta = ckpt.load(path, shards)
    return meta["version"], shards["model"]["weight"][0].item()


def _die_in_second_save(path, kill_point):
    from lightning_pp.strategies import checkpoint as ckpt

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    real_exchange, real_replace = ckpt._exchange, os.replace
    if kill_point == "before_swap":
        ckpt._exchange = lambda a, b: die()
    elif kill_point == "after_swap":
        ckpt._exchange = lambda a, b: (real_exchange(a, b), die())
    else:  # a file system without the atomic exchange, killed between its two renames
        renames = []

        def replace_then_die(src, dst):
            real_replace(src, dst)
            renames.append(dst)
            if len(renames) == 1:
                die()

        ckpt._exchange = lambda a, b: False
        ckpt.os.replace = replace_then_die
    _save(path, 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill_point,version", [("before_swap", 1), ("after_swap", 2), ("between_fallback_renames", 1)])
def test_a_save_killed_at_the_swap_leaves_a_complete_checkpoint(tmp_path, kill_point, version):
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    child = mp.get_context("fork").Process(target=_die_in_second_save, args=(path, kill_point))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    recovering = kill_point == "between_fallback_renames"
    with pytest.warns(UserWarning, match="interrupted between its two renames") if recovering else nullcontext():
        assert _load(path) == (version, float(version))
    _save(path, 3)  # the next save restores what it must and removes every leftover
    assert _load(path) == (3, 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _die_before_the_rename(path):
    from lightning_pp.strategies import checkpoint as ckpt

    ckpt.os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
    _save(path, 2)


@pytest.mark.timeout(120)
def test_an_interrupted_requeue_save_is_never_taken_for_a_requeue_checkpoint(tmp_path):
    # Lightning's SLURM requeue saves hpc_ckpt_<n+1>.ckpt, n read from the digits of every name in the
    # folder containing "hpc_ckpt_", and a requeued fit resumes from hpc_ckpt_<n>.ckpt. A save killed
    # before its rename must not add a name to that count.
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    _save(tmp_path / "hpc_ckpt_1.ckpt", 1)
    child = mp.get_context("fork").Process(target=_die_before_the_rename, args=(tmp_path / "hpc_ckpt_2.ckpt",))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert list((tmp_path / ".lightning_pp-partial").iterdir()), "the killed save should have left its directory"
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")  # 1 is the latest
    assert _load(tmp_path / "hpc_ckpt_1.ckpt") == (1, 1.0)
