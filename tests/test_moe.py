"""MoE with expert parallelism: combined 1F1B equals plain 1F1B (1e-12) and a single-process
reference with unsharded experts (1e-6); staging buffers stop allocating after the first step."""

from __future__ import annotations

import pytest
import torch

from distributed import DistributedFailure, run_distributed
from models import reference_run
from moe_models import MOE_STEPS, TinyMoELM, run_moe_cases, tiny_moe, token_batches


def _pairs(pp, ep, vp, batch):
    base = "1f1b" if vp == 1 else "interleaved"
    m = 2 * pp if pp > 1 else 4
    common = dict(pp=pp, ep=ep, vp=vp, m=m, batch=batch)
    return [dict(common, schedule=base), dict(common, schedule="combined_1f1b"),
            dict(common, schedule=base, aux=0.01, z=0.001), dict(common, schedule="combined_1f1b", aux=0.01, z=0.001)]


def _check(cases, per_rank):
    for i in range(0, len(cases), 4):
        plain, combined, plain_aux, combined_aux = (i, i + 1, i + 2, i + 3)
        ref_losses, ref_grads, ref_params = reference_run(tiny_moe(), token_batches(5, cases[i]["batch"], 6, MOE_STEPS))
        seen = set()
        for rank, results in enumerate(per_rank):
            for a, b in ((plain, combined), (plain_aux, combined_aux)):
                la, ga, pa, _ = results[a]
                lb, gb, pb, sb = results[b]
                assert lb == pytest.approx(la, rel=1e-12, abs=1e-12), f"{cases[b]} rank {rank}"
                for name in ga:
                    torch.testing.assert_close(gb[name], ga[name], rtol=1e-12, atol=1e-12, msg=f"{name} {cases[b]}")
                assert sb["a2a_waits"] > 0 or cases[b]["ep"] == 1
            losses, grads, params, _ = results[plain]
            assert losses == pytest.approx(ref_losses, rel=1e-6)
            for name, value in grads.items():
                torch.testing.assert_close(value, ref_grads[name], rtol=1e-6, atol=1e-10, msg=f"{name} rank {rank}")
            for name, value in params.items():
                torch.testing.assert_close(value, ref_params[name], rtol=1e-6, atol=1e-10, msg=f"{name} rank {rank}")
                seen.add(name)
        assert seen == set(ref_params)


@pytest.mark.timeout(240)
def test_expert_parallel_pp1_ep2_combined_equals_1f1b_and_reference():
    cases = _pairs(pp=1, ep=2, vp=1, batch=8) + _pairs(pp=1, ep=2, vp=2, batch=8)
    _check(cases, run_distributed(run_moe_cases, 2, cases, timeout=200))


@pytest.mark.timeout(300)
def test_expert_parallel_pp2_ep2_combined_equals_1f1b_and_reference():
    cases = _pairs(pp=2, ep=2, vp=1, batch=8) + _pairs(pp=2, ep=2, vp=2, batch=8)
    _check(cases, run_distributed(run_moe_cases, 4, cases, timeout=260))


@pytest.mark.timeout(240)
def test_staging_buffers_do_not_grow_after_the_first_step():
    case = dict(pp=1, ep=2, vp=1, m=4, batch=8, schedule="combined_1f1b", capacity=2.0)
    for (_, _, _, stats), in run_distributed(run_moe_cases, 2, [case], timeout=200):
        assert stats["allocations"] > 0 and stats["staged"] > 0
        # Every combine sent straight from a persistent buffer (the experts wrote into it), and
        # it moved as many bytes as the dispatch-backward staged: both are the received rows.
        assert stats["zero_copy"] == stats["staged"]
        assert stats["after_warmup"] == 0


def _bad_experts(rank, world):
    from lightning_pp.runtime import build_pipeline

    torch.manual_seed(0)
    model = TinyMoELM(experts=3)
    build_pipeline(model, pipeline_parallel_size=1, expert_parallel_size=2)


def test_experts_not_divisible_by_expert_parallel_size():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_bad_experts, 2, timeout=60)
    assert all("num_experts=3 is not divisible by expert_parallel_size=2" in e for e in info.value.errors.values())


def _expert_misbehaves(rank, world, bad_rank, how):
    import datetime
    import time

    from lightning_pp.moe.layer import Expert
    from lightning_pp.runtime import WatchdogConfig, build_pipeline

    torch.manual_seed(0)
    model = TinyMoELM()
    executor = build_pipeline(model, pipeline_parallel_size=2, expert_parallel_size=2, num_microbatches=4,
                              schedule="combined_1f1b", timeout=datetime.timedelta(seconds=30 if how == "raise" else 3),
                              watchdog=WatchdogConfig(heartbeat_interval=0.5, exit_grace=3.0))
    if rank == bad_rank:
        expert = next(m for m in model.modules() if isinstance(m, Expert))
        forward = expert.forward

        def broken(x):
            if executor.steps_done == 1:
                if how == "hang":
                    time.sleep(600)  # alive, heartbeating, never progressing
                raise RuntimeError("injected failure in an expert")
            return forward(x)

        expert.forward = broken
    for batch in token_batches(0, 8, 6, 3):
        executor.train_step(batch)
    return "finished"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "hang"])
def test_expert_failing_mid_step_brings_every_rank_down_naming_it(how):
    # Rank 3's expert raises (or hangs) in step 2; its expert-parallel peer (rank 2) is then waiting
    # in an expert all-to-all and the other stage in point-to-point transfers: all must end, naming
    # rank 3 (a hung rank is ended by its own watchdog).
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_expert_misbehaves, 4, 3, how, timeout=90)
    failure = info.value
    assert all(code not in (0, None) for code in failure.exitcodes.values()), failure.exitcodes
    assert failure.elapsed < 60, f"took {failure.elapsed:.1f}s to bring every rank down"
    assert set(failure.errors) == {0, 1, 2, 3}
    for rank, message in failure.errors.items():
        if how == "hang" and rank == 3:
            from lightning_pp.runtime import WATCHDOG_EXIT_CODE

            assert failure.exitcodes[3] == WATCHDOG_EXIT_CODE  # ended by its watchdog (message on stderr)
            continue
        assert "rank 3 (pp=1, dp=1, ep=1)" in message, f"rank {rank}: {message}"
        if how == "raise":
            assert "injected failure in an expert" in message, f"rank {rank}: {message}"
