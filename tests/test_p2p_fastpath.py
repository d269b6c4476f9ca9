"""The header-free fast path: taken when a step repeats the last step's microbatch shapes, and a
boundary whose shape depends on the data (not on the batch shapes) is named, with the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import DistributedFailure, run_distributed


class DataDependentWidth(nn.Module):
    """Output width changes every call (a stand-in for data-dependent shapes)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.proj(x)[:, : 4 - (self.calls // 2) % 2]


class Pad(nn.Module):
    def forward(self, x):
        return nn.functional.pad(x, (0, 4 - x.shape[1])).sum(dim=1, keepdim=True)


class Net(nn.Module):
    def __init__(self, dynamic: bool):
        super().__init__()
        self.a = DataDependentWidth() if dynamic else nn.Linear(4, 4)
        self.b = Pad()

    def pipeline_layers(self):
        return [self.a, self.b]

    def pipeline_loss(self, out, batch):
        return out.pow(2).mean()


def _run(rank, world, dynamic, static_shapes):
    from lightning_pp.runtime import build_pipeline

    torch.manual_seed(0)
    executor = build_pipeline(Net(dynamic), pipeline_parallel_size=2, num_microbatches=2, static_shapes=static_shapes)
    fast = []
    for _ in range(3):
        executor.train_step((torch.ones(4, 4),))
        fast.append(executor.p2p.fast)
    return fast


@pytest.mark.timeout(120)
def test_repeated_shapes_take_the_fast_path():
    for fast in run_distributed(_run, 2, False, True, timeout=100):
        assert fast == [False, True, True]


@pytest.mark.timeout(120)
def test_data_dependent_boundary_shapes_are_named_and_static_shapes_false_handles_them():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_run, 2, True, True, timeout=100)
    assert "static_shapes=False" in info.value.errors[0]
    for fast in run_distributed(_run, 2, True, False, timeout=100):
        assert fast == [False, False, False]
