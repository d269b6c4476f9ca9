"""Lightning Trainer and Fabric strategies (the only layer that imports Lightning)."""

from lightning_pp.strategies.core import PipelineEngine, PipelineOptions
from lightning_pp.strategies.trainer import PipelineStrategy

__all__ = ["PipelineEngine", "PipelineOptions", "PipelineStrategy"]
