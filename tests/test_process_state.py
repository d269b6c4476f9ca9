"""The process's own pipeline state lives in one place (``lightning_pp.runtime.process``), which
tests can reset, and nothing there grows without bound: a staging pool's buffers leave the
persistent set when they are replaced or released."""

from __future__ import annotations

import torch

from lightning_pp.moe.buffers import StagingPool
from lightning_pp.runtime import process


def test_staging_buffers_leave_the_persistent_set_when_replaced_or_released():
    before = set(process.state().persistent_storages)
    pool = StagingPool(hidden=4, dtype=torch.float32, device=torch.device("cpu"))
    slot = pool.acquire(8)
    first = {buf.untyped_storage().data_ptr() for buf in pool.slots[slot].values()}
    assert first <= process.state().persistent_storages
    pool.release(slot)
    pool.acquire(1000)  # larger than the buffers: each is replaced
    now = {buf.untyped_storage().data_ptr() for buf in pool.slots[0].values()}
    assert now <= process.state().persistent_storages and not (first - now) & process.state().persistent_storages
    pool.reset()
    assert process.state().persistent_storages == before


def test_reset_forgets_the_process_state():
    process.state().failed_steps += 1
    process.state().warned_step_methods.add(("Module", "training_step"))
    process.reset()
    assert process.state().failed_steps == 0 and not process.state().warned_step_methods
