"""lightning_pp: pipeline and expert parallelism for PyTorch Lightning and Fabric.

Importing the package registers the strategy names (``pp_1f1b``, ``pp_interleaved``,
``pp_combined_1f1b``, ``pp_gpipe``) with both the Trainer's and Fabric's registries.
"""

from lightning_pp.strategies import PipelineStrategy
from lightning_pp.strategies.trainer import register_names


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    register_names(StrategyRegistry, PipelineStrategy)


_register()

__all__ = ["PipelineStrategy"]
__version__ = "0.1.0"
