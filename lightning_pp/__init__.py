"""lightning_pp: pipeline and expert parallelism for PyTorch Lightning and Fabric.

Importing the package registers the strategy names (``pp_<schedule>`` for every schedule:
``pp_1f1b``, ``pp_interleaved``, ``pp_combined_1f1b``, ``pp_gpipe``, ``pp_zb1p``, ``pp_zbv``,
``pp_dualpipev``) with the Trainer's and Fabric's registries. Lightning itself is
imported only when it is used (see ``strategies/registration.py``), also for the lazily exported
``PipelineMonitor`` callback (``lightning_pp.callbacks``).
"""

from typing import Any

from lightning_pp.strategies.registration import install as _install

_install()

__all__ = ["FabricPipelineStrategy", "PipelineMonitor", "PipelineStrategy"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "PipelineMonitor":
        from lightning_pp.callbacks import PipelineMonitor

        return PipelineMonitor
    if name in __all__:
        import lightning_pp.strategies as strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
