"""Lightning Trainer and Fabric strategies (the layer built on Lightning; the monitor callback and the
litgpt integration use it too, the layers below never do: tests/test_imports.py).

The classes are imported on first access, so importing the package stays cheap.
"""

from typing import Any

__all__ = ["FabricPipelineStrategy", "PipelineStrategy"]


def __getattr__(name: str) -> Any:
    if name == "PipelineStrategy":
        from lightning_pp.strategies.trainer import PipelineStrategy

        return PipelineStrategy
    if name == "FabricPipelineStrategy":
        from lightning_pp.strategies.fabric import FabricPipelineStrategy

        return FabricPipelineStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
