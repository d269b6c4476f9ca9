"""Zero-bubble schedules (ZB-H1 ``zb1p``, ZB-V ``zbv``, ``dualpipev``) train exactly the model one
device trains: their backward is split into input gradients (B) and weight gradients (W, later),
with tied weights, activation checkpointing, short batches and data parallelism."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models import Block
from equivalence import check_case, run_cases

from moe_models import token_batches

TWO_RANKS = [
    dict(model="regressor", pp=2, m=4, schedule="zb1p", batch=8),
    dict(model="regressor", pp=2, m=5, schedule="zb1p", batch=11, opt="adamw"),
    dict(model="tied", pp=2, m=3, schedule="zb1p", batch=6),  # tied embedding/head across ranks
    dict(model="tuple", pp=2, m=4, schedule="zb1p", batch=9),
    dict(model="non_reentrant", pp=2, m=4, schedule="zb1p", batch=8),
    dict(model="reentrant", pp=2, m=4, schedule="zb1p", batch=8),
    dict(model="regressor", pp=2, m=4, schedule="zb1p", batch=8, ac=True),
    dict(model="regressor", pp=2, m=4, schedule="zb1p", batch=3),  # short batch: fewer microbatches
    dict(model="regressor", pp=2, vp=2, m=4, schedule="zb1p", batch=8),  # interleaved ZB-H1
    dict(model="tied_sum", pp=2, vp=2, m=6, schedule="zb1p", batch=12),
    dict(model="regressor", pp=2, vp=2, m=4, schedule="zbv", batch=8),
    dict(model="regressor", pp=2, vp=2, m=5, schedule="zbv", batch=11),
    dict(model="tied", pp=2, vp=2, m=4, schedule="zbv", batch=8),  # embedding and head both on rank 0
    dict(model="tied_sum", pp=2, vp=2, m=4, schedule="zbv", batch=8),
    dict(model="non_reentrant", pp=2, vp=2, m=4, schedule="zbv", batch=8),
    dict(model="tied", pp=2, vp=2, m=4, schedule="zbv", batch=8, ac=[Block]),
    dict(model="regressor", pp=2, vp=2, m=4, schedule="zbv", batch=2),  # short batch
    dict(model="regressor", pp=2, vp=2, m=4, schedule="dualpipev", batch=8),
    dict(model="tied", pp=2, vp=2, m=5, schedule="dualpipev", batch=10),
    dict(model="non_reentrant", pp=2, vp=2, m=6, schedule="dualpipev", batch=12, opt="adamw"),
    dict(model="regressor", pp=2, vp=2, m=4, schedule="dualpipev", batch=3),  # short batch: runs as zbv
]

FOUR_RANKS_PP4 = [
    dict(model="regressor", pp=4, m=8, schedule="zb1p", batch=8),
    dict(model="tied", pp=4, m=4, schedule="zb1p", batch=8),
    dict(model="regressor", pp=4, vp=2, m=8, schedule="zbv", batch=8),
    dict(model="regressor", pp=4, vp=2, m=8, schedule="dualpipev", batch=16),
]

FOUR_RANKS_DP2 = [
    dict(model="regressor", pp=2, m=4, schedule="zb1p", batch=16),
    dict(model="tied_sum", pp=2, m=3, schedule="zb1p", batch=8),
    dict(model="regressor", pp=2, vp=2, m=4, schedule="zbv", batch=16, opt="adamw"),
    dict(model="tied_sum", pp=2, vp=2, m=4, schedule="dualpipev", batch=16),
]


@pytest.mark.timeout(240)
def test_zero_bubble_two_ranks_match_one_device():
    per_rank = run_distributed(run_cases, 2, TWO_RANKS, timeout=200)
    for i, case in enumerate(TWO_RANKS):
        check_case(case, [r[i] for r in per_rank])


@pytest.mark.timeout(240)
def test_zero_bubble_four_stages_match_one_device():
    per_rank = run_distributed(run_cases, 4, FOUR_RANKS_PP4, timeout=200)
    for i, case in enumerate(FOUR_RANKS_PP4):
        check_case(case, [r[i] for r in per_rank])


@pytest.mark.timeout(240)
def test_zero_bubble_with_data_parallel_matches_one_device():
    per_rank = run_distributed(run_cases, 4, FOUR_RANKS_DP2, timeout=200)
    for i, case in enumerate(FOUR_RANKS_DP2):
        check_case(case, [r[i] for r in per_rank])


def _when_weights_accumulate(rank, world, model_kind):
    """The action kinds during which each parameter's gradient was accumulated, in one zb1p step."""
    from lightning_pp.runtime import build_pipeline
    from equivalence import make_batches, make_model

    model = make_model(model_kind)
    executor = build_pipeline(model, pipeline_parallel_size=2, num_microbatches=4, schedule="zb1p")
    kinds = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda _p, name=name: kinds.setdefault(name, set()).add(str(executor.position.action.kind)))
    executor.train_step(make_batches(model_kind, 8)[0])
    return kinds


