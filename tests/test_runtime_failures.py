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
