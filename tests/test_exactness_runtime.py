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


def test_ties_in_any_order_match_one_device(two_ranks):
    _check_all(TIES_TWO_RANKS, two_ranks("ties"))


def test_ties_across_three_stages_and_with_data_parallel_match_one_device(four_ranks):
    _check_all(TIES_FOUR_RANKS, four_ranks("ties"))
    _check_all(TIES_DATA_PARALLEL, four_ranks("ties_dp"))


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


def test_parameters_without_gradients_keep_none(two_ranks, four_ranks):
    _check_all(NOGRAD_TWO_RANKS, two_ranks("nograd"))
    _check_all(NOGRAD_DATA_PARALLEL, four_ranks("nograd"))


# -- per-sample Python lists are split with their samples ---------------------------------------------
RAGGED = [
    dict(model="ragged", pp=2, m=3, batch=7),
    dict(model="ragged", pp=2, vp=2, m=4, schedule="interleaved", batch=8),
]


RAGGED_DATA_PARALLEL = [dict(model="ragged", pp=2, m=2, batch=8)]


def test_per_sample_lists_follow_their_samples(two_ranks, four_ranks):
    _check_all(RAGGED, two_ranks("ragged"))
    _check_all(RAGGED_DATA_PARALLEL, four_ranks("ragged"))


# -- batches smaller than num_microbatches run with fewer microbatches ----------------------------------
TAILS_TWO_RANKS = [
    dict(model="ties", layers=6, ties=[], pp=2, m=4, batch=[8, 3, 1]),
    dict(model="ties", layers=6, ties=[[0, 5]], pp=2, vp=2, m=4, schedule="interleaved", batch=[8, 3, 1]),
    dict(model="ties", layers=6, ties=[], pp=2, vp=2, m=4, schedule="combined_1f1b", batch=[5, 1, 2]),
    dict(model="nograd", stop_after=2, pp=2, m=4, batch=[6, 2], layout=[3, 4]),
]

TAILS_FOUR_RANKS = [
    dict(model="ties", layers=6, ties=[[1, 4]], pp=4, vp=2, m=8, schedule="interleaved", batch=[9, 5, 3]),
    dict(model="ties", layers=6, ties=[], pp=2, m=4, batch=[16, 6, 2]),  # dp=2: each replica's share
]


def test_batches_smaller_than_the_microbatch_count_are_exact(two_ranks, four_ranks):
    _check_all(TAILS_TWO_RANKS, two_ranks("tails"))
    _check_all(TAILS_FOUR_RANKS, four_ranks("tails"))



# -- every stage draws its own dropout masks, reproducibly ---------------------------------------------
def _dropout(rank, world, pp):
    from exactness_models import DropoutNet, record_dropout_masks
    from lightning_pp.runtime import build_pipeline

    results = []
    for checkpointing in (False, False, True):  # two identical launches, then with recomputation
        torch.manual_seed(1234)  # what seed_everything does on every rank
        model = DropoutNet().double()
        masks = record_dropout_masks(model)
        executor = build_pipeline(model, pipeline_parallel_size=pp, num_microbatches=2,
                                  activation_checkpointing=checkpointing)
        losses, _, params = pipelined_steps(executor, model, plain_batches(3, 8, steps=2))
        executor.close()
        results.append((losses, params, {name: [m.tolist() for m in drawn] for name, drawn in masks.items()}))
    return results


def test_dropout_masks_differ_across_stages_and_replicas_and_reproduce(four_ranks):
    per_rank = four_ranks("dropout")  # pp=2 x dp=2
    first_masks = {}
    for rank, (plain, again, recomputed) in enumerate(per_rank):
        # bitwise reproducible from the seed, and activation recomputation replays the same masks
        assert plain[0] == again[0] and plain[0] == recomputed[0], f"rank {rank}: losses differ between launches"
        for name in plain[1]:
            assert torch.equal(plain[1][name], again[1][name]) and torch.equal(plain[1][name], recomputed[1][name])
        assert plain[2] == again[2] == recomputed[2]  # (a recomputation that drew other masks would
        # also change the gradients, hence the parameters compared above)
        # the first mask each rank drew (stage 0: blocks.0; stage 1: blocks.2), same shape everywhere
        first_masks[rank] = next(drawn[0] for name, drawn in sorted(plain[2].items()))
    # ranks 0, 1: stage 0 (dp 0, 1); ranks 2, 3: stage 1 (dp 0, 1): four different streams
    for a in range(4):
        for b in range(a + 1, 4):
            assert first_masks[a] != first_masks[b], f"ranks {a} and {b} drew the same dropout mask"


