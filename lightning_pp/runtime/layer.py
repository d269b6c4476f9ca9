"""How one pipeline layer runs: called with a tuple input unpacked, recomputed in backward where
the activation-checkpointing policy chose it. Used by a chunk's plain forward and by the schedule
plans' compute nodes alike."""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pp.runtime.process import CHECKPOINT, CHECKPOINT_COMPILED, fact
from lightning_pp.runtime.protocols import ProvidesScheduleNodes

# Which pipeline layers recompute their forward in backward: all that can (True), none (False),
# or the layers that are instances of the given classes (Lightning's FSDP uses the same form).
CheckpointPolicy = Union[bool, Sequence[type]]


def run_layer(layer: nn.Module, x: Any) -> Any:
    """Call one pipeline layer (a tuple input is unpacked). A layer marked for activation
    checkpointing keeps only its inputs and recomputes its forward during backward (a layer
    compiled by ``compile=`` has the checkpoint inside its compiled graph: nothing is added here)."""
    args = x if isinstance(x, tuple) else (x,)
    if fact(layer, CHECKPOINT, False) and not fact(layer, CHECKPOINT_COMPILED, False) \
            and torch.is_grad_enabled():
        return checkpoint(layer, *args, use_reentrant=False)
    return layer(*args)


def checkpointed_layers(layers: Sequence[nn.Module], policy: CheckpointPolicy) -> list[int]:
    """Indices of ``layers`` that ``policy`` checkpoints; raises ``ValueError`` for a bad policy
    (before any process group exists). Layers that communicate inside their forward (an MoE
    block's expert all-to-all: they have ``schedule_nodes``) are never recomputed: with
    ``True`` they are left out, and naming their class is an error."""
    if isinstance(policy, bool):
        classes: tuple = ()
    else:
        try:
            classes = tuple(policy)
        except TypeError:
            classes = (None,)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise ValueError(
                f"activation_checkpointing={policy!r} is invalid: pass True (every layer that can be "
                f"recomputed), False, or a list of nn.Module classes whose layers are recomputed, "
                f"e.g. [TransformerBlock]."
            )
    chosen = []
    for i, layer in enumerate(layers):
        if policy is False or (classes and not isinstance(layer, classes)):
            continue
        if isinstance(layer, ProvidesScheduleNodes):
            if classes:
                raise ValueError(
                    f"activation_checkpointing lists {type(layer).__name__} (pipeline layer {i}), whose "
                    f"forward communicates (expert all-to-all): recomputing it in backward would run its "
                    f"all-to-alls again. Leave {type(layer).__name__} out of the list and checkpoint "
                    f"inside it instead (e.g. its attention, with torch.utils.checkpoint)."
                )
            continue
        chosen.append(i)
    return chosen
