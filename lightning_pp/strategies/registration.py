"""Registering the strategy names with Lightning without importing Lightning.

``import lightning_pp`` must make ``Trainer(strategy="pp_1f1b")`` and ``Fabric(strategy="pp_1f1b")``
work, but the runtime and the schedule CLI should not pay for importing Lightning. So the names
are registered as factories: into Lightning's registries right away if Lightning is already
imported, otherwise the moment ``lightning.pytorch.strategies`` / ``lightning.fabric.strategies``
finish importing (a meta-path hook). The factories import the strategy classes on first use.
"""

from __future__ import annotations

import difflib
import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

def strategy_params(schedule: str) -> dict[str, Any]:
    """The constructor arguments of ``pp_<schedule>``: the schedule and its default chunks per rank."""
    from lightning_pp.schedules import schedule_spec

    vp = schedule_spec(schedule).default_vp
    return dict(schedule=schedule, **({"virtual_pipeline_size": vp} if vp != 1 else {}))


def registered() -> dict[str, dict[str, Any]]:
    """Strategy name -> constructor arguments: ``pp_<schedule>`` for every schedule of the registry
    (:mod:`lightning_pp.schedules.registry`), with its default chunks per rank. Every name is
    registered for the Trainer and for Fabric, including schedules registered later (before or
    after Lightning is imported)."""
    from lightning_pp.schedules import schedule_names

    return {f"pp_{name}": strategy_params(name) for name in schedule_names()}


def _trainer_strategy(**kwargs: Any):
    from lightning_pp.strategies.trainer import PipelineStrategy

    return PipelineStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any):
    from lightning_pp.strategies.fabric import FabricPipelineStrategy

    return FabricPipelineStrategy(**kwargs)


def unknown_name_message(name: str) -> str:
    """The error for a ``pp_*`` strategy name that is not registered: the pipeline names."""
    names = list(registered())
    close = difflib.get_close_matches(name, names, n=1)
    return (f"strategy={name!r} is not a lightning_pp pipeline strategy name"
            f"{f' (did you mean {close[0]!r}?)' if close else ''}: the names are {', '.join(names)} "
            f"(pp_<schedule>, one per schedule of lightning_pp.schedules). Or pass "
            f"lightning_pp.PipelineStrategy(schedule=...) (FabricPipelineStrategy for Fabric).")


def _name_pipeline_strategies(connector: type) -> None:
    """Make ``connector`` (Lightning's Trainer or Fabric connector, which checks the strategy name
    and answers an unknown one with a generic list) answer an unknown ``pp_*`` name with
    :func:`unknown_name_message` instead. A connector without that check is left as it is."""
    check = getattr(connector, "_check_config_and_set_final_flags", None)
    if check is None or getattr(check, "_lightning_pp", False):
        return

    @functools.wraps(check)
    def checked(self, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(strategy, str) and strategy.startswith("pp_") and strategy not in registered():
            raise ValueError(unknown_name_message(strategy))
        return check(self, strategy, *args, **kwargs)

    checked._lightning_pp = True
    connector._check_config_and_set_final_flags = checked


_TARGETS = {
    "lightning.pytorch.strategies": ("StrategyRegistry", _trainer_strategy),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", _fabric_strategy),
    "lightning.pytorch.trainer.connectors.accelerator_connector": ("_AcceleratorConnector", None),
    "lightning.fabric.connector": ("_Connector", None),
}


def _register_one(registry: Any, factory: Any, name: str, params: dict[str, Any]) -> None:
    if name not in registry:
        registry.register(name, factory, description=f"lightning_pp pipeline parallelism ({params['schedule']})", **params)


def register_into(registry: Any, factory: Any) -> None:
    for name, params in registered().items():
        _register_one(registry, factory, name, params)


def _register_module(module_name: str) -> None:
    attr, factory = _TARGETS[module_name]
    target = getattr(sys.modules[module_name], attr, None)
    if target is None:
        return
    if factory is None:  # a connector
        _name_pipeline_strategies(target)
    else:
        register_into(target, factory)


def _on_schedule_change(schedule: str, spec: Any) -> None:
    """A schedule registered (or removed) after ``import lightning_pp``: its ``pp_<name>`` into (or
    out of) the Lightning registries already imported; those imported later read the registry whole."""
    for module_name, (attr, factory) in _TARGETS.items():
        module = sys.modules.get(module_name)
        registry = getattr(module, attr, None) if module is not None else None
        if registry is None or factory is None:  # not imported yet, or a connector (no registry)
            continue
        name = f"pp_{schedule}"
        if spec is None:
            if name in registry:
                registry.remove(name)
        else:
            if name in registry:  # re-registered with replace=True: its default chunk count may differ
                registry.remove(name)
            _register_one(registry, factory, name, strategy_params(schedule))


class _RegisterWhenImported(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            _register_module(fullname)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register now where Lightning is loaded, and on import where it is not; follow the schedule
    registry from then on."""
    from lightning_pp.schedules.registry import watch_registry

    watch_registry(_on_schedule_change)
    pending = False
    for module_name in _TARGETS:
        if module_name in sys.modules:
            _register_module(module_name)
        else:
            pending = True
    if pending and not any(isinstance(f, _RegisterWhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenImported())
