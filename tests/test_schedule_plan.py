"""The fine-grained scheduling contract (``lightning_pp.runtime.plans.plan``, after Megatron-core's
``pipeline_parallel.utils``): its building blocks on their own, and a user layer that brings its
own plan class trained under combined 1F1B, equal to one device, its ``run`` called with a forward
and a backward plan in the steady state and the stage-boundary transfers carried by its hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_distributed
from exactness_models import compare, pipelined_steps, plain_batches, reference_steps
from lightning_pp.runtime.plans.stages import is_vp_first_stage, is_vp_last_stage
from lightning_pp.runtime.plans.plan import (
    AbstractSchedulePlan,
    NoopScheduleNode,
    PlanEvent,
    ScheduleNode,
    StageDispatchBwdGrad,
    get_comm_stream,
    get_comp_stream,
    make_viewless,
    register_persistent,
    set_streams,
)
from models import Layered

RUN_LOG: list = []  # one entry per OwnPlan.run call


class OwnPlan(AbstractSchedulePlan):
    """A two-node plan: ``a = tanh(fc1(x))``, then ``x + fc2(a)``; fused runs interleave the two
    microbatches' nodes (forward node 1, backward node 2, forward node 2, backward node 1)."""

    def __init__(self, block: "OwnPlanBlock", inputs: tuple) -> None:
        self.event = PlanEvent()
        self.inputs = inputs
        self.first = ScheduleNode(lambda x: (x, torch.tanh(block.fc1(x))), get_comp_stream, self.event, name="fc1")
        self.second = ScheduleNode(lambda x, a: x + block.fc2(a), get_comp_stream, self.event, name="fc2")

    @staticmethod
    def run(f_schedule_plan, b_schedule_plan, grad=None, pre_forward=None, pre_backward=None,
            post_forward=None, post_backward=None):
        f, b = f_schedule_plan, b_schedule_plan
        entry = {"f": f is not None, "b": b is not None, "hooks": []}
        RUN_LOG.append(entry)
        entry["running"] = True

        def hook(name, fn, *args):
            entry["hooks"].append(name)
            return fn(*args)

        x = g = None
        if f is not None:
            x = f.inputs if f.inputs else hook("pre_forward", pre_forward)
            x = f.first.forward(x)
        if b is not None:
            g = grad if grad is not None else hook("pre_backward", pre_backward)
            g = b.second.backward(g)
        if f is not None:
            x = f.second.forward(x)
        if b is not None:
            g = b.first.backward(g)[:1]  # the gradient of x (the passed-through input took both paths)
        if f is not None and post_forward is not None:
            hook("post_forward", post_forward, x)
        if b is not None and post_backward is not None:
            hook("post_backward", post_backward, g)
        entry["running"] = False
        return x, g


class OwnPlanBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))

    def build_schedule_plan(self, *inputs):
        return OwnPlan(self, inputs)


class OwnPlanNet(Layered):
    """Residual blocks with their own plans, between a dense input and a dense output layer."""

    def __init__(self, blocks: int = 4, hidden: int = 6, dense_ends: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, hidden) if dense_ends else None
        self.blocks = nn.ModuleList(OwnPlanBlock(hidden if dense_ends else 4) for _ in range(blocks))
        self.out = nn.Linear(hidden, 2) if dense_ends else None

    def pipeline_layers(self):
        return [m for m in (self.inp, *self.blocks, self.out) if m is not None]

    def pipeline_loss(self, output, batch):
        target = batch[1] if output.shape[-1] == batch[1].shape[-1] else batch[0]
        return nn.functional.mse_loss(output, target)


CASES = [
    # every virtual stage one block: each chunk's plan is the block's own plan class
    dict(blocks=4, dense_ends=False, pp=2, vp=2, m=4, layout=[1, 1, 1, 1]),
    # chunks of several layers (a dense one among them): the runtime's chunk plan runs the blocks
    # through their own plan class
    dict(blocks=4, dense_ends=True, pp=2, vp=1, m=4, layout=None),
]


def _model(case):
    torch.manual_seed(5)
    return OwnPlanNet(case["blocks"], dense_ends=case["dense_ends"]).double()


def _batches():
    return [plain_batches(9 + i, 8, steps=1)[0] for i in range(3)]


