"""``compile=`` through the runtime (issue 23): every schedule on two gloo processes with each
pipeline layer compiled in place, equal to the uncompiled model on one device (float64); the
zero-bubble schedules with the split backward, a layer the user compiled, activation
checkpointing inside the compiled layers' graphs, sequence lengths and a last microbatch that change without
recompiling, state-dict names as the user's."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models import Block, pipelined_run, reference_run
from moe_models import TinyMoELM, token_batches
from equivalence import make_batches, make_model
from lightning_pp.runtime.process import CHECKPOINT, CHECKPOINT_COMPILED, COMPILED, fact

EAGER_KERNELS = {"backend": "aot_eager"}  # torch's eager kernels in the compiled graphs: their order of operations
CASES = [
    dict(model="regressor", schedule="1f1b", m=4, batch=8, compile=EAGER_KERNELS),
    dict(model="regressor", schedule="interleaved", vp=2, m=4, batch=8, compile=EAGER_KERNELS),
    dict(model="regressor", schedule="gpipe", m=5, batch=11, compile=EAGER_KERNELS),  # a smaller last microbatch
    dict(model="regressor", schedule="combined_1f1b", m=5, batch=11, compile=EAGER_KERNELS),
    dict(model="tied", schedule="zb1p", m=3, batch=6, compile=EAGER_KERNELS),  # tied; sequence lengths 5, 3, 7
    dict(model="regressor", schedule="zbv", vp=2, m=4, batch=8, compile=EAGER_KERNELS, ac=True),
    dict(model="tied", schedule="dualpipev", vp=2, m=4, batch=8, compile=EAGER_KERNELS),
    # the user's own block.compile() (inductor), under zb1p: recompiled with the split backward
    dict(model="regressor", schedule="zb1p", m=4, batch=9, compile=False, user_compiled=True),
    # compile=True: inductor, whose kernels fuse and reorder: in float64 still within 1e-9 here
    dict(model="regressor", schedule="interleaved", vp=2, m=4, batch=8, compile=True, ac=True),
    # a backend the pipeline does not split (dynamo's "eager"): used as given, a warning under zb1p
    dict(model="regressor", schedule="zb1p", m=4, batch=8, compile={"backend": "eager"}),
    # torch.compile(block) kept in the model (OptimizedModule; its names hold _orig_mod), under zbv
    dict(model="regressor", schedule="zbv", vp=2, m=4, batch=8, compile=False, user_compiled="wrapped"),
]


def _model(case):
    """The case's model, with the blocks compiled the user's way where the case says so."""
    model = make_model(case["model"])
    if case.get("user_compiled") == "wrapped":  # torch's eager kernels: the reference runs them too
        model.blocks = torch.nn.ModuleList(torch.compile(block, backend="aot_eager") for block in model.blocks)
    elif case.get("user_compiled"):
        for block in model.blocks:
            block.compile()
    return model


def _new_sizes(executor, case, which):
    """Train steps (gradients discarded) with batch sizes and sequence lengths not seen before."""
    from equivalence import regression_batches, token_batches as lm_batches

    m, topo = case["m"], executor.topology
    for k in which:
        if case["model"] == "tied":
            (batch,) = lm_batches(20 + k, 2 * m + 2 * k, seq_lens=[9 + 2 * k])
        else:
            (batch,) = regression_batches(20 + k, 3 * m + 2 * k, steps=1)
        executor.train_step(tuple(torch.tensor_split(t, topo.dp)[topo.dp_rank] for t in batch))
    for p in executor.module.parameters():
        p.grad = None


def _run(rank, world, cases):
    torch.set_num_threads(1)
    from lightning_pp.runtime import build_pipeline
    from lightning_pp.runtime.compile.watch import compile_counts

    out = []
    for case in cases:
        model = _model(case)
        before = compile_counts()
        executor = build_pipeline(model, pipeline_parallel_size=world, virtual_pipeline_size=case.get("vp", 1),
                                  num_microbatches=case["m"], schedule=case["schedule"], compile=case["compile"],
                                  activation_checkpointing=case.get("ac", False))
        layers = [layer for chunk in executor.partition.chunks for layer in chunk.layers]
        # every layer; with the user's own compile, the blocks the user compiled (recompiled, split)
        compiled = [fact(layer, COMPILED, False) for layer in layers
                    if not case.get("user_compiled") or isinstance(getattr(layer, "_orig_mod", layer), Block)]
        # activation checkpointing inside the compiled graphs, not around them
        inside = [fact(layer, CHECKPOINT_COMPILED, False) for layer in layers if fact(layer, CHECKPOINT, False)]
        losses, grads, params = pipelined_run(executor, model, make_batches(case["model"], case["batch"]))
        after = compile_counts()
        # New sizes: the first change may compile the symbolic graph once; later ones reuse it.
        _new_sizes(executor, case, [0])
        settled = compile_counts()["graphs"]
        _new_sizes(executor, case, [1, 2])
        out_graphs_after_sizes = compile_counts()["graphs"] - settled
        out.append(dict(losses=losses, grads=grads, params=params, compiled=compiled, names=set(model.state_dict()),
                        inside=inside, graphs=after["graphs"] - before["graphs"],
                        graphs_after_sizes=out_graphs_after_sizes, recompiles=after["recompiles"] - before["recompiles"],
                        guards={k: v[len(before["guards_failed"].get(k, [])):] for k, v in after["guards_failed"].items()}))
    return out


@pytest.mark.timeout(420)
def test_compiled_layers_every_schedule_equal_one_device_uncompiled():
    per_rank = run_distributed(_run, 2, CASES, timeout=400)
    for i, case in enumerate(CASES):
        reference = _model(case)
        ref_losses, ref_grads, ref_params = reference_run(reference, make_batches(case["model"], case["batch"]))
        seen = set()
        for rank, result in enumerate(r[i] for r in per_rank):
            assert result["compiled"] and all(result["compiled"]), f"{case}: rank {rank}: uncompiled {result['compiled']}"
            assert bool(result["inside"]) == bool(case.get("ac")) and all(result["inside"]), (case, rank, result["inside"])
            assert result["names"] <= set(reference.state_dict()), f"{case}: state-dict names changed: {result['names']}"
            assert result["losses"] == pytest.approx(ref_losses, rel=1e-9, abs=1e-12), f"{case} rank {rank} losses"
            for name, value in result["grads"].items():
                torch.testing.assert_close(value, ref_grads[name], rtol=1e-9, atol=1e-12, msg=f"{case} grad {name}")
            for name, value in result["params"].items():
                torch.testing.assert_close(value, ref_params[name], rtol=1e-9, atol=1e-12, msg=f"{case} param {name}")
                seen.add(name)
        assert seen == set(ref_params), f"{case}: parameters on no rank: {set(ref_params) - seen}"
        # Sizes that change (sequence lengths, batch sizes, a smaller last microbatch) compile the
        # symbolic graph once per compiled function, then never again.
        for rank, result in enumerate(r[i] for r in per_rank):
            assert result["graphs_after_sizes"] == 0, f"{case} rank {rank}: {result['graphs_after_sizes']} graphs for sizes"


MOE_CASES = [dict(schedule=s, vp=vp, m=4, compile=c) for s, vp in (("combined_1f1b", 1), ("dualpipev", 2))
             for c in (False, EAGER_KERNELS)]


def _moe_model():
    torch.manual_seed(11)
    return TinyMoELM(aux=0.0, z=0.0).double()  # router losses: one device has no microbatches to weight them


def _run_moe(rank, world, cases):
    torch.set_num_threads(1)
    from lightning_pp.runtime import build_pipeline

    out = []
    for case in cases:
        model = _moe_model()
        executor = build_pipeline(model, pipeline_parallel_size=2, expert_parallel_size=2, virtual_pipeline_size=case["vp"],
                                  num_microbatches=case["m"], schedule=case["schedule"], compile=case["compile"])
        compiled = [b for b in model.blocks if hasattr(b, "experts") and fact(b, COMPILED, False)]
        parts = [fact(m, COMPILED, False) for b in compiled for m in (b.attn, b.router)]
        losses, grads, params = pipelined_run(executor, model, token_batches(5, 8, 6, 3))
        a2a = sum(1 for sp in executor.timeline.spans if sp.kind == "a2a_wait")
        out.append(dict(losses=losses, grads=grads, params=params, parts=parts, a2a=a2a))
    return out


@pytest.mark.timeout(420)
def test_compiled_moe_pp2_ep2_combined_and_dualpipev_equal_one_device():
    """The MoE blocks' parts compiled (attention, router, this rank's experts), the expert
    all-to-alls outside, under the schedule plans that overlap them: equal to the same pipeline
    uncompiled (1e-9) and to one device (1e-6, the bound of the uncompiled MoE tests: expert
    parallelism sums the experts' outputs in another order)."""
    per_rank = run_distributed(_run_moe, 4, MOE_CASES, timeout=400)
    ref_losses, ref_grads, ref_params = reference_run(_moe_model(), token_batches(5, 8, 6, 3))
    for i in range(1, len(MOE_CASES), 2):
        case, seen = MOE_CASES[i], set()
        for rank, (eager, result) in enumerate((r[i - 1], r[i]) for r in per_rank):
            assert result["parts"] and all(result["parts"]), f"{case} rank {rank}: MoE parts left uncompiled"
            assert result["a2a"] > 0, f"{case} rank {rank}: no expert all-to-all ran"
            assert result["losses"] == pytest.approx(eager["losses"], rel=1e-9), f"{case} rank {rank} losses"
            assert result["losses"] == pytest.approx(ref_losses, rel=1e-6), f"{case} rank {rank} losses"
            for name, value in result["grads"].items():
                torch.testing.assert_close(value, eager["grads"][name], rtol=1e-9, atol=1e-12, msg=f"{case} grad {name}")
                torch.testing.assert_close(value, ref_grads[name], rtol=1e-6, atol=1e-10, msg=f"{case} grad {name}")
            for name, value in result["params"].items():
                torch.testing.assert_close(value, eager["params"][name], rtol=1e-9, atol=1e-12, msg=f"{case} {name}")
                torch.testing.assert_close(value, ref_params[name], rtol=1e-6, atol=1e-10, msg=f"{case} param {name}")
                seen.add(name)
        assert seen == set(ref_params), f"{case}: parameters on no rank: {set(ref_params) - seen}"
