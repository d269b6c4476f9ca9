"""Cases run through ``build_pipeline`` on every rank and checked against the one-device
reference (``models.reference_run``): the models and batches of the runtime's equivalence tests,
shared by the tests of other features that run the same cases (zero-bubble, compile, sharding)."""

from __future__ import annotations

import pytest
import torch

from models import TiedLM, ToyRegressor, TupleBoundaryNet, pipelined_run, reference_run

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


def run_cases(rank, world, cases):
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


def check_case(case, per_rank, rtol=1e-6):
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
