"""A failure outside the pipeline step (a user hook, the data pipeline, the training loop) on one
rank: every rank's error names the rank that raised and its error, as for a failure inside the step."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from distributed import DistributedFailure, free_port, run_distributed
from lightning_models import PipeRegressor, regression_data

BAD_RANK = 1
ORIGIN = "rank 1 (pp=1, dp=0, ep=0)"


def _mark(marker: str) -> None:
    with open(marker, "w") as f:
        f.write(str(time.time()))


class HookRaises(PipeRegressor):
    """Raises in ``on_train_batch_end`` of batch 1 on global rank 1, after a good step."""

    marker = ""
    failing_ranks = (BAD_RANK,)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank in self.failing_ranks and batch_idx == 1:
            _mark(self.marker)
            raise ValueError(f"boom from rank {self.global_rank} in on_train_batch_end")


class FailingDataset(Dataset):
    """The regression data; reading the first row of the third batch raises on global rank 1."""

    def __init__(self, rank: int, batch_size: int, marker: str) -> None:
        self.data = regression_data(48)
        self.rank, self.bad_index, self.marker = rank, 2 * batch_size, marker

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        if self.rank == BAD_RANK and index == self.bad_index:
            _mark(self.marker)
            raise ValueError(f"boom from rank {BAD_RANK} reading sample {index}")
        return self.data[index]


class SlowOnException(L.Callback):
    """A user's ``on_exception`` that takes its time (e.g. writing diagnostics) on rank 0."""

    def on_exception(self, trainer, pl_module, exception):
        if trainer.global_rank == 0:
            time.sleep(5.0)


def _fit(rank, world, case, marker):
    import lightning_pp  # noqa: F401  (registers the strategy)
    from lightning_pp import PipelineStrategy
    from lightning_pp.runtime import WatchdogConfig

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    batch_size, callbacks = 8, []
    strategy = dict(pipeline_parallel_size=2, num_microbatches=4, pipeline_timeout=datetime.timedelta(seconds=10))
    if case in ("hook", "slow_handler"):
        model = HookRaises()
        model.marker = marker
        data = DataLoader(regression_data(48), batch_size=batch_size, shuffle=False)
        if case == "slow_handler":
            # Both ranks raise; rank 1 records itself at once, rank 0 spends 5 s in a user's
            # on_exception first. Rank 0's watchdog sees rank 1's record within 0.5 s and, were
            # rank 0 not handling its own exception, would end it 1 s later.
            model.failing_ranks = (0, BAD_RANK)
            callbacks.append(SlowOnException())
            strategy.update(pipeline_watchdog=WatchdogConfig(heartbeat_interval=0.5, exit_grace=1.0))
    else:
        model = PipeRegressor()
        workers = 1 if case == "dataset_worker" else 0
        if workers:
            # run_distributed starts its ranks as daemon processes, which multiprocessing forbids to
            # have children; a launched rank (torchrun, Lightning's launcher) is not a daemon.
            import multiprocessing

            multiprocessing.current_process().daemon = False
        data = DataLoader(FailingDataset(rank, batch_size, marker), batch_size=batch_size, shuffle=False,
                          num_workers=workers)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False, callbacks=callbacks, strategy=PipelineStrategy(**strategy),
    )
    trainer.fit(model, data)
    return "finished"


def _since(marker: Path) -> float:
    return time.time() - float(marker.read_text())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case,needle,where", [
    ("hook", "boom from rank 1 in on_train_batch_end", "HookRaises.on_train_batch_end"),
    ("dataset_worker", "boom from rank 1 reading sample 16", "loading a batch (DataLoader)"),
])
def test_failure_outside_the_step_is_named_on_every_rank(tmp_path, case, needle, where):
    marker = tmp_path / "raised_at"
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_fit, 2, case, str(marker), timeout=120)
    failure = info.value
    assert _since(marker) < 30, f"the last rank exited {_since(marker):.1f}s after rank 1 raised"
    assert set(failure.errors) == {0, 1}, failure
    assert failure.exitcodes == {0: 1, 1: 1}, failure.exitcodes  # raised, not ended by a watchdog
    for rank, message in failure.errors.items():
        assert f"{ORIGIN} failed outside the pipeline step (in {where})" in message, f"rank {rank}: {message}"
        assert needle in message, f"rank {rank} does not carry rank 1's error: {message}"
    # Rank 0 never presents itself as the rank that failed.
    own = failure.errors[0]
    assert "rank 0 (pp=0, dp=0, ep=0) failed" not in own and "failed on rank 0" not in own, own


