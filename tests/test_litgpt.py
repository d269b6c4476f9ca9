"""litgpt's models, as users have them, pipelined without rewriting: every architecture family of
litgpt's config list under 1F1B and interleaved 1F1B equals litgpt's own training on one device
(float64, losses and parameters after three AdamW steps, 1e-9), with litgpt's parameter names.
The losses are litgpt's own (``chunked_cross_entropy`` of each whole batch); the parameters are
compared with litgpt trained on the same microbatches by gradient accumulation (see
``litgpt_reference``: litgpt's RMSNorm rounds to float32 even in a float64 model)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("litgpt")

from distributed import run_distributed  # noqa: E402
from litgpt_models import FAMILIES, adamw, litgpt_reference, make, token_batches  # noqa: E402

SCHEDULES = [dict(schedule="1f1b", vp=1, m=3), dict(schedule="interleaved", vp=2, m=2)]
CASES = [dict(name=name, **s) for name in FAMILIES for s in SCHEDULES] + [
    dict(name="pythia-14m", schedule="1f1b", vp=1, m=3, tie=True),  # a tied embedding/head across stages
]


def _pipelined(rank, world, cases):
    from lightning_pp.runtime import build_pipeline

    out = []
    for case in cases:
        holder = make(case["name"], tie=case.get("tie", False))
        executor = build_pipeline(holder, pipeline_parallel_size=2, virtual_pipeline_size=case["vp"],
                                  num_microbatches=case["m"], schedule=case["schedule"])
        opt = adamw(holder.parameters())
        losses = []
        for batch in token_batches(5):
            losses.append(float(executor.train_step(batch).loss))
            opt.step()
            opt.zero_grad()
        names = executor.partition.parameter_names
        held = sorted(n for n, _ in holder.named_parameters())
        out.append((losses, {names[id(p)]: p.detach().clone() for p in holder.parameters()}, held))
        executor.close()
    return out


@pytest.fixture(scope="module")
def pipelined():
    return run_distributed(_pipelined, 2, CASES, timeout=240)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    f"{c['name']}-{c['schedule']}{'-tied' if c.get('tie') else ''}" for c in CASES])
def test_family_pipelined_equals_litgpt_on_one_device(pipelined, index):
    case = CASES[index]
    ref_losses, ref_params = litgpt_reference(make(case["name"], tie=case.get("tie", False)), token_batches(5),
                                              microbatches=case["m"])
    one_device_names = {n for n, _ in make(case["name"], tie=case.get("tie", False)).named_parameters(remove_duplicate=False)}
    seen = set()
    for rank, results in enumerate(pipelined):
        losses, params, held = results[index]
        assert losses == pytest.approx(ref_losses, rel=1e-9), f"rank {rank}"
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-9, atol=1e-9, msg=f"{name} on rank {rank}")
            seen.add(name)
        # the names a rank holds are litgpt's own (no key map), and only its stage's
        assert set(held) <= one_device_names, set(held) - one_device_names
    assert seen == set(ref_params)
    assert not set(pipelined[0][index][2]) & set(pipelined[1][index][2]) or case.get("tie")
