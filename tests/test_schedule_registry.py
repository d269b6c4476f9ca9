"""A schedule of the user's own, registered through the public registry, with no edit to the
package: it validates, simulates, prints in the CLI, runs in the runtime and trains under the
Trainer, equal to one device; a table that breaks the rules is refused when a configuration is made."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distributed import run_distributed
from lightning_models import PipeRegressor
from lightning_pp.runtime import executor_of
from exactness_models import plain_batches
from models import ToyRegressor, pipelined_run, reference_run
from lightning_pp.schedules import (
    ScheduleSpec,
    backward,
    forward,
    make_config,
    register_schedule,
    schedule_names,
    schedule_spec,
    simulate,
    unregister_schedule,
)


def gpipe_lifo(cfg, rank):
    """Every forward, then the backwards newest first (GPipe with a last-in-first-out drain)."""
    order = [(mb, chunk) for chunk in range(cfg.vp) for mb in range(cfg.num_microbatches)]
    return [forward(*f) for f in order] + [backward(*f) for f in reversed(order)]


# What a user's module does once, at import (the spawned ranks import this module too).
if "gpipe_lifo" not in schedule_names():
    register_schedule(ScheduleSpec("gpipe_lifo", gpipe_lifo, description="GPipe, backwards newest first"))


def test_a_registered_schedule_validates_simulates_and_prints(capsys):
    from lightning_pp.schedules import SCHEDULES, config_for_batch, rank_actions
    from lightning_pp.schedules.__main__ import main

    assert "gpipe_lifo" in SCHEDULES  # the derived names follow the registry
    cfg = make_config("gpipe_lifo", pp=2, vp=2, num_microbatches=4)
    assert rank_actions(cfg, 0)[-1] == backward(0, 0)  # newest first: microbatch 0's last
    result = simulate(cfg)
    # All forwards then all backwards, as GPipe: GPipe's bubble, every microbatch held.
    gpipe = simulate(make_config("gpipe", pp=2, vp=2, num_microbatches=4))
    assert result.bubble_fraction == pytest.approx(gpipe.bubble_fraction)
    assert result.peak_inflight == gpipe.peak_inflight
    assert config_for_batch(cfg, 3).schedule == "gpipe_lifo"  # runs any count: no fallback needed
    assert main(["--schedule", "gpipe_lifo", "--pp", "2", "--vp", "2", "--num-microbatches", "4", "--width", "200"]) == 0
    assert "schedule=gpipe_lifo pp=2 vp=2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="already registered"):
        register_schedule(ScheduleSpec("gpipe_lifo", gpipe_lifo))


def test_a_table_that_breaks_the_rules_is_refused_when_the_configuration_is_made():
    def forgets_a_backward(cfg, rank):
        return gpipe_lifo(cfg, rank)[:-1]  # drops the last backward: microbatch 0's

    def weight_before_backward(cfg, rank):
        from lightning_pp.schedules import weight_grad

        return [weight_grad(0, 0)] + gpipe_lifo(cfg, rank)

    register_schedule(ScheduleSpec("w_first", weight_before_backward))
    register_schedule(ScheduleSpec("short_table", forgets_a_backward))
    try:
        with pytest.raises(ValueError, match="no B for microbatch 0, chunk 0 before it"):
            make_config("w_first", pp=2, num_microbatches=2)
        with pytest.raises(ValueError, match="microbatch 0, chunk 0 runs 1 forward.s. and 0 backward"):
            make_config("short_table", pp=2, num_microbatches=2)  # the gradient of microbatch 0 would be lost
    finally:
        unregister_schedule("w_first")
        unregister_schedule("short_table")
    with pytest.raises(ValueError, match="not a known schedule"):
        schedule_spec("w_first")


def _runtime_and_trainer(rank, world):
    from lightning_pp import PipelineStrategy
    from lightning_pp.runtime import build_pipeline

    torch.manual_seed(0)
    model = ToyRegressor(blocks=4).double()
    executor = build_pipeline(model, pipeline_parallel_size=2, virtual_pipeline_size=2, num_microbatches=4,
                              schedule="gpipe_lifo")
    runtime = pipelined_run(executor, model, plain_batches(5, 8, steps=3, dim_in=5, dim_out=3))
    executor.close()
    os.environ["LOCAL_RANK"] = str(rank)
    module = PipeRegressor(blocks=4)
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=3, precision="64-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=PipelineStrategy(virtual_pipeline_size=2, num_microbatches=4, schedule="gpipe_lifo"))
    trainer.fit(module, DataLoader(_dataset(), batch_size=8))
    names = executor_of(module).partition.parameter_names
    return runtime, {names[id(p)]: p.detach().clone() for p in module.parameters()}


def _dataset():
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(24, 5, generator=g), torch.randn(24, 3, generator=g))


@pytest.mark.timeout(200)
def test_a_registered_schedule_trains_in_the_runtime_and_under_the_trainer_as_one_device():
    torch.manual_seed(0)
    ref_losses, _, ref_params = reference_run(ToyRegressor(blocks=4).double(), plain_batches(5, 8, steps=3, dim_in=5, dim_out=3))
    module = PipeRegressor(blocks=4)
    dataset = _dataset()
    L.Trainer(accelerator="cpu", devices=1, max_steps=3, precision="64-true", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(
        module, DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, num_replicas=1, rank=0)))
    trainer_ref = {n: p.detach() for n, p in module.named_parameters()}
    for (losses, _, params), trained in run_distributed(_runtime_and_trainer, 2, timeout=180):
        assert losses == pytest.approx(ref_losses, rel=1e-9)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-9, atol=1e-12, msg=name)
        for name, value in trained.items():
            torch.testing.assert_close(value, trainer_ref[name].to(value.dtype), rtol=1e-9, atol=1e-12, msg=name)


_AFTER_LIGHTNING = r"""
import lightning as L
import lightning_pp
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from lightning_pp.schedules import ScheduleSpec, backward, forward, register_schedule, unregister_schedule