@pytest.mark.timeout(150)
def test_watchdog_spares_a_rank_handling_its_own_exception(tmp_path):
    marker = tmp_path / "raised_at"
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_fit, 2, "slow_handler", str(marker), timeout=120)
    failure = info.value
    # Rank 0 ran its slow on_exception to the end and raised its own error; its watchdog did not
    # end it (exit code 70) although another rank's failure was on the board for 4.5 s.
    assert failure.exitcodes == {0: 1, 1: 1}, failure.exitcodes
    own = failure.errors[0]
    assert "boom from rank 0 in on_train_batch_end" in own, own
    assert "rank 0 (pp=0, dp=0, ep=0) failed outside the pipeline step (in HookRaises.on_train_batch_end), " \
           "after another failure was recorded: rank 1 (pp=1, dp=0, ep=0) failed outside the pipeline step" in own, own
    assert "boom from rank 1 in on_train_batch_end" in own, own


# -- Fabric: no on_exception hook; an uncaught exception goes through sys.excepthook ---------------

FABRIC_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import lightning as L
    import lightning_pp
    from lightning_models import PipeRegressor, loader

    torch.set_num_threads(1)
    strategy = lightning_pp.FabricPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(PipeRegressor())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step, batch in enumerate(loader(8)):
        opt.zero_grad()
        loss = fabric.strategy.pipeline_step(model, batch)
        opt.step()
        if step == 1 and fabric.global_rank == 1:
            raise ValueError("boom from rank 1 between steps")
        if step == 1:
            fabric.barrier()  # a collective outside the step: rank 1 never joins it
""")


@pytest.mark.timeout(150)
def test_fabric_uncaught_exception_outside_the_step_is_named_on_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(FABRIC_SCRIPT.format(tests=str(Path(__file__).parent)))
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", NODE_RANK="0", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    codes = [proc.returncode for proc in procs]
    assert codes == [1, 1], (codes, outputs)
    for rank, output in enumerate(outputs):
        assert f"{ORIGIN} failed outside the pipeline step" in output, f"rank {rank}: {output}"
        assert "boom from rank 1 between steps" in output, f"rank {rank}: {output}"
    assert "rank 0 (pp=0, dp=0, ep=0) failed" not in outputs[0], outputs[0]


# -- the pieces, in one process --------------------------------------------------------------------

def test_communication_errors_summaries_and_the_exception_being_handled():
    from lightning_pp.runtime.failure.errors import PipelineCommError
    from lightning_pp.runtime.failure.outside_step import is_comm_error, summarize
    from lightning_pp.runtime.failure.watchdog import main_thread_exception

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    assert is_comm_error(gloo) and is_comm_error(PipelineCommError("receiving F0.1 timed out", reason="timeout"))
    assert not is_comm_error(ValueError("boom")) and not is_comm_error(RuntimeError("CUDA out of memory"))
    try:
        try:
            raise gloo
        except RuntimeError as err:
            raise KeyError("raised while handling it") from err
    except KeyError as err:
        assert is_comm_error(err)  # caused by one
        assert main_thread_exception() is err  # what the watchdog sees while a rank unwinds
    assert main_thread_exception() is None
    worker = ValueError("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                        "last):\n  File \"data.py\", line 3, in __getitem__\n    raise ValueError('bad row 16')\n"
                        "ValueError: bad row 16\n")
    assert summarize(worker) == ("ValueError: Caught ValueError in DataLoader worker process 0. "
                                 "ValueError: bad row 16")
