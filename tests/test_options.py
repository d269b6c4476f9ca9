"""The pipeline's options are declared once, in ``PipelineConfig``: the strategies' typed
constructor arguments (what LightningCLI reads) are held to its fields, in names, order, defaults
and annotations, so they cannot drift; ``build_pipeline`` takes the fields by name only."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from lightning_pp import FabricPipelineStrategy, PipelineStrategy
from lightning_pp.runtime import PipelineConfig, build_pipeline
from lightning_pp.runtime.config import STRATEGY_NAMES


def _pipeline_parameters(cls) -> list[inspect.Parameter]:
    names = [STRATEGY_NAMES.get(f.name, f.name) for f in dataclasses.fields(PipelineConfig)]
    params = inspect.signature(cls.__init__).parameters
    return [params[name] for name in names if name in params]


@pytest.mark.parametrize("cls", [PipelineStrategy, FabricPipelineStrategy])
def test_strategy_arguments_are_the_config_fields(cls):
    fields = dataclasses.fields(PipelineConfig)
    config_hints = typing.get_type_hints(PipelineConfig)
    strategy_hints = typing.get_type_hints(cls.__init__)
    params = _pipeline_parameters(cls)
    assert [p.name for p in params] == [STRATEGY_NAMES.get(f.name, f.name) for f in fields]  # all, same order
    signature_order = list(inspect.signature(cls.__init__).parameters)[1:len(fields) + 1]
    assert signature_order == [p.name for p in params], "the pipeline options come first, in the config's order"
    for field, param in zip(fields, params):
        assert param.default == field.default, f"{cls.__name__}({param.name}=...) default drifted from PipelineConfig"
        assert strategy_hints[param.name] == config_hints[field.name], f"{cls.__name__}.{param.name} annotation drifted"


def test_the_config_is_made_from_the_constructor_arguments():
    strategy = PipelineStrategy(pipeline_parallel_size=2, num_microbatches=6, schedule="interleaved",
                                virtual_pipeline_size=2, nonfinite="skip", pipeline_watchdog=False)
    assert strategy.config == PipelineConfig(pipeline_parallel_size=2, num_microbatches=6, schedule="interleaved",
                                             virtual_pipeline_size=2, nonfinite="skip", watchdog=False)
    with pytest.raises(AttributeError):
        strategy.config = PipelineConfig()  # read-only: one configuration per strategy


@pytest.mark.parametrize("cls", [PipelineStrategy, FabricPipelineStrategy])
def test_every_constructor_argument_reaches_its_field(cls):
    """Each option given a value other than its default arrives in the configuration under its
    field: the constructors name every field (a new field without a value here fails the test)."""
    import datetime

    values = dict(pipeline_parallel_size=2, expert_parallel_size=2, tensor_parallel_size=2, virtual_pipeline_size=2,
                  num_microbatches=6,
                  schedule="interleaved", layout=[1, 2, 2, 1], microbatch_group_size=2,
                  timeout=datetime.timedelta(seconds=7), nonfinite="skip", watchdog=False,
                  activation_checkpointing=True, static_shapes=False, check_batches="warn", broadcast_batches=True,
                  data_parallel_sharding="full", compile={"backend": "aot_eager"})
    fields = dataclasses.fields(PipelineConfig)
    assert sorted(values) == sorted(f.name for f in fields), "give every field a value here"
    assert all(values[f.name] != f.default for f in fields)
    strategy = cls(**{STRATEGY_NAMES.get(name, name): value for name, value in values.items()})
    assert strategy.config == PipelineConfig(**values)


def test_build_pipeline_takes_options_by_name_only():
    params = inspect.signature(build_pipeline).parameters
    assert [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == ["module", "config"]
    with pytest.raises(TypeError, match="unknown pipeline option.*microbatches.*num_microbatches"):
        PipelineConfig.with_options(None, {"microbatches": 4})


def test_every_option_type_is_importable_from_the_configurations_module():
    """One import gives a user (or a strategy) every type an option is declared with."""
    import lightning_pp.runtime.config as config

    hints = typing.get_type_hints(PipelineConfig, vars(config))
    names = {n for hint in hints.values() for n in _type_names(hint)}
    assert names and sorted(n for n in names if not hasattr(config, n)) == []
    for name in ("Layout", "CheckpointPolicy", "CompileOption", "DataParallelSharding", "WatchdogConfig"):
        assert hasattr(config, name), name


def _type_names(hint) -> set:
    """The names of the package's own types inside a (possibly nested) annotation."""
    found = set()
    module = getattr(hint, "__module__", "") or ""
    if module.startswith("lightning_pp") and getattr(hint, "__name__", None):
        found.add(hint.__name__)
    for arg in typing.get_args(hint):
        found |= _type_names(arg)
    return found
