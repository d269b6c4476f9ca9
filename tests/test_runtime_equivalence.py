"""The runtime's core promise: a pipelined step gives the same loss and gradients as the same
step on one device, for every schedule, layout, microbatch count and data-parallel size."""

from __future__ import annotations

import pytest

from models import Block
from distributed import run_distributed
from equivalence import check_case, run_cases

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
    per_rank = run_distributed(run_cases, 2, TWO_RANK_CASES, timeout=200)
    for i, case in enumerate(TWO_RANK_CASES):
        check_case(case, [r[i] for r in per_rank])


@pytest.mark.timeout(240)
def test_four_stage_cases_match_single_process():
    per_rank = run_distributed(run_cases, 4, FOUR_RANK_PP4, timeout=200)
    for i, case in enumerate(FOUR_RANK_PP4):
        check_case(case, [r[i] for r in per_rank])


@pytest.mark.timeout(240)
def test_pipeline_with_data_parallel_matches_single_process():
    per_rank = run_distributed(run_cases, 4, FOUR_RANK_DP2, timeout=200)
    for i, case in enumerate(FOUR_RANK_DP2):
        check_case(case, [r[i] for r in per_rank])