# -- the stages of a pipeline are checked to run the same batch, or given rank 0's ---------------------
def _rank_dependent_batches(rank, world, options):
    import warnings

    from lightning_pp.runtime import BatchMismatchError, build_pipeline

    torch.manual_seed(7)
    model = NoGradNet(stop_after=None).double()
    executor = build_pipeline(model, pipeline_parallel_size=2, num_microbatches=2, **options)
    pp_rank = executor.topology.pp_rank
    # a data pipeline that differs by rank from the second batch on (an unseeded augmentation)
    batches = [plain_batches(11 + (i and pp_rank), 6, steps=1)[0] for i in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = pipelined_steps(executor, model, batches)
        except BatchMismatchError as exc:
            return "raised", str(exc)
    return "trained", out, [str(w.message) for w in caught if "different batches" in str(w.message)]


def test_stages_fed_different_batches_raise_warn_or_use_rank_zeros_batch(two_ranks):
    for rank, result in enumerate(two_ranks("batches_raise")):
        assert result[0] == "raised", f"rank {rank} trained on mismatched batches"
        assert "training step 1" in result[1] and "pipeline rank(s) [1]" in result[1], result[1]
        assert "broadcast_batches=True" in result[1]
    for result in two_ranks("batches_warn"):
        assert result[0] == "trained" and len(result[2]) == 2, result  # steps 1 and 2, on every rank
    # broadcast_batches: every stage runs pipeline rank 0's batch, so this is one device on rank 0's data
    per_rank = two_ranks("batches_broadcast")
    torch.manual_seed(7)
    reference = reference_steps(NoGradNet(stop_after=None).double(), [plain_batches(11, 6, steps=1)[0]] * 3)
    assert all(r[0] == "trained" and not r[2] for r in per_rank)
    compare("broadcast_batches", reference, [r[1] for r in per_rank])


# -- every case runs in one launch per world size (a launch costs seconds; a case, milliseconds) -------
JOBS = {"cases": _run, "dropout": _dropout, "batches": _rank_dependent_batches}
TWO_RANK_JOBS = {
    "ties": ("cases", TIES_TWO_RANKS),
    "nograd": ("cases", NOGRAD_TWO_RANKS),
    "ragged": ("cases", RAGGED),
    "tails": ("cases", TAILS_TWO_RANKS),
    "batches_warn": ("batches", {"check_batches": "warn"}),
    "batches_broadcast": ("batches", {"broadcast_batches": True}),
    "batches_raise": ("batches", {}),  # last: a failed step leaves the job's failure board set
}
FOUR_RANK_JOBS = {
    "ties": ("cases", TIES_FOUR_RANKS),
    "ties_dp": ("cases", TIES_DATA_PARALLEL),
    "nograd": ("cases", NOGRAD_DATA_PARALLEL),
    "ragged": ("cases", RAGGED_DATA_PARALLEL),
    "tails": ("cases", TAILS_FOUR_RANKS),
    "dropout": ("dropout", 2),
}


def _jobs(rank, world, jobs):
    return {name: JOBS[kind](rank, world, arg) for name, (kind, arg) in jobs.items()}


def _launch(world, jobs):
    per_rank = run_distributed(_jobs, world, jobs, timeout=280)
    return lambda name: [results[name] for results in per_rank]


@pytest.fixture(scope="module")
def two_ranks():
    return _launch(2, TWO_RANK_JOBS)


@pytest.fixture(scope="module")
def four_ranks():
    return _launch(4, FOUR_RANK_JOBS)
