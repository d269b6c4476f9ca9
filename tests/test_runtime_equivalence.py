"""The runtime's core promise: a pipelined step gives the same loss and gradients as the same
step on one device, for every schedule, layout, microbatch count and data-parallel size."""

from __future__ import annotations

import pytest
import torch

from models import Block, TiedLM, ToyRegressor, TupleBoundaryNet, pipelined_run, reference_run
from distributed import run_distributed

STEPS = 3


def regression_batches(seed, batch, steps=STEPS, dim_in=5, dim_out=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, dim_in, generator=g, dtype=torch.float64),
             torch.randn(batch, dim_out, generator=g, dtype=torch.float64)) for _ in range(steps)]


def token_batches(seed, batch, seq_lens, vocab=11, pad_some=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in seq_lens:
        tokens = torch.randint(0, vocab, (batch, t), generator=g)
        targets = torch.randint(0, vocab, (batch, t), generator=g)
        if pad_some:  # ignored positions make per-microbatch token counts uneven
            targets[torch.rand(batch, t, generator=g) < 0.3] = -1
        out.append((tokens, targets))
    return out


def masked_batches(seed, batch, steps=STEPS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=g, dtype=torch.float64),
             torch.randn(batch, 2, generator=g, dtype=torch.float64),
             (torch.rand(batch, 1, generator=g) > 0.2).to(torch.float64)) for _ in range(steps)]


def make_model(kind):
    torch.manual_seed(1234)
    if kind == "regressor":
        return ToyRegressor(blocks=6).double()
    if kind in ("reentrant", "non_reentrant"):  # activation checkpointing inside the layers
        return ToyRegressor(blocks=6, checkpoint=kind).double()
    if kind == "tied":
        return TiedLM(blocks=4).double()
    if kind == "tied_sum":
        return TiedLM(blocks=4, token_sum=True).double()
    if kind == "tuple":
        return TupleBoundaryNet(blocks=4).double()
    raise ValueError(kind)


def make_batches(kind, batch):
    if kind in ("regressor", "reentrant", "non_reentrant"):
        return regression_batches(7, batch)
    if kind in ("tied", "tied_sum"):
        return token_batches(7, batch, seq_lens=[5, 3, 7], pad_some=kind == "tied_sum")  # varying length
    return masked_batches(7, batch)


def _pipelined(rank, world, cases):
    """Every case on this process group; per case: losses, first-step grads, final params."""
    from lightning_pp.runtime import build_pipeline

    out = []
    for case in cases:
        model = make_model(case["model"])
        executor = build_pipeline(
            model,
            pipeline_parallel_size=case["pp"],
            virtual_pipeline_size=case.get("vp", 1),
            num_microbatches=case["m"],
            schedule=case["schedule"],
            layout=case.get("layout"),
            activation_checkpointing=case.get("ac", False),
        )
        losses, grads, params = pipelined_run(executor, model, make_batches(case["model"], case["batch"]),
                                              optimizer=case.get("opt", "sgd"))
        out.append((losses, grads, params))
    return out


def _check(case, per_rank, rtol=1e-6):
    ref_losses, ref_grads, ref_params = reference_run(make_model(case["model"]), make_batches(case["model"], case["batch"]),
                                                      optimizer=case.get("opt", "sgd"))
    seen = set()
    for rank, (losses, grads, params) in enumerate(per_rank):
        assert losses == pytest.approx(ref_losses, rel=rtol), f"{case}: rank {rank} losses"
        for name, value in grads.items():
            torch.testing.assert_close(value, ref_grads[name], rtol=rtol, atol=1e-10, msg=f"{case} grad {name} rank {rank}")
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=rtol, atol=1e-10, msg=f"{case} param {name} rank {rank}")
            seen.add(name)
    assert seen == set(ref_params), f"{case}: parameters missing from every rank: {set(ref_params) - seen}"


