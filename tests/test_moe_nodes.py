"""MoE blocks run node by node (the combined-1F1B path: one microbatch's forward interleaved with
another's backward) equal plain autograd, with the staging buffers in use; on CUDA the comm nodes
run on the dedicated comm stream and the buffers are symmetric memory where available. The CPU
case runs everywhere; the CUDA case needs a GPU (one process, expert-parallel size 1)."""

from __future__ import annotations

import pytest
import torch

from lightning_pp.moe import MoEBlock
from lightning_pp.runtime.nodes import ChunkSchedulePlan, StreamSet

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
    streams = StreamSet(torch.device(device))
    if device == "cuda":
        assert streams.comm is not None
    first, second = ChunkSchedulePlan(blocks, streams), ChunkSchedulePlan(blocks, streams)
    (y0,) = first.forward((xs[0],))
    # Microbatch 1's forward overlapped with microbatch 0's backward, layer by layer.
    (y1,), _ = ChunkSchedulePlan.run(second, first, (xs[1],), (ws[0],))
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