def _run(rank, world, cases):
    from lightning_pp.runtime import build_pipeline
    from lightning_pp.schedules import make_config
    from lightning_pp.runtime.plans.stages import (
        get_pp_first_rank,
        get_pp_last_rank,
        get_pp_next_rank,
        get_pp_prev_rank,
        is_pp_first_stage,
        is_pp_last_stage,
    )

    out = []
    for case in cases:
        model = _model(case)
        executor = build_pipeline(model, pipeline_parallel_size=case["pp"], virtual_pipeline_size=case["vp"],
                                  num_microbatches=case["m"], schedule="combined_1f1b", layout=case["layout"])
        # every stage-boundary transfer, and whether an OwnPlan.run was running at that moment
        transfers = []
        p2p = executor.p2p
        for name in ("send", "recv"):
            original = getattr(p2p, name)

            def traced(*args, _original=original, _name=name, transfers=transfers):
                transfers.append((_name, bool(RUN_LOG) and RUN_LOG[-1].get("running", False)))
                return _original(*args)

            setattr(p2p, name, traced)
        RUN_LOG.clear()
        results = pipelined_steps(executor, model, _batches())
        group = executor.topology.pp_group
        where = (is_pp_first_stage(group), is_pp_last_stage(group), get_pp_first_rank(group),
                 get_pp_last_rank(group), get_pp_next_rank(group), get_pp_prev_rank(group))
        # The same questions about a chunk's virtual stage, under a V placement (dualpipev): rank 0
        # holds stages 0 and 3, rank 1 stages 1 and 2.
        v = make_config("dualpipev", 2, 2, 4)
        v_where = [(is_pp_first_stage(group, c, v), is_pp_last_stage(group, c, v), get_pp_next_rank(group, c, v),
                    get_pp_prev_rank(group, c, v)) for c in (0, 1)] + [get_pp_last_rank(group, v)]
        out.append((results, [dict(e) for e in RUN_LOG], transfers, (where, v_where)))
        executor.close()
    return out


@pytest.mark.timeout(200)
def test_a_layer_with_its_own_plan_trains_under_combined_1f1b_as_one_device():
    per_rank = run_distributed(_run, 2, CASES, timeout=180)
    for i, case in enumerate(CASES):
        compare(case, reference_steps(_model(case), _batches()), [r[i][0] for r in per_rank])
        for rank, r in enumerate(per_rank):
            _, log, transfers, (where, v_where) = r[i]
            assert where == (rank == 0, rank == 1, 0, 1, 1 - rank, 1 - rank)
            assert v_where == ([(True, False, 1, None), (False, True, None, 1)] if rank == 0 else
                               [(False, False, 1, 0), (False, False, 0, 1)]) + [0], v_where
            if case["dense_ends"]:
                assert log and all(not (e["f"] and e["b"]) for e in log)  # inside the chunk plan: one side each
                continue
            fused = [e for e in log if e["f"] and e["b"]]
            assert fused, f"rank {rank}: run was never called with a forward and a backward plan"
            # the hooks carry the boundary transfers: every send and receive happens inside a run
            assert transfers and all(inside for _, inside in transfers), (rank, transfers[:6])
            hooks = {h for e in fused for h in e["hooks"]}
            assert {"post_forward", "pre_backward", "post_backward"} <= hooks
            if rank == 1:
                assert "pre_forward" in hooks


# -- the building blocks ---------------------------------------------------------------------------
def test_streams_on_cpu_are_none_and_set_streams_is_a_no_op():
    if torch.cuda.is_available():
        pytest.skip("CPU meaning only")
    set_streams(high_priority=True)
    assert get_comp_stream() is None and get_comm_stream() is None


def test_compute_node_is_an_autograd_segment_with_its_outputs_and_input_grads():
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    node = ScheduleNode(lambda t: torch.tanh(t @ w), get_comp_stream, PlanEvent(), name="mm")
    (y,) = node.forward((x,))
    assert node.get_output()[0] is y and y.grad_fn is not None
    assert x.grad is None  # the node's input was detached: autograd stops at the node
    (gx,) = node.backward((torch.ones_like(y),))
    ref_x = x.detach().requires_grad_()
    torch.tanh(ref_x @ w.detach().requires_grad_()).sum().backward()
    torch.testing.assert_close(gx, ref_x.grad)
    assert node.get_grad()[0] is gx and w.grad is not None


def test_comm_node_has_explicit_backward_and_noop_node_passes_through():
    event = PlanEvent()
    node = ScheduleNode(lambda t: t.detach() * 2, get_comm_stream, event, backward_func=lambda g: g * 2, name="x2")
    x = torch.ones(2, requires_grad=True)
    (y,) = node.forward(x)
    assert y.requires_grad and y.grad_fn is None  # a new tensor outside autograd, needing a grad
    assert torch.equal(node.backward(torch.ones(2))[0], torch.full((2,), 2.0))
    noop = NoopScheduleNode(event)
    assert noop.forward((x,))[0] is x and noop.backward((y,))[0] is y


