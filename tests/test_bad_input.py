"""Bad input through the real pipeline on 2 processes: every rank fails, within a bounded time,
with a message that names the problem, and no rank hangs.

Configuration errors are found before any communication, identically on every rank. Errors in the
middle of a step (a layer returning a non-tensor, a loss that is not a scalar) happen on one rank;
here that rank's process stays alive (as under a driver that catches the exception), so the peer
learns of it only through its own timeout and the failure board: the strictest case. A stage output
that changes dtype or rank between microbatches is caught on both sides of the boundary at once
(once a step repeats its shapes and sends without headers, by the sender, and the receiver learns
it through the board).

One spawn runs every case, each in a fresh process group; the tests check each case.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from models import ToyRegressor

TIMEOUT_S = 2.0  # pipeline timeout of the mid-step cases: how long the peer of an alive failing rank waits


class ScalarlessRegressor(ToyRegressor):
    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1], reduction="none")  # per element: not a scalar


def _boundary_layer(model):
    return model.blocks[0]  # last layer of stage 0 with pp=2 and 4 layers


def _change_at_microbatch_1(model, change, step=0):
    """``change`` the boundary output of microbatch 1 in step ``step``."""
    from lightning_pp.runtime.context import current

    layer = _boundary_layer(model)
    original = layer.forward
    seen = {"steps": -1}

    def forward(x):
        out = original(x)
        if current().microbatch == 0:
            seen["steps"] += 1
        return change(out) if current().microbatch == 1 and seen["steps"] == step else out

    layer.forward = forward


def _case(name):
    """(model, build_pipeline kwargs) of a case; the model is made after seeding."""
    torch.manual_seed(0)
    base = dict(pipeline_parallel_size=2, num_microbatches=2,
                timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if name == "layout_sum":
        return ToyRegressor(blocks=6), dict(base, layout=[3, 4])
    if name == "virtual_unfillable":
        return ToyRegressor(blocks=1), dict(base, virtual_pipeline_size=2, schedule="interleaved")
    if name == "microbatches_negative":
        return ToyRegressor(blocks=2), dict(base, num_microbatches=-1)
    if name == "microbatches_vs_schedule":
        return ToyRegressor(blocks=6), dict(base, virtual_pipeline_size=2, schedule="interleaved", num_microbatches=3)
    model = ScalarlessRegressor(blocks=2) if name == "loss_not_scalar" else ToyRegressor(blocks=2)
    if name == "non_tensor_output":
        _change_at_microbatch_1(model, lambda out: {"hidden": out})
    elif name == "dtype_change":
        _change_at_microbatch_1(model, lambda out: out.double())
    elif name == "rank_change":
        _change_at_microbatch_1(model, lambda out: out.unsqueeze(1))
    elif name == "dtype_change_repeated_shapes":
        # the second step repeats the first one's shapes, so it sends without headers
        _change_at_microbatch_1(model, lambda out: out.double(), step=1)
    return model, base


CASES = ["layout_sum", "virtual_unfillable", "microbatches_negative", "microbatches_vs_schedule",
         "non_tensor_output", "loss_not_scalar", "dtype_change", "rank_change", "dtype_change_repeated_shapes"]


def _all_cases(rank, world, ports):
    import torch.distributed as dist

    from lightning_pp.runtime import build_pipeline

    results = {}
    for name, port in zip(CASES, ports):
        # A fresh process group (and store, hence failure board) per case: a failed step leaves
        # its groups unusable (gloo closes every connection of a group whose receive timed out).
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model, kwargs = _case(name)
        start = time.monotonic()
        try:
            executor = build_pipeline(model, **kwargs)
            for _ in range(2):
                executor.train_step((torch.randn(8, 5), torch.randn(8, 3)))
            outcome = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            outcome = f"{type(exc).__name__}: {exc}"
        results[name] = (outcome, time.monotonic() - start)
    return results


@pytest.fixture(scope="module")
def outcomes():
    from distributed import free_port

    return run_distributed(_all_cases, 2, [free_port() for _ in CASES], timeout=150)


EXPECTED = {
    "layout_sum": ("layout=[3, 4] sums to 7 layers, but pipeline_layers() returns 8", 1.0),
    "virtual_unfillable": ("the model has 3 pipeline layers, too few for 4 virtual stages", 1.0),
    "microbatches_negative": ("num_microbatches=-1 is invalid: it must be a positive integer", 1.0),
    "microbatches_vs_schedule": ("num_microbatches=3 is invalid for schedule='interleaved' with pp=2", 1.0),
    "non_tensor_output": ("virtual stage 0 (layers 0..1) returned a dict; between pipeline stages a layer must "
                          "return a tensor or a tuple of tensors", TIMEOUT_S + 3),
    "loss_not_scalar": ("pipeline_loss returned (4, 3): it must return a scalar tensor", TIMEOUT_S + 3),
    "dtype_change": ("activations into virtual stage 1: microbatch 1 carries float64 2-D but microbatch 0 of "
                     "this step carried float32 2-D", 1.0),
    "rank_change": ("activations into virtual stage 1: microbatch 1 carries float32 3-D but microbatch 0 of "
                    "this step carried float32 2-D", 1.0),
    "dtype_change_repeated_shapes": ("activations into virtual stage 1: microbatch 1 carries float64 2-D but "
                                     "microbatch 0 of this step carried float32 2-D", TIMEOUT_S + 3),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_every_rank_quickly_with_the_message(outcomes, case):
    needle, bound = EXPECTED[case]
    for rank, results in enumerate(outcomes):
        message, elapsed = results[case]
        assert needle in message, f"rank {rank}: {message}"
        assert elapsed < bound, f"rank {rank} took {elapsed:.1f}s to fail"
        if case in ("non_tensor_output", "loss_not_scalar") and rank != (0 if case == "non_tensor_output" else 1):
            assert "PipelineError" in message and "failed" in message  # learnt from the failing rank
        if case in ("dtype_change", "rank_change"):  # both sides found it themselves
            assert message.startswith("StageBoundaryError"), message
        if case == "dtype_change_repeated_shapes" and rank == 1:  # no header to check: the board tells it
            assert message.startswith("PipelineError"), message