def late(cfg, rank):
    order = [(mb, c) for c in range(cfg.vp) for mb in range(cfg.num_microbatches)]
    return [forward(*f) for f in order] + [backward(*f) for f in reversed(order)]

register_schedule(ScheduleSpec("late_gpipe", late, description="registered after import lightning"))
trainer = L.Trainer(strategy="pp_late_gpipe", accelerator="cpu", devices=1, logger=False)
assert type(trainer.strategy).__name__ == "PipelineStrategy", trainer.strategy
assert trainer.strategy.config.schedule == "late_gpipe", trainer.strategy.config
fabric = L.Fabric(strategy="pp_late_gpipe", accelerator="cpu", devices=1)
assert type(fabric.strategy).__name__ == "FabricPipelineStrategy", fabric.strategy
unregister_schedule("late_gpipe")
assert "pp_late_gpipe" not in StrategyRegistry and "pp_late_gpipe" not in STRATEGY_REGISTRY
print("ok")
"""


def test_a_schedule_registered_after_lightning_is_imported_is_a_strategy_name():
    """``pp_<name>`` for the Trainer and Fabric whether the schedule was registered before or after
    Lightning was imported (a fresh interpreter: this test process imported Lightning long ago)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _AFTER_LIGHTNING], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_configuration_keeps_its_spec_and_pickles_by_name():
    """A ScheduleConfig takes its spec when made: replacing the registered spec later does not change
    what an existing configuration runs; a configuration (whose spec may hold lambdas, as zbv's
    does) pickles, and comes back with the spec registered under its name."""
    import pickle

    from lightning_pp.schedules import rank_actions

    spec = ScheduleSpec("kept_spec", gpipe_lifo, description="a spec replaced below")
    register_schedule(spec)
    try:
        cfg = make_config("kept_spec", 2, 1, 4)
        before = rank_actions(cfg, 0)
        def fifo(c, r):
            order = [(mb, chunk) for chunk in range(c.vp) for mb in range(c.num_microbatches)]
            return [forward(*f) for f in order] + [backward(*f) for f in order]

        register_schedule(ScheduleSpec("kept_spec", fifo, description="replaced"), replace=True)
        assert cfg.spec is spec and rank_actions(cfg, 0) == before
        assert rank_actions(make_config("kept_spec", 2, 1, 4), 0) != before
        assert make_config("kept_spec", 2, 1, 4).spec is not spec
    finally:
        unregister_schedule("kept_spec")
    zbv = make_config("zbv", 2, 2, 4)
    assert pickle.loads(pickle.dumps(zbv)).spec is zbv.spec is schedule_spec("zbv")
