"""Registering the strategy names with Lightning without importing Lightning.

``import lightning_pp`` must make ``Trainer(strategy="pp_1f1b")`` and ``Fabric(strategy="pp_1f1b")``
work, but the runtime and the schedule CLI should not pay for importing Lightning. So the names
are registered as factories: into Lightning's registries right away if Lightning is already
imported, otherwise the moment ``lightning.pytorch.strategies`` / ``lightning.fabric.strategies``
finish importing (a meta-path hook). The factories import the strategy classes on first use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

def registered() -> dict[str, dict[str, Any]]:
    """Strategy name -> constructor arguments: ``pp_<schedule>`` for every schedule of the registry
    (:mod:`lightning_pp.schedules.registry`), with its default chunks per rank. Every name is
    registered for the Trainer and for Fabric."""
    from lightning_pp.schedules import schedule_names, schedule_spec

    names = {}
    for name in schedule_names():
        vp = schedule_spec(name).default_vp
        names[f"pp_{name}"] = dict(schedule=name, **({"virtual_pipeline_size": vp} if vp != 1 else {}))
    return names


def _trainer_strategy(**kwargs: Any):
    from lightning_pp.strategies.trainer import PipelineStrategy

    return PipelineStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any):
    from lightning_pp.strategies.fabric import FabricPipelineStrategy

    return FabricPipelineStrategy(**kwargs)


_TARGETS = {
    "lightning.pytorch.strategies": ("StrategyRegistry", _trainer_strategy),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", _fabric_strategy),
}


def register_into(registry: Any, factory: Any) -> None:
    for name, params in registered().items():
        if name not in registry:
            registry.register(name, factory, description=f"lightning_pp pipeline parallelism ({params['schedule']})", **params)


def _register_module(module_name: str) -> None:
    attr, factory = _TARGETS[module_name]
    register_into(getattr(sys.modules[module_name], attr), factory)


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
    """Register now where Lightning is loaded, and on import where it is not."""
    pending = False
    for module_name in _TARGETS:
        if module_name in sys.modules:
            _register_module(module_name)
        else:
            pending = True
    if pending and not any(isinstance(f, _RegisterWhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenImported())
