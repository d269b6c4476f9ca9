"""A failure on one rank brings every rank down, fast, with a message naming the failed rank."""

from __future__ import annotations

import datetime

import pytest
import torch

from distributed import DistributedFailure, run_distributed
from models import ToyRegressor


class Boom(RuntimeError):
    pass


def _raise_mid_step(rank, world, bad_rank, where):
    from lightning_pp.runtime import build_pipeline

    torch.manual_seed(0)
    model = ToyRegressor(blocks=6)
    executor = build_pipeline(model, pipeline_parallel_size=world, num_microbatches=4,
                              timeout=datetime.timedelta(seconds=30))
    if rank == bad_rank:
        if where == "forward":
            layer = executor.partition.chunks[0].layers[0]

            def broken(*args, **kwargs):
                raise Boom("injected failure in a middle stage's forward")

            layer.forward = broken
        else:
            def broken_loss(output, batch):
                raise Boom("injected failure in the loss")

            executor.loss_fn = broken_loss
    batch = (torch.randn(8, 5), torch.randn(8, 3))
    for _ in range(3):
        executor.train_step(batch)
    return "finished"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_rank,where", [(1, "forward"), (3, "loss")])
def test_one_rank_raising_brings_all_down_naming_it(bad_rank, where):
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_raise_mid_step, 4, bad_rank, where, timeout=90)
    failure = info.value
    assert all(code not in (0, None) for code in failure.exitcodes.values()), failure.exitcodes
    assert failure.elapsed < 60, f"took {failure.elapsed:.1f}s to bring every rank down"
    assert set(failure.errors) == {0, 1, 2, 3}
    for rank, message in failure.errors.items():
        assert f"rank {bad_rank} (pp={bad_rank}, dp=0, ep=0)" in message, f"rank {rank}: {message}"
        assert "injected failure" in message, f"rank {rank} does not carry the original error: {message}"


# -- ranks that die or hang write nothing: peers name them from their published positions ----------

def _misbehave_mid_step(rank, world, victim, how, marker, pp):
    """Three good steps, except that ``victim`` is SIGKILLed (``how="kill"``) or hangs
    (``how="hang"``) half a second into the forward of microbatch 1 of the second step."""
    import os
    import signal
    import time

    from lightning_pp.runtime import WatchdogConfig, build_pipeline
    from lightning_pp.runtime.context import current

    torch.manual_seed(0)
    model = ToyRegressor(blocks=6)
    executor = build_pipeline(
        model, pipeline_parallel_size=pp, num_microbatches=4,
        timeout=datetime.timedelta(seconds=60 if how == "kill" else 3),
        watchdog=WatchdogConfig(heartbeat_interval=0.5, exit_grace=3.0),
    )
    if rank == victim:
        layer = executor.partition.chunks[0].layers[0]
        original = layer.forward

        def misbehaving(*args, **kwargs):
            if executor.steps_done == 1 and current().microbatch == 1:
                time.sleep(0.5)  # well inside the computation: its position has been published
                with open(marker, "w") as f:
                    f.write(str(time.time()))
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(600)  # hang: alive, heartbeating, never progressing
            return original(*args, **kwargs)

        layer.forward = misbehaving
    batch = (torch.randn(8, 5), torch.randn(8, 3))
    for _ in range(3):
        executor.train_step(batch)
    return "finished"


def _assert_all_down_naming(failure, victim, victim_where, needle, marker, bound):
    import time

    from lightning_pp.runtime import WATCHDOG_EXIT_CODE

    since_fault = time.time() - float(open(marker).read())
    assert since_fault < bound, f"the last rank exited {since_fault:.1f}s after the fault"
    assert all(code not in (0, None) for code in failure.exitcodes.values()), failure.exitcodes
    for rank, message in failure.errors.items():
        if rank == victim:
            continue
        assert victim_where in message, f"rank {rank} does not name the victim's position: {message}"
        assert needle in message, f"rank {rank}: {message}"
    return WATCHDOG_EXIT_CODE


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim,named,needle", [
    # a middle stage: peers name it and the action it was killed in, from its published position
    (1, "rank 1 (pp=1, dp=0, ep=0) during F1.0 (microbatch 1, chunk 0, virtual stage 1)",
     "went away without reporting an error"),
    # rank 0 hosts the job's store, which dies with it: nothing can be looked up, so peers say so
    (0, "the job's key-value store is unreachable", "rank 0 (pp=0) has most likely died"),
], ids=["middle_stage", "store_host"])
def test_sigkilled_rank_is_named_by_every_peer(tmp_path, victim, named, needle):
    marker = tmp_path / "killed_at"
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_misbehave_mid_step, 4, victim, "kill", str(marker), 4, timeout=100)
    failure = info.value
    assert failure.exitcodes[victim] == -9
    _assert_all_down_naming(failure, victim, named, needle, marker, bound=20)


@pytest.mark.timeout(120)
def test_stuck_rank_is_named_by_every_peer_and_ended_by_its_watchdog(tmp_path):
    # pp=2 x dp=2: rank 2 (last stage of pipeline 0) hangs. Rank 0 waits for it point-to-point;
    # ranks 1 and 3 finish their own pipeline's schedule and block in the step's all-reduce, a
    # collective with rank 2: every one of them must time out and name rank 2, and rank 2's own
    # watchdog must end it, since its main thread never returns.
    marker = tmp_path / "stuck_at"
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_misbehave_mid_step, 4, 2, "hang", str(marker), 2, timeout=100)
    failure = info.value
    exit_code = _assert_all_down_naming(
        failure, 2, "rank 2 (pp=1, dp=0, ep=0) during F1.0 (microbatch 1, chunk 0, virtual stage 1)",
        "is stuck: it has been computing for", marker, bound=30)
    assert failure.exitcodes[2] == exit_code, failure.exitcodes
