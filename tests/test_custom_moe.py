"""A user's own MoE layer, written as docs/moe.md shows (an ``ExpertParallelMoE`` subclass with
``moe_pre``, ``expert_list`` and ``moe_post``, nothing else), trains under pp=2 x ep=2 exactly as
on one device; a parameter whose expert placement cannot be told is an error at setup."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from distributed import DistributedFailure, run_distributed
from moe_models import UserMoE, user_moe_dataset

TRAINER = dict(accelerator="cpu", max_steps=3, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _fit(rank, world):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    model = UserMoE()
    strategy = PipelineStrategy(pipeline_parallel_size=2, expert_parallel_size=2, virtual_pipeline_size=2,
                                schedule="combined_1f1b", num_microbatches=4)
    # Lightning's defaults: the distributed sampler shards the user's loader over the two replicas.
    L.Trainer(devices=world, strategy=strategy, **TRAINER).fit(model, DataLoader(user_moe_dataset(), batch_size=8))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.timeout(300)
def test_readme_moe_layer_pp2_ep2_equals_one_device():
    dataset = user_moe_dataset()
    shards = [list(DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]
    order = [i for k in range(0, len(shards[0]), 8) for shard in shards for i in shard[k:k + 8]]
    ref = UserMoE()
    L.Trainer(devices=1, **TRAINER).fit(ref, DataLoader(Subset(dataset, order), batch_size=16))
    expected = {name: p.detach() for name, p in ref.named_parameters()}
    seen = set()
    for rank, params in enumerate(run_distributed(_fit, 4, timeout=260)):
        experts = {name for name in params if ".experts." in name}
        # ep rank r keeps experts [2r, 2r + 2) of every block, under their one-device names
        ep_rank = rank % 2
        assert {int(name.split(".experts.")[1].split(".")[0]) for name in experts} == {2 * ep_rank, 2 * ep_rank + 1}
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-9, msg=f"rank {rank}: {name}")
            seen.add(name)
    assert seen == set(expected)


class MarkedRouterMoE(UserMoE):
    """Marks the router of the first block as an expert parameter: no expert_list() holds it."""

    def __init__(self):
        super().__init__()
        from lightning_pp.moe import mark_expert_parameters

        mark_expert_parameters(self.blocks[0].router)


class SharedExpertMoE(UserMoE):
    """One linear used both by expert 0 of the first block and outside the experts."""

    def __init__(self):
        super().__init__()
        block = self.blocks[0]
        block.shared = block.experts[0].down


def _setup_error(rank, world, cls_name):
    from lightning_pp.runtime import build_pipeline

    model = globals()[cls_name]()
    try:
        build_pipeline(model, pipeline_parallel_size=1, expert_parallel_size=2, num_microbatches=2)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_expert_placement_that_cannot_be_told_is_an_error_at_setup_naming_the_parameter():
    try:
        marked = run_distributed(_setup_error, 2, "MarkedRouterMoE", timeout=90)
        shared = run_distributed(_setup_error, 2, "SharedExpertMoE", timeout=90)
    except DistributedFailure as exc:  # pragma: no cover - the message is the diagnosis
        raise AssertionError(str(exc)) from None
    for message in marked:
        assert message is not None and "blocks.0.router.weight" in message and "expert_list()" in message, message
    for message in shared:
        assert message is not None and "blocks.0.experts.0.down.weight" in message, message
        assert "both to an expert" in message, message
