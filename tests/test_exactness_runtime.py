"""Cases outside the project's own habits where a pipeline used to train a different model than one
device, through the runtime (``build_pipeline``): tied weights listed in different orders on
different stages, parameters that get no gradient, batches holding per-sample Python lists, and
batches smaller than the microbatch count. Each is compared with plain one-device training
(losses, every step's gradients including which ones are ``None``, final AdamW parameters)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from exactness_models import (
    MirrorAutoencoder,
    NoGradNet,
    RaggedTargets,
    TieNet,
    compare,
    pipelined_steps,
    plain_batches,
    ragged_batches,
    reference_steps,
)


def make_model(case):
    torch.manual_seed(7)
    kind = case["model"]
    if kind == "mirror":
        return MirrorAutoencoder(case.get("dims", (6, 5, 4, 3))).double()
    if kind == "ties":
        return TieNet(case["layers"], case["ties"]).double()
    if kind == "nograd":
        return NoGradNet(stop_after=case.get("stop_after")).double()
    if kind == "ragged":
        return RaggedTargets().double()
    raise ValueError(kind)


def make_batches(case):
    kind, batch = case["model"], case["batch"]
    if kind == "ragged":
        return ragged_batches(3, batch)
    sizes = batch if isinstance(batch, (list, tuple)) else [batch] * 3
    if kind == "mirror":
        dim = case.get("dims", (6, 5, 4, 3))[0]
        return [(x[:, :dim], x[:, :dim] * 0.5) for x, _ in
                (plain_batches(11 + i, size, steps=1, dim_in=dim)[0] for i, size in enumerate(sizes))]
    return [plain_batches(11 + i, size, steps=1)[0] for i, size in enumerate(sizes)]


def _run(rank, world, cases):
    from lightning_pp.runtime import build_pipeline

    out = []
    for case in cases:
        model = make_model(case)
        executor = build_pipeline(model, pipeline_parallel_size=case["pp"], virtual_pipeline_size=case.get("vp", 1),
                                  num_microbatches=case["m"], schedule=case.get("schedule", "1f1b"),
                                  layout=case.get("layout"))
        out.append(pipelined_steps(executor, model, make_batches(case), max_norm=case.get("clip")))
        executor.close()
    return out


def _check_all(cases, per_rank):
    for i, case in enumerate(cases):
        compare(case, reference_steps(make_model(case), make_batches(case), max_norm=case.get("clip")),
                [r[i] for r in per_rank])


# -- tied parameters are matched by global name ----------------------------------------------------
TIES_TWO_RANKS = [
    # encoder i tied to decoder n-1-i: the stages list their copies in opposite orders
    dict(model="mirror", dims=(5, 5, 5, 5), pp=2, m=2, batch=6),  # same shapes: was silently wrong
    dict(model="mirror", pp=2, m=3, batch=7),  # different shapes: the reduction used to abort
    dict(model="mirror", pp=2, vp=2, m=4, schedule="interleaved", batch=8, layout=[1, 2, 2, 1]),
    # three ties of different shapes across non-adjacent virtual stages (pp=2 x vp=2)
    dict(model="ties", layers=6, ties=[[0, 5], [1, 3], [2, 4]], pp=2, vp=2, m=4, schedule="interleaved", batch=8),
    dict(model="ties", layers=6, ties=[[0, 5], [1, 3], [2, 4]], pp=2, vp=2, m=4, schedule="combined_1f1b", batch=8),
]

TIES_FOUR_RANKS = [
    # a tie spanning three stages, a second across two, a third inside one stage
    dict(model="ties", layers=6, ties=[[0, 2, 5], [1, 5], [3, 4]], pp=4, m=4, batch=8),
    dict(model="ties", layers=6, ties=[[5, 0], [4, 1], [3, 2]], pp=4, m=5, batch=9),  # every tie mirrored
]

TIES_DATA_PARALLEL = [  # world 4: pp=2 x dp=2
    dict(model="mirror", dims=(5, 5, 5, 5), pp=2, m=2, batch=8),
    dict(model="ties", layers=6, ties=[[0, 5], [1, 3], [2, 4]], pp=2, vp=2, m=2, schedule="interleaved", batch=8),
]


@pytest.mark.timeout(200)
def test_ties_in_any_order_match_one_device():
    per_rank = run_distributed(_run, 2, TIES_TWO_RANKS, timeout=180)
    _check_all(TIES_TWO_RANKS, per_rank)


@pytest.mark.timeout(200)
def test_ties_across_three_stages_and_with_data_parallel_match_one_device():
    per_rank = run_distributed(_run, 4, TIES_FOUR_RANKS, timeout=180)
    _check_all(TIES_FOUR_RANKS, per_rank)
    per_rank = run_distributed(_run, 4, TIES_DATA_PARALLEL, timeout=180)
    _check_all(TIES_DATA_PARALLEL, per_rank)


# -- a parameter without a gradient on one device has none here ---------------------------------------
NOGRAD_TWO_RANKS = [
    # layers 0-2 on stage 0, a stop-gradient first on stage 1: stage 0 gets no gradient at all
    dict(model="nograd", stop_after=2, pp=2, m=3, batch=7, layout=[3, 4]),
    dict(model="nograd", stop_after=2, pp=2, m=3, batch=7, layout=[3, 4], clip=0.05),
    dict(model="nograd", stop_after=None, pp=2, vp=2, m=4, schedule="interleaved", batch=8),
    dict(model="nograd", stop_after=2, pp=2, vp=2, m=4, schedule="combined_1f1b", batch=8, layout=[2, 1, 2, 2]),
]

NOGRAD_DATA_PARALLEL = [
    dict(model="nograd", stop_after=2, pp=2, m=2, batch=8, layout=[3, 4]),
    dict(model="nograd", stop_after=None, pp=2, m=2, batch=8, clip=0.05),
]


@pytest.mark.timeout(200)
def test_parameters_without_gradients_keep_none():
    per_rank = run_distributed(_run, 2, NOGRAD_TWO_RANKS, timeout=180)
    _check_all(NOGRAD_TWO_RANKS, per_rank)
    per_rank = run_distributed(_run, 4, NOGRAD_DATA_PARALLEL, timeout=180)
    _check_all(NOGRAD_DATA_PARALLEL, per_rank)
