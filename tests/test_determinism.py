"""Determinism on CPU: with a fixed seed two launches give bitwise-identical losses and parameters
(even with different hash seeds), and every schedule gives the same losses to 1e-6."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models import ToyRegressor

STEPS = 3
# (schedule, virtual_pipeline_size); 10 samples over 4 microbatches makes them uneven (3, 3, 2, 2).
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("combined_1f1b", 1), ("combined_1f1b", 2)]


def _train_every_schedule(rank, world):
    from lightning_pp.runtime import build_pipeline

    out = {}
    for schedule, vp in SCHEDULES:
        torch.manual_seed(1234)
        model = ToyRegressor(blocks=6)  # float32, as users train
        executor = build_pipeline(model, pipeline_parallel_size=world, virtual_pipeline_size=vp,
                                  num_microbatches=4, schedule=schedule)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(99)
        losses = []
        for _ in range(STEPS):
            batch = (torch.randn(10, 5, generator=data), torch.randn(10, 3, generator=data))
            optimizer.zero_grad()
            losses.append(float(executor.train_step(batch).loss))
            optimizer.step()
        names = executor.partition.parameter_names
        out[f"{schedule}/vp{vp}"] = (losses, {names[id(p)]: p.detach().clone() for p in model.parameters()})
        executor.close()
    return out


@pytest.fixture(scope="module")
def two_launches():
    runs = []
    with pytest.MonkeyPatch.context() as patch:
        for hash_seed in ("1", "2"):  # set/dict iteration order of strings differs between them
            patch.setenv("PYTHONHASHSEED", hash_seed)
            runs.append(run_distributed(_train_every_schedule, 2, timeout=150, start_method="spawn"))
    return runs


@pytest.mark.timeout(300)
def test_two_launches_are_bitwise_identical(two_launches):
    first, second = two_launches
    for rank in range(2):
        for key, (losses, params) in first[rank].items():
            other_losses, other_params = second[rank][key]
            assert losses == other_losses, f"{key}, rank {rank}"
            for name, value in params.items():
                assert torch.equal(value, other_params[name]), f"{key}, rank {rank}, {name}"
    assert first[0]["1f1b/vp1"][0] == first[1]["1f1b/vp1"][0]  # every rank reports the same loss


@pytest.mark.timeout(300)
def test_every_schedule_gives_the_same_losses(two_launches):
    per_rank = two_launches[0]
    for rank in range(2):
        reference = per_rank[rank]["1f1b/vp1"][0]
        for key, (losses, _) in per_rank[rank].items():
            assert losses == pytest.approx(reference, rel=1e-6, abs=0), key
