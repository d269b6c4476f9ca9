"""CUDA paths: comm stream and events of the schedule nodes, CUDA-event timeline, symmetric-memory
staging buffers. Skipped without a GPU (the CPU tests describe the same semantics)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.cuda


def _dense_layers(device):
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).to(device).double() for _ in range(3)]


def test_plan_on_comm_stream_matches_plain_autograd():
    from lightning_pp.runtime.plans.nodes import ChunkSchedulePlan
    from lightning_pp.runtime.plans.plan import get_comm_stream, get_comp_stream, set_streams

    device = torch.device("cuda")
    set_streams(high_priority=True)
    assert get_comm_stream() is not None and get_comm_stream().priority <= 0
    assert get_comp_stream() == torch.cuda.current_stream()
    layers = _dense_layers(device)
    x = torch.randn(4, 16, device=device, dtype=torch.float64)
    ref = x
    for layer in layers:
        ref = layer(ref)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad()
    plan = ChunkSchedulePlan(layers)
    (out,) = plan.forward((x,))
    plan.backward((torch.ones_like(out),))
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ref)
    for got, want in zip((p.grad for layer in layers for p in layer.parameters()), ref_grads):
        torch.testing.assert_close(got, want)


def test_timeline_uses_cuda_events():
    from lightning_pp.runtime.timeline import Timeline

    timeline = Timeline(enabled=True, device=torch.device("cuda"))
    timeline.begin_step()
    a = torch.randn(512, 512, device="cuda")
    with timeline.span("F", 0, 0, device_side=True):
        for _ in range(10):
            a = a @ a / 512
    assert timeline._pending  # resolved only at the end of the step, no sync inside it
    timeline.end_step()
    (span,) = timeline.spans
    assert span.end > span.start >= 0


def test_symmetric_staging_buffers_on_one_gpu():
    import torch.distributed as dist

    from lightning_pp.moe.buffers import StagingPool, symmetric_memory_available

    if not symmetric_memory_available(torch.device("cuda")):
        pytest.skip("torch symmetric memory is not available")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    pool = StagingPool(64, torch.bfloat16, torch.device("cuda"), group=dist.group.WORLD)
    slot = pool.acquire(100)
    buf = pool.forward_buffer(slot, 100)
    assert buf.is_cuda and buf.shape == (100, 64) and pool.symmetric
    pool.release(slot)
    assert pool.acquire(90) == slot and pool.stats.allocations == 3  # reused, not reallocated
    assert pool.combine_buffer(slot, 90).is_cuda and pool.owns(pool.combine_buffer(slot, 90))
    pool.reset()
    dist.destroy_process_group()


def test_sends_launch_from_the_comm_stream_after_the_compute_they_send():
    from lightning_pp.runtime.plans.nodes import sending
    from lightning_pp.runtime.plans.plan import get_comm_stream, set_streams

    set_streams(high_priority=True)
    a = torch.randn(2048, 2048, device="cuda")
    b = a @ a  # queued on the compute stream
    with sending():
        assert torch.cuda.current_stream() == get_comm_stream()
        c = b * 2  # runs on the comm stream: must see b complete
    torch.cuda.synchronize()
    torch.testing.assert_close(c, (a @ a) * 2)