TWO_RANK_CASES = [
    dict(model="regressor", pp=2, m=2, schedule="1f1b", batch=8),
    dict(model="regressor", pp=2, m=5, schedule="1f1b", batch=11),  # 2*pp+1 over an indivisible batch
    dict(model="regressor", pp=2, m=5, schedule="gpipe", batch=11, opt="adamw"),
    dict(model="regressor", pp=2, vp=2, m=4, schedule="interleaved", batch=9),
    dict(model="regressor", pp=2, vp=2, m=5, schedule="gpipe", batch=10),
    dict(model="regressor", pp=2, m=3, schedule="1f1b", batch=7, layout=[1, 7]),  # uneven explicit layout
    dict(model="regressor", pp=2, vp=2, m=4, schedule="interleaved", batch=8, layout="E|t|t*4|tL"),
    dict(model="tied", pp=2, m=3, schedule="1f1b", batch=6),  # tied embedding/head, variable seq length
    dict(model="tied_sum", pp=2, vp=2, m=4, schedule="interleaved", batch=8),  # (sum, count) loss
    dict(model="tuple", pp=2, m=4, schedule="1f1b", batch=9),  # tuple stage boundary
    dict(model="regressor", pp=2, m=5, schedule="combined_1f1b", batch=11),
    dict(model="tied", pp=2, vp=2, m=4, schedule="combined_1f1b", batch=8),
    dict(model="non_reentrant", pp=2, m=4, schedule="1f1b", batch=8),  # checkpointed layers
    dict(model="reentrant", pp=2, vp=2, m=4, schedule="interleaved", batch=8),
    dict(model="non_reentrant", pp=2, vp=2, m=4, schedule="combined_1f1b", batch=8),
    # the runtime's own activation checkpointing: every layer, or the layers of given classes
    dict(model="regressor", pp=2, m=4, schedule="1f1b", batch=8, ac=True),
    dict(model="tied", pp=2, vp=2, m=4, schedule="interleaved", batch=8, ac=[Block]),
    dict(model="regressor", pp=2, vp=2, m=4, schedule="combined_1f1b", batch=8, ac=[Block]),
]

FOUR_RANK_PP4 = [
    dict(model="regressor", pp=4, m=4, schedule="1f1b", batch=8),
    dict(model="regressor", pp=4, m=9, schedule="1f1b", batch=13),
    dict(model="regressor", pp=4, vp=2, m=4, schedule="interleaved", batch=8),
    dict(model="regressor", pp=4, m=4, schedule="gpipe", batch=6),
    dict(model="tied", pp=4, m=4, schedule="1f1b", batch=8),
    dict(model="regressor", pp=4, vp=2, m=8, schedule="combined_1f1b", batch=8),
]

FOUR_RANK_DP2 = [
    dict(model="regressor", pp=2, m=2, schedule="1f1b", batch=8),
    dict(model="regressor", pp=2, m=5, schedule="1f1b", batch=22),
    dict(model="regressor", pp=2, vp=2, m=4, schedule="interleaved", batch=16, opt="adamw"),
    dict(model="tied_sum", pp=2, m=3, schedule="1f1b", batch=8),
    dict(model="tied", pp=2, vp=2, m=2, schedule="gpipe", batch=8),
]


@pytest.mark.timeout(240)
def test_two_stage_cases_match_single_process():
    per_rank = run_distributed(_pipelined, 2, TWO_RANK_CASES, timeout=200)
    for i, case in enumerate(TWO_RANK_CASES):
        _check(case, [r[i] for r in per_rank])


@pytest.mark.timeout(240)
def test_four_stage_cases_match_single_process():
    per_rank = run_distributed(_pipelined, 4, FOUR_RANK_PP4, timeout=200)
    for i, case in enumerate(FOUR_RANK_PP4):
        _check(case, [r[i] for r in per_rank])


@pytest.mark.timeout(240)
def test_pipeline_with_data_parallel_matches_single_process():
    per_rank = run_distributed(_pipelined, 4, FOUR_RANK_DP2, timeout=200)
    for i, case in enumerate(FOUR_RANK_DP2):
        _check(case, [r[i] for r in per_rank])
