"""MoE blocks run node by node (the combined-1F1B path: one microbatch's forward interleaved with
another's backward) equal plain autograd, with the staging buffers in use; on CUDA the comm nodes
run on the dedicated comm stream and the buffers are symmetric memory where available. The CPU
case runs everywhere; the CUDA case needs a GPU (one process, expert-parallel size 1)."""

from __future__ import annotations

import pytest
import torch

from lightning_pp.moe import MoEBlock
from lightning_pp.runtime.plans.nodes import ChunkSchedulePlan
from lightning_pp.runtime.plans.plan import get_comm_stream, set_streams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _blocks(device):
    torch.manual_seed(3)
    blocks = [MoEBlock(32, 4, 48, num_experts=4, top_k=2, aux_loss_coeff=0.01).to(device).double() for _ in range(2)]
    for block in blocks:
        block.setup_expert_parallel(None, 0, 1, torch.device(device))  # one rank: staging on
    return blocks


def _grads(blocks):
    return {f"{i}.{n}": p.grad.clone() for i, b in enumerate(blocks) for n, p in b.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_moe_nodes_equal_plain_autograd(device):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 8, 32, generator=g, dtype=torch.float64).to(device) for _ in range(2)]
    ws = [torch.randn(2, 8, 32, generator=g, dtype=torch.float64).to(device) for _ in range(2)]

    blocks = _blocks(device)
    outs = []
    for x, w in zip(xs, ws):  # plain execution: whole-block autograd, synchronous exchanges
        h = x
        for block in blocks:
            h = block(h)
        (h * w).sum().backward()
        outs.append(h.detach())
    want = _grads(blocks)

    blocks = _blocks(device)
    if device == "cuda":
        set_streams(high_priority=True)
        assert get_comm_stream() is not None
    first, second = ChunkSchedulePlan(blocks), ChunkSchedulePlan(blocks)
    (y0,) = first.forward((xs[0],))
    # Microbatch 1's forward overlapped with microbatch 0's backward, layer by layer.
    (y1,), _ = ChunkSchedulePlan.run(second, first, grad=(ws[0],), pre_forward=lambda: (xs[1],))
    second.backward((ws[1],))
    if device == "cuda":
        torch.cuda.synchronize()
    tol = dict(rtol=1e-12, atol=1e-12) if device == "cpu" else dict(rtol=1e-10, atol=1e-12)  # CUDA index_add: atomics
    torch.testing.assert_close(y0, outs[0], **tol)
    torch.testing.assert_close(y1, outs[1], **tol)
    got = _grads(blocks)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)

    # Slots: block 0 holds microbatch 0's slot until its backward reaches block 0 (last), so
    # microbatch 1's forward there needs a second one; block 1's backward comes first and returns
    # its slot before microbatch 1's forward arrives. Each slot holds the dispatch output, the
    # combine input and the dispatch-backward gradient.
    assert [b.pool.stats.peak_slots for b in blocks] == [2, 1]
    for block in blocks:
        stats = block.pool.stats
        assert stats.allocations == 3 * stats.peak_slots
        assert stats.zero_copy_bytes == stats.staged_bytes > 0
        if device == "cuda":
            assert block.pool.slots[0]["cmb"].is_cuda


class _Logged(torch.nn.Module):
    """A layer with its own five nodes (like an MoE block), each appending to ``log`` when run.
    Its comm nodes are identities with explicit backward, as a real exchange's would be."""

    def __init__(self, name, log):
        super().__init__()
        self.name, self.log = name, log
        self.scale = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def schedule_nodes(self, event):
        from lightning_pp.runtime.plans.nodes import LayerNodes
        from lightning_pp.runtime.plans.plan import ScheduleNode, get_comm_stream, get_comp_stream

        def compute(slot):
            def run(x):
                self.log.append(("F", self.name, slot))
                return (x * self.scale,)
            return ScheduleNode(run, get_comp_stream, event, name=slot)

        def comm(slot):
            def fwd(x):
                self.log.append(("F", self.name, slot))
                return (x.detach().clone(),)

            def bwd(g):
                self.log.append(("B", self.name, slot))
                return (g.clone(),)
            return ScheduleNode(fwd, get_comm_stream, event, backward_func=bwd, name=slot)

        return LayerNodes(compute("attn"), comm("dispatch"), compute("mlp"), comm("combine"), compute("post"))


def test_layers_that_communicate_are_paired_with_each_other():
    # A first pipeline stage: [dense embedding, MoE 1, MoE 2]. The forward goes 1 then 2, the
    # backward 2 then 1; pairing by position would put MoE 2's backward with the embedding's
    # forward (nothing to hide its exchanges behind). Expected: both dense parts run on their
    # own, MoE 1 forward pairs with MoE 2 backward and MoE 2 forward with MoE 1 backward.
    log = []
    embed = torch.nn.Linear(2, 2).double()
    layers = [embed, _Logged("m1", log), _Logged("m2", log)]
    first, second = ChunkSchedulePlan(layers), ChunkSchedulePlan(layers)
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    (y,) = first.forward((x,))
    log.clear()
    (y2,), (gx,) = ChunkSchedulePlan.run(second, first, grad=(torch.ones_like(y),), pre_forward=lambda: (x,))
    comm_order = [(d, n, s) for d, n, s in log if s in ("dispatch", "combine")]
    assert comm_order == [
        ("B", "m2", "combine"), ("F", "m1", "dispatch"), ("B", "m2", "dispatch"), ("F", "m1", "combine"),
        ("B", "m1", "combine"), ("F", "m2", "dispatch"), ("B", "m1", "dispatch"), ("F", "m2", "combine"),
    ]
    # Numbers: each MoE layer scales by 1.5 three times (attn, mlp, post), so the input gradient
    # is 1.5 ** 6 times the embedding's weight, summed over its outputs.
    want = torch.ones_like(y) * 1.5 ** 6 @ embed.weight
    torch.testing.assert_close(gx, want)
