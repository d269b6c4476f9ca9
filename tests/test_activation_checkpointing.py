"""The runtime's activation checkpointing (``activation_checkpointing=``): the chosen layers
recompute their forward in backward (and only then), MoE blocks are never recomputed, and a bad
policy is refused before any process group exists. Equality with one device is in
test_runtime_equivalence.py (cases with ``ac``)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models import Block, ToyRegressor
from moe_models import TinyMoELM
from lightning_pp.runtime import executor_of
from lightning_pp.runtime.process import CHECKPOINT, fact

M = 4


def _count_forwards(rank, world, policy):
    from lightning_pp.runtime import build_pipeline

    torch.manual_seed(0)
    model = ToyRegressor(blocks=6).double()
    executor = build_pipeline(model, pipeline_parallel_size=world, num_microbatches=M, activation_checkpointing=policy)
    calls = {}

    def counting(layer):
        name, forward = type(layer).__name__, layer.forward

        def run(*args):
            calls[name] = calls.get(name, 0) + 1
            return forward(*args)

        return run

    for chunk in executor.partition.chunks:
        for layer in chunk.layers:
            layer.forward = counting(layer)  # forward hooks do not fire when checkpoint recomputes
    batch = (torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64))
    executor.train_step(batch)
    trained = dict(calls)
    calls.clear()
    executor.eval_step(batch)
    return trained, dict(calls)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", [[Block], True, False])
def test_checkpointed_layers_recompute_their_forward_in_backward_only(policy):
    # 8 layers on 2 stages: [Linear, Block x3] | [Block x3, Linear]. A recomputed layer runs its
    # forward twice per microbatch in a training step (forward, then again in backward), once in
    # evaluation.
    for rank, (trained, evaluated) in enumerate(run_distributed(_count_forwards, 2, policy, timeout=100)):
        blocks_x = 2 if policy else 1
        linear_x = 2 if policy is True else 1
        assert trained == {"Linear": linear_x * M, "Block": 3 * blocks_x * M}, f"rank {rank}"
        assert evaluated == {"Linear": M, "Block": 3 * M}, f"rank {rank}"


def test_moe_blocks_are_never_recomputed():
    from lightning_pp.moe import MoEBlock
    from lightning_pp.runtime.layer import checkpointed_layers

    layers = list(TinyMoELM(blocks=2).pipeline_layers())  # embedding, 2 MoE blocks, head
    assert checkpointed_layers(layers, True) == [0, 3]
    with pytest.raises(ValueError, match=r"activation_checkpointing lists MoEBlock \(pipeline layer 1\).*all-to-all"):
        checkpointed_layers(layers, [MoEBlock])


@pytest.mark.parametrize("policy", ["yes", [], [int], 3])
def test_bad_policy_is_refused_before_any_process_group(policy):
    from lightning_pp.runtime import build_pipeline

    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"activation_checkpointing=.* is invalid: pass True"):
        build_pipeline(ToyRegressor(), pipeline_parallel_size=2, activation_checkpointing=policy)


def _fit(rank, world, policy):
    import os

    import lightning as L

    from lightning_models import PipeRegressor, loader
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = PipeRegressor()
    strategy = PipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, activation_checkpointing=policy)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=3, precision="64-true",
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(model, loader(8))
    executor = executor_of(model)
    marked = [fact(layer, CHECKPOINT, False) for chunk in executor.partition.chunks for layer in chunk.layers]
    names = executor.partition.parameter_names
    return marked, {names[id(p)]: p.detach().clone() for p in model.parameters()}


@pytest.mark.timeout(200)
def test_trainer_fit_with_checkpointed_blocks_equals_the_fit_without():
    plain = run_distributed(_fit, 2, False, timeout=160)
    recomputed = run_distributed(_fit, 2, [Block], timeout=160)
    layouts = [[False, True, True, True], [True, True, True, False]]  # [Linear, Block x3] | [Block x3, Linear]
    for (marked_plain, want), (marked, got), layout in zip(plain, recomputed, layouts):
        assert not any(marked_plain) and marked == layout
        for name, value in got.items():
            assert torch.equal(value, want[name]), name  # recomputation repeats the same operations