@pytest.mark.timeout(120)
def test_weight_gradients_are_computed_at_w():
    # The point of the split: B sends the input gradient without computing any weight gradient;
    # every weight gradient is accumulated during a W action (the first stage, whose input needs
    # no gradient, does its whole backward at W). Reentrant checkpointing cannot split: whole at B.
    for kind in ("regressor", "reentrant"):
        first, last = run_distributed(_when_weights_accumulate, 2, kind, timeout=100)
        assert first and all(k == {"W"} for k in first.values()), f"{kind} rank 0: {first}"
        assert last, f"{kind} rank 1: no gradient accumulated"
        if kind == "regressor":
            assert all(k == {"W"} for k in last.values()), f"{kind} rank 1: {last}"
        else:  # the checkpointed blocks of the second stage accumulate inside B
            assert any(k == {"B"} for name, k in last.items() if name.startswith("blocks.")), last


def _plan_accumulations(rank, world):
    """One dualpipev step of an MoE model (its chunks run through schedule plans): for every
    weight-gradient accumulation, the parameter and the action running then; and the rank's
    split backwards (those with a W)."""
    from lightning_pp.runtime import build_pipeline
    from lightning_pp.schedules import rank_actions, split_backwards
    from moe_models import tiny_moe

    model = tiny_moe()
    executor = build_pipeline(model, pipeline_parallel_size=2, virtual_pipeline_size=2, num_microbatches=4,
                              schedule="dualpipev")
    events = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, name=name: events.append((name, executor.position.action)))
    executor.train_step(token_batches(5, 8, 6, 1)[0])
    split = split_backwards(rank_actions(executor.schedule, executor.pp_rank))
    return [(name, str(a.kind), a.backward_part() or (a.microbatch, a.chunk)) for name, a in events], split


@pytest.mark.timeout(120)
def test_schedule_plans_leave_weight_gradients_to_w():
    # DualPipeV runs MoE chunks node by node through their schedule plans: a backward that has a W
    # computes no weight gradient, every node leaves its weight half to the W; the other backwards
    # (fused FB steps whose table has no W for them) accumulate as one backward does.
    for rank, (events, split) in enumerate(run_distributed(_plan_accumulations, 2, timeout=100)):
        at_w = {part for _, kind, part in events if kind == "W"}
        assert at_w == set(split), f"rank {rank}: W actions accumulated {sorted(at_w)}, split {sorted(split)}"
        early = [(name, kind, part) for name, kind, part in events if kind != "W" and part in split]
        assert not early, f"rank {rank}: weight gradients of split backwards accumulated before their W: {early[:5]}"
        assert any(kind != "W" for _, kind, _ in events), f"rank {rank}: no unsplit backward accumulated"


MOE = [  # pp 2 x ep 2, with the router's auxiliary losses; the first is the 1F1B baseline
    dict(pp=2, ep=2, vp=1, m=4, batch=8, schedule="1f1b", aux=0.01, z=0.001),
    dict(pp=2, ep=2, vp=1, m=4, batch=8, schedule="zb1p", aux=0.01, z=0.001),
    dict(pp=2, ep=2, vp=2, m=4, batch=8, schedule="zbv", aux=0.01, z=0.001),
    dict(pp=2, ep=2, vp=2, m=4, batch=8, schedule="dualpipev", aux=0.01, z=0.001),
    dict(pp=2, ep=2, vp=1, m=4, batch=8, schedule="zb1p"),
    dict(pp=2, ep=2, vp=2, m=4, batch=8, schedule="dualpipev"),
]


@pytest.mark.timeout(300)
def test_zero_bubble_moe_with_expert_parallelism_matches():
    from moe_models import MOE_STEPS, run_moe_cases, tiny_moe

    from models import reference_run

    per_rank = run_distributed(run_moe_cases, 4, MOE, timeout=260)
    ref_losses, ref_grads, ref_params = reference_run(tiny_moe(), token_batches(5, 8, 6, MOE_STEPS))

    def merged(index, part):  # a case's gradients (part 1) or parameters (2), from every rank
        out = {}
        for results in per_rank:
            out.update(results[index][part])
        return out

    base_grads = merged(0, 1)
    for index, case in enumerate(MOE[1:], start=1):
        for rank, results in enumerate(per_rank):
            assert results[index][3]["a2a_waits"] > 0, f"{case} rank {rank}: no expert all-to-all ran"
        losses, grads, params = per_rank[0][index][0], merged(index, 1), merged(index, 2)
        if "aux" in case:  # same model as the 1F1B baseline, up to summation order
            assert losses == pytest.approx(per_rank[0][0][0], rel=1e-10), case
            assert set(grads) == set(base_grads), case
            for name, value in grads.items():
                torch.testing.assert_close(value, base_grads[name], rtol=1e-9, atol=1e-12, msg=f"{name} {case}")
        else:  # against one process with every expert
            assert losses == pytest.approx(ref_losses, rel=1e-6), case
            assert set(params) == set(ref_params), case
            for name, value in grads.items():
                torch.testing.assert_close(value, ref_grads[name], rtol=1e-6, atol=1e-10, msg=f"{name} {case}")
            for name, value in params.items():
                torch.testing.assert_close(value, ref_params[name], rtol=1e-6, atol=1e-10, msg=f"{name} {case}")