def test_free_input_releases_storage_except_persistent_buffers():
    bias = torch.ones(4, requires_grad=True)
    x = torch.randn(4)
    node = ScheduleNode(lambda t: t + bias, None, PlanEvent(), free_input=True)
    (y,) = node.forward((x,))
    assert x.untyped_storage().nbytes() == 0  # freed: the addition does not keep its input
    node.backward((torch.ones(4),))
    assert torch.equal(bias.grad, torch.ones(4))
    kept = torch.randn(4)
    register_persistent(kept)
    ScheduleNode(lambda t: t + bias, None, PlanEvent(), free_input=True, ncclep_zero_copy=True).forward((kept,))
    assert kept.untyped_storage().nbytes() == 16


def test_stage_dispatch_bwd_grad_is_identity_and_stages_the_gradient_into_the_buffer():
    buffer = torch.zeros(8, 3)
    staged = []

    def stage(grad):
        staged.append(grad.shape)
        view = buffer[: grad.shape[0]]
        view.copy_(grad)
        return view

    tokens = torch.randn(5, 3, requires_grad=True)
    out = StageDispatchBwdGrad.apply(tokens, stage)
    assert torch.equal(out, tokens)
    (out * 3).sum().backward()
    assert staged == [(5, 3)] and torch.equal(buffer[:5], torch.full((5, 3), 3.0))
    # the gradient the tokens receive is the staging buffer itself, not a copy
    assert tokens.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_make_viewless_and_virtual_stage_predicates():
    base = torch.randn(4, 3, requires_grad=True)
    view = base[1:3]
    flat = make_viewless(view)
    assert view._base is not None and flat._base is None and torch.equal(flat, view)
    flat.sum().backward()
    assert torch.equal(base.grad[1:3], torch.ones(2, 3)) and base.grad[0].abs().sum() == 0
    assert make_viewless(base) is base
    assert is_vp_first_stage(0, 2) and not is_vp_first_stage(1, 2) and is_vp_last_stage(1, 2)
    assert is_vp_first_stage(None, None) and is_vp_last_stage(0, 1)


def test_gpu_benchmark_code_paths_run_on_the_cpu():
    """scripts/gpu_check.sh runs benchmarks/bench_gpu.py on the first machine with a GPU: keep its code paths
    working where CI can run them (--dry-run: the CPU, tiny sizes)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_gpu.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "plan_overhead:" in proc.stdout and "comm_overlap:" in proc.stdout, proc.stdout + proc.stderr
    assert "gpu_compile_step_ratio:" in proc.stdout and "FAILED" not in proc.stdout, proc.stdout + proc.stderr


def test_torch_comparison_benchmark_code_paths_run():
    """benchmarks/bench_vs_torch.py --dry-run: every schedule torch has (1F1B, interleaved, both
    zero-bubble variants, ZB-V, DualPipeV), ours against torch's on a tiny model, one step each,
    with the step-1 loss and gradient check; no timing is asserted."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_vs_torch.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for schedule in ("1f1b", "interleaved", "zb1p", "zb1p_vp2", "zbv", "dualpipev"):
        assert f"ratio_vs_torch_{schedule}:" in proc.stdout, out
    assert "ratio_best_vs_torch_best:" in proc.stdout, out


def test_bubble_benchmark_replay_reproduces_the_simulator():
    """bench_bubble's replay of measured per-action durations, fed the simulator's own durations
    and transfer cost, gives the simulator's bubble (so what it reports apart from the simulator is
    the measurement, not the replay)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_bubble import replay

    from lightning_pp.schedules import CostModel, make_config, simulate

    costs = CostModel(forward=1.0, backward=1.5, weight_grad=0.7, p2p_latency=0.3)
    for schedule, pp, vp, m in (("1f1b", 3, 1, 6), ("interleaved", 2, 2, 4), ("zb1p", 3, 1, 6), ("zb1p", 2, 2, 4),
                                ("zbv", 2, 2, 5), ("dualpipev", 2, 2, 4)):
        cfg = make_config(schedule, pp, vp, m)
        sim = simulate(cfg, costs)
        timed = [[(action, end - start) for _, action, start, end in sim.rank_events(r)] for r in range(pp)]
        bubble, makespan = replay(cfg, timed, costs.p2p_time())
        assert makespan == pytest.approx(sim.pipeline_makespan), schedule
        assert bubble == pytest.approx(sim.bubble_fraction), schedule
