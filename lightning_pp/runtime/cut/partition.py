"""Cutting a model that implements the pipeline protocol into virtual-stage chunks.

The protocol (:class:`~lightning_pp.runtime.protocols.PipelineModel`)::

    pipeline_layers() -> list[nn.Module]   # ordered; layer i's output is layer i+1's input
    pipeline_loss(output, batch)           # last stage, per microbatch: mean, or (sum, count)
    pipeline_inputs(batch)                 # optional; default batch[0] (or batch itself)

A layer whose input is a tuple is called with the tuple unpacked (``layer(*x)``), so layers can
pass ``(hidden, mask)`` along.

Cutting keeps the user's root module (so optimizers, Lightning and checkpoints see the usual
global parameter names) but replaces every layer this rank does not own with a parameterless
placeholder, so only the owned chunks' parameters and buffers stay in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_pp.runtime.layer import run_layer
from lightning_pp.runtime.protocols import OwnsSchedulePlan
from lightning_pp.runtime.cut.layout import Layout, resolve_layout
from lightning_pp.schedules.actions import stage_owner, virtual_stage

REQUIRED_METHODS = ("pipeline_layers", "pipeline_loss")

def check_protocol(module: Any) -> None:
    """Raise ``TypeError`` naming every missing protocol method."""
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            f"{type(module).__name__} cannot be pipelined: it is missing "
            f"{', '.join(f'`{m}`' for m in missing)}. Add `def pipeline_layers(self) -> list[nn.Module]` "
            f"(ordered layers, embedding first, head last) and `def pipeline_loss(self, output, batch)` "
            f"(per-microbatch loss on the last stage), and optionally `pipeline_inputs(self, batch)`."
        )


def default_pipeline_inputs(batch: Any) -> Any:
    """``batch[0]`` for tuples and lists; any other batch (a dict, a tensor) is passed whole."""
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


class NotOnThisStage(nn.Module):
    """Placeholder for a layer that lives on another pipeline rank."""

    def __init__(self, layer_index: int, stage: int, name: str):
        super().__init__()
        self.layer_index = layer_index
        self.stage = stage
        self.layer_name = name
        # A one-device state dict holds this module's entries: another rank loads them, so
        # model.load_state_dict(one_device_state_dict) works after the cut, strict included.
        self._register_load_state_dict_pre_hook(drop_keys_held_elsewhere)

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"layer {self.layer_index} ({self.layer_name}) lives on virtual stage {self.stage}, not on "
            f"this pipeline rank: a pipelined model runs through its pipeline step, not by calling its "
            f"layers. Use `self.trainer.strategy.pipeline_step(batch)` (Trainer, manual optimization), "
            f"`fabric.strategy.pipeline_step(model, batch)` (Fabric) or `executor.train_step(batch)`."
        )

    def extra_repr(self) -> str:
        return f"layer={self.layer_index}, stage={self.stage}"


def drop_keys_held_elsewhere(state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook of a placeholder for a module another rank holds (a layer of
    another stage, an expert of another expert-parallel rank): that rank loads those keys."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]


class StageChunk:
    """The consecutive layers of one virtual stage, run in order (not an ``nn.Module``: the
    parameters stay registered under their global names in the user's module)."""

    def __init__(self, stage: int, first_layer: int, layers: list[nn.Module]):
        self.stage = stage
        self.first_layer = first_layer
        self.layers = layers

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = run_layer(layer, x)
        return x

    def build_schedule_plan(self, *inputs: Any):
        """This chunk's plan for one microbatch (``lightning_pp.runtime.plans.plan``): its layer's own,
        when the chunk is one layer that brings a plan class, else a ``ChunkSchedulePlan`` of its
        layers. ``inputs``: the chunk's forward inputs where known (the first stage), else none
        (the plan's ``run`` gets them from its ``pre_forward`` hook)."""
        if len(self.layers) == 1 and isinstance(self.layers[0], OwnsSchedulePlan):
            return self.layers[0].build_schedule_plan(*inputs)
        from lightning_pp.runtime.plans.nodes import ChunkSchedulePlan  # nodes imports this module

        return ChunkSchedulePlan(self.layers, inputs)

    def parameters(self):
        seen = set()
        for layer in self.layers:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


@dataclass
class TiedParameter:
    """A parameter used by layers on more than one pipeline rank (e.g. embedding and head)."""

    name: str
    pp_ranks: tuple[int, ...]  # the pipeline ranks whose layers use it, ascending


@dataclass
class Partition:
    layout: list[int]  # layers per virtual stage
    layer_stage: list[int]  # virtual stage of every layer
    chunks: list[StageChunk]  # this rank's chunks, index = local chunk id
    tied: list[TiedParameter] = field(default_factory=list)
    parameter_names: dict[int, str] = field(default_factory=dict)  # id(param) -> global name
    # Canonical names of every parameter of the uncut model in ``module.parameters()`` order (tied
    # parameters once), identical on every rank: the order a one-device optimizer numbers them in.
    parameter_order: list[str] = field(default_factory=list)

    def follow(self, replaced: dict[int, nn.Parameter]) -> None:
        """Index parameters that were replaced (materialised from the meta device) by their new ids."""
        self.parameter_names = {id(replaced[pid]) if pid in replaced else pid: name
                                for pid, name in self.parameter_names.items()}

    def forget_freed(self, module: nn.Module) -> None:
        """Keep in ``parameter_names`` only the parameters ``module`` still holds (the cut and expert
        parallelism free the others; their ids may be reused by objects made later)."""
        live = {id(p) for p in module.parameters()}
        self.parameter_names = {pid: name for pid, name in self.parameter_names.items() if pid in live}


def layer_list(module: nn.Module) -> list[nn.Module]:
    """``module.pipeline_layers()`` as a list, checked (call it once: it may build adapters)."""
    layers = list(module.pipeline_layers())
    if not layers:
        raise ValueError(f"{type(module).__name__}.pipeline_layers() returned no layers: return the ordered layers.")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(
                f"{type(module).__name__}.pipeline_layers()[{i}] is a {type(layer).__name__}, not an "
                f"nn.Module: wrap functions in an nn.Module so the pipeline can place and name them."
            )
    positions: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        positions.setdefault(id(layer), []).append(i)
    repeated = [(layers[where[0]], where) for where in positions.values() if len(where) > 1]
    if repeated:
        names = {id(m): n for n, m in module.named_modules(remove_duplicate=False) if n}
        layer, where = repeated[0]
        what = f"{names[id(layer)]!r} ({type(layer).__name__})" if id(layer) in names else f"a {type(layer).__name__}"
        raise ValueError(
            f"{type(module).__name__}.pipeline_layers() lists the module {what} {len(where)} times, at positions "
            f"{', '.join(map(str, where))}: list each layer once. A module that runs more than once in the forward "
            f"(weights shared between steps of the model) belongs in one layer that calls it each time.")
    return layers


def cut_model(module: nn.Module, pp: int, vp: int, pp_rank: int, layout: Layout = None,
              layers: Optional[list[nn.Module]] = None, placement: str = "loop") -> Partition:
    """Cut ``module`` into ``pp * vp`` virtual stages and keep only ``pp_rank``'s chunks.

    Virtual stage ``s`` lives where ``placement`` puts it (:func:`~lightning_pp.schedules.stage_owner`:
    ``"loop"``, rank ``s % pp`` as local chunk ``s // pp``; ``"v"`` for the V-shaped schedules).
    Layers of other ranks, and every module only they reach (a layer may be an adapter around
    modules kept elsewhere in the tree), are replaced wherever the tree refers to them by
    :class:`NotOnThisStage`, which frees their parameters (unless an owned layer shares them, e.g.
    a tied embedding). Names stay the one-device names. A trainable parameter that no layer
    reaches is an error: no stage would train it.
    """
    check_protocol(module)
    layers = layer_list(module) if layers is None else layers
    counts = resolve_layout(layout, len(layers), pp * vp)
    layer_stage = [s for s, c in enumerate(counts) for _ in range(c)]
    layer_rank = [stage_owner(s, pp, placement)[0] for s in layer_stage]

    # Global names, taken before anything is replaced, so every rank agrees on them.
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    order = [names[id(p)] for p in module.parameters()]
    _check_layers(module, layers, names)
    tied = _tied_parameters(layers, layer_rank, names)

    chunks: list[StageChunk] = []
    for chunk_id in range(vp):
        stage = virtual_stage(pp_rank, chunk_id, pp, placement)
        first = sum(counts[:stage])
        chunks.append(StageChunk(stage, first, layers[first : first + counts[stage]]))
    _remove_other_ranks(module, layers, layer_stage, [r == pp_rank for r in layer_rank])
    return Partition(counts, layer_stage, chunks, tied, names, order)


def _check_layers(module: nn.Module, layers: list[nn.Module], names: dict[int, str]) -> None:
    """Every layer's parameters are the module's, and every trainable parameter is in a layer."""
    reached: set[int] = set()
    for index, layer in enumerate(layers):
        if layer is module:
            raise ValueError("pipeline_layers() must not return the module itself: return its sub-layers.")
        unnamed = [p for p in layer.parameters() if id(p) not in names]
        if unnamed:
            raise ValueError(
                f"pipeline_layers()[{index}] ({type(layer).__name__}) holds {len(unnamed)} parameter(s) that "
                f"{type(module).__name__} does not: assign the layer (or the modules it wraps) as an attribute "
                f"(or inside an nn.ModuleList) so its parameters have names, reach the optimizer and are saved."
            )
        reached.update(id(p) for p in layer.parameters())
    orphans = [name for pid, name in names.items() if pid not in reached and _requires_grad(module, name)]
    if orphans:
        bare = [name for name in orphans if _is_bare(module, name, layers)]
        raise ValueError(
            f"{len(orphans)} trainable parameter(s) of {type(module).__name__} belong to no pipeline layer: "
            f"{', '.join(orphans[:6])}{', ...' if len(orphans) > 6 else ''}. Every trainable parameter must be "
            f"reached from a module that pipeline_layers() returns, so that the stage holding it trains it "
            f"and saves it (otherwise every rank would keep an untrained copy). Move the module into a layer "
            f"(e.g. into the last layer if pipeline_loss uses it), delete it if it is unused, or freeze it "
            f"(requires_grad_(False)); frozen parameters outside the layers stay on every rank."
            + (_BARE_PARAMETER_FIX.format(name=bare[0], attr=bare[0].rsplit(".", 1)[-1]) if bare else "")
        )


_BARE_PARAMETER_FIX = (
    " A bare nn.Parameter such as `{name}` moves by handing it to the layer that uses it, keeping it "
    "where it is: give the adapter you return from pipeline_layers() the parameter as an attribute (e.g. "
    "`Embed(self.patch_embed, self.{attr})` whose __init__ does `self.{attr} = {attr}`); it keeps its "
    "one-device name `{name}`, and only the stage running that layer holds, trains and saves it "
    "(see docs/data-flow.md)."
)


def _is_bare(module: nn.Module, name: str, layers: list[nn.Module]) -> bool:
    """Whether parameter ``name`` is a bare ``nn.Parameter`` next to the layers (registered on the
    root, or on a module that contains layers), rather than one of a module that could move whole."""
    holder = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    inside = {id(sub) for sub in holder.modules()}
    return holder is module or any(id(layer) in inside for layer in layers)


def _tied_parameters(layers: list[nn.Module], layer_rank: list[int], names: dict[int, str]) -> list[TiedParameter]:
    """Parameters that layers on several pipeline ranks share (a tied embedding and head)."""
    param_ranks: dict[int, set[int]] = {}
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            param_ranks.setdefault(id(p), set()).add(layer_rank[index])
    tied = [TiedParameter(names.get(pid, "?"), tuple(sorted(ranks))) for pid, ranks in param_ranks.items()
            if len(ranks) > 1]
    return sorted(tied, key=lambda t: t.name)


def _remove_other_ranks(module: nn.Module, layers: list[nn.Module], layer_stage: list[int], own: list[bool]) -> None:
    """Remove, wherever the module tree refers to it, every module that only other ranks' layers
    reach: the layers themselves, and the modules they wrap or point into (a layer may live
    anywhere in the module, e.g. self.model.transformer.h[3], or be a small adapter around such
    modules), so no rank keeps an untrained copy of another rank's weights."""
    layer_names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in module.modules():
        for child_name, child in parent.named_children():
            parents.setdefault(id(child), []).append((parent, child_name))
    kept = {id(m) for i, layer in enumerate(layers) if own[i] for m in layer.modules()}
    removed: dict[int, tuple[nn.Module, int]] = {}
    for index, layer in enumerate(layers):
        if own[index]:
            continue
        for sub in layer.modules():
            if id(sub) not in kept:
                removed.setdefault(id(sub), (sub, index))
    for sub_id, (sub, index) in removed.items():
        placeholder = NotOnThisStage(index, layer_stage[index], layer_names.get(sub_id, type(sub).__name__))
        for parent, child_name in parents.get(sub_id, ()):
            if id(parent) not in removed:
                setattr(parent, child_name, placeholder)
    _remove_bare_parameters(module, layers, own)


def _remove_bare_parameters(module: nn.Module, layers: list[nn.Module], own: list[bool]) -> None:
    """Remove the parameters that only other ranks' layers reach but that are registered on a module
    this rank keeps: a bare ``nn.Parameter`` of the root (a ViT's ``cls_token``) handed to an adapter
    made in ``pipeline_layers()``. The rank running that layer holds, trains and saves it; the others
    drop it from their module (its attribute and state dict entry), so no rank keeps an untrained
    copy that a consolidated checkpoint could take. A one-device state dict still loads strictly:
    a pre-hook drops the entries that another rank loads."""
    here = {id(p) for i, layer in enumerate(layers) if own[i] for p in layer.parameters()}
    elsewhere = {id(p) for i, layer in enumerate(layers) if not own[i] for p in layer.parameters()} - here
    for holder in module.modules():
        names = [name for name, p in holder._parameters.items() if p is not None and id(p) in elsewhere]
        for name in names:
            del holder._parameters[name]
        if names:
            holder._register_load_state_dict_pre_hook(_drop_named_keys(names))


def _drop_named_keys(names: list[str]):
    def hook(state_dict, prefix, *args) -> None:
        for name in names:
            state_dict.pop(prefix + name, None)

    return hook


class FrozenStage(nn.Module):
    """Added to the module on a rank none of whose parameters is trainable (every layer of its
    stages frozen): one empty trainable parameter, so that an optimizer built from the rank's
    trainable parameters (``[p for p in self.parameters() if p.requires_grad]``) is not an empty
    list, which torch refuses. It never gets a gradient, so optimizers skip it, and it is left out
    of state dicts (one-device checkpoints load without it)."""

    def __init__(self) -> None:
        super().__init__()
        self.placeholder = nn.Parameter(torch.zeros(0))
        self._register_state_dict_hook(_drop_placeholder)
        self._register_load_state_dict_pre_hook(_keep_placeholder, with_module=True)


def _drop_placeholder(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + "placeholder", None)


def _keep_placeholder(module, state_dict, prefix, *args):
    state_dict.setdefault(prefix + "placeholder", module.placeholder.detach())


def add_frozen_stage_placeholder(module: nn.Module, partition: "Partition") -> bool:
    """Give ``module`` a :class:`FrozenStage` if none of this rank's parameters is trainable."""
    if any(p.requires_grad for chunk in partition.chunks for p in chunk.parameters()):
        return False
    module._lpp_frozen_stage = FrozenStage()
    return True


def _requires_grad(module: nn.Module, name: str) -> bool:
    return module.get_parameter(name).requires_grad


def tie_groups_for(tied: list[TiedParameter]) -> list[tuple[int, ...]]:
    """Distinct sets of pipeline ranks that share parameters, in a deterministic order."""
    return sorted({t.pp_ranks for t in tied})
