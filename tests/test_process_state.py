"""The process's own pipeline state lives in one place (``lightning_pp.runtime.process``), which
tests can reset, and nothing there grows without bound: a staging pool's buffers leave the
persistent set when they are replaced or released. What the package knows about users' objects
is one weak-keyed table there (issue 35): only the few attribute markers that must travel with
their objects remain, a record dies with its object (cached values do not keep their object
alive), and a layer measured as a copy (``layout="auto"``) is measured as the layer runs."""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from models import Block, Layered
from lightning_pp.moe.buffers import StagingPool
from lightning_pp.runtime import process
from lightning_pp.runtime.process import CHECKPOINT, COMPILED, HF_LAYERS, OPTIMIZER_INDEX, STACKED_HOOKS, fact, facts

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pp"
# The markers that stay attributes (runtime/process.py says why), and the prefix the FSDP2
# parameter replacement copies them by.
ATTRIBUTE_MARKERS = {"_lpp_", "_lpp_expert", "_lpp_stacked", "_lpp_frozen_stage", "_lpp_executor"}


def test_only_the_markers_that_travel_with_their_objects_are_attributes():
    found = {m for path in PACKAGE.rglob("*.py") for m in re.findall(r"_lpp_[a-z_]*", path.read_text())}
    assert found <= ATTRIBUTE_MARKERS and len(found) <= 5, (
        f"private _lpp_ names in lightning_pp: {sorted(found)}; a new fact about users' objects belongs in "
        f"lightning_pp.runtime.process's table (facts/fact), not in an attribute: {sorted(found - ATTRIBUTE_MARKERS)}")


def _freed(make) -> bool:
    """Whether the object ``make()`` returns (after recording its facts) is freed once dropped."""
    obj = make()
    ref = weakref.ref(obj)
    del obj
    gc.collect()
    return ref() is None


def test_a_record_dies_with_its_object_and_its_cached_values_do_not_keep_it():
    def layer():
        module = nn.Linear(2, 2)
        facts(module).update({CHECKPOINT: True, COMPILED: True, STACKED_HOOKS: True})
        assert fact(module, CHECKPOINT) and fact(nn.Linear(2, 2), CHECKPOINT, False) is False
        return module

    before = len(process._TABLE)
    assert _freed(layer) and len(process._TABLE) == before

    def optimizer():
        from lightning_pp.strategies.optimizer_state import optimizer_index

        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        index = optimizer_index(model, opt)
        assert fact(opt, OPTIMIZER_INDEX)[1] is index and optimizer_index(model, opt) is index  # the cache
        return opt

    assert _freed(optimizer) and len(process._TABLE) == before
    with pytest.raises(KeyError, match="not a fact"):
        fact(nn.Linear(1, 1), "checkpointed")


def test_a_transformers_models_cached_layers_do_not_keep_it_alive():
    pytest.importorskip("transformers")
    from hf_models import make_hf
    from lightning_pp.integrations.hf import pipeline_layers

    def model():
        m = make_hf("llama")
        layers = pipeline_layers(m)
        assert fact(m, HF_LAYERS) is layers and pipeline_layers(m) is layers
        return m

    assert _freed(model)


class _Net(Layered):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(64) for _ in range(4))

    def pipeline_layers(self):
        return list(self.blocks)


def test_a_layer_measured_as_a_copy_keeps_its_recomputation():
    """``layout="auto"`` measures a deep copy of each layer: the copy is recomputed in backward as
    the layer is, so it keeps only its input (identical blocks, the third marked; the last one
    carries the loss, so the second and third are compared)."""
    from lightning_pp.runtime.measure import measure_layer_costs

    torch.manual_seed(0)
    net = _Net().double()
    facts(net.blocks[2])[CHECKPOINT] = True
    batch = (torch.randn(16, 64, dtype=torch.float64), torch.randn(16, 64, dtype=torch.float64))
    costs = measure_layer_costs(net, net.pipeline_layers(), batch, num_microbatches=2, repeats=1).layers
    plain, recomputed = costs[1].activation_bytes, costs[2].activation_bytes
    hidden = 8 * 2 * 64 * 8  # one of the block's hidden activations (8 rows, 2 * 64 wide, float64)
    assert plain >= 2 * hidden and recomputed < hidden, (plain, recomputed)


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
