"""Hugging Face checkpoints for a pipelined transformers model: initialising a model built on the
meta device layer by layer, reading each rank's own tensors from a local ``save_pretrained``
directory, and writing the trained model back as one (see ``lightning_pp.integrations.hf``)."""

from __future__ import annotations

import torch
from torch import nn


def init_weights(model: nn.Module, module: nn.Module) -> None:
    """Initialise one module of ``model`` materialised from the meta device (a pipeline's
    ``pipeline_init_weights``): HF's own ``_init_weights``, and a rotary embedding's frequency
    buffers (not in any checkpoint) recomputed from its config, as its constructor computes them."""
    if any(name.endswith("inv_freq") for name, _ in module.named_buffers(recurse=False)):
        fresh = type(module)(config=module.config)
        with torch.no_grad():
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buffer)
        if hasattr(fresh, "attention_scaling"):
            module.attention_scaling = fresh.attention_scaling
        return
    model._init_weights(module)


def _weight_files(path) -> dict[str, str]:
    """Tensor name -> safetensors file of a ``save_pretrained`` directory (sharded or not)."""
    import json
    from pathlib import Path

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: str(path / file) for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path} holds no model.safetensors or model.safetensors.index.json: pass a directory "
                                f"written by save_pretrained (safetensors).")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: str(single) for name in f.keys()}


def _read_plan(model: nn.Module, keys) -> dict[str, tuple]:
    """Model tensor name -> (the transformers ``WeightConverter`` that makes it from the checkpoint's
    tensors, or None; the checkpoint keys it is made of, by source pattern, in HF's order), as
    transformers' own loading renames and converts a checkpoint's keys (e.g. a MoE checkpoint's
    per-expert ``mlp.experts.3.gate_proj.weight`` into the fused ``mlp.experts.gate_up_proj``)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key
        transforms = get_model_conversion_mapping(model)
    except ImportError:  # pragma: no cover - transformers before 5 converts nothing
        return {key: (None, {None: [key]}) for key in keys}
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    plan: dict[str, tuple] = {}
    for key in sorted(keys, key=dot_natural_key):
        name, converter, pattern = key, None, None
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        for candidate in converters:  # the first converter that matches, as transformers decides
            renamed, pattern = candidate.rename_source_key(name)
            if pattern is not None:
                name, converter = renamed, candidate
                break
        plan.setdefault(name, (converter, {}))[1].setdefault(pattern, []).append(key)
    return plan


def _read(model, name: str, entry: tuple, shard, get) -> torch.Tensor:
    """The tensor ``name`` of ``model`` (this rank's rows of it if ``shard``) from the checkpoint
    tensors of ``entry`` (see :func:`_read_plan`), read with ``get(key, rows)``."""
    converter, sources = entry
    rows = (shard.start, shard.start + shard.rows) if shard is not None else None
    if converter is None:
        return get(sources[None][0], rows)
    from transformers.core_model_loading import MergeModulelist

    first = converter.operations[0]
    # Experts merged along dim 0 from one tensor per expert: read only this rank's experts' tensors.
    per_expert = (rows is not None and isinstance(first, MergeModulelist) and first.dim == 0
                  and all(len(keys) == shard.total for keys in sources.values()))
    collected = {pattern: [get(key, None) for key in (keys[rows[0]:rows[1]] if per_expert else keys)]
                 for pattern, keys in sources.items()}
    for op in converter.operations:
        collected = op.convert(collected, source_patterns=converter.source_patterns,
                               target_patterns=converter.target_patterns, full_layer_name=name, model=model,
                               config=model.config, missing_keys=None)
    value = next(iter(collected.values()))
    value = value[0] if isinstance(value, list) else value
    return value.narrow(0, rows[0], rows[1] - rows[0]) if rows is not None and not per_expert else value


def load_pretrained(model: nn.Module, path) -> dict:
    """Fill this rank's parameters (and persistent buffers) of ``model`` (a transformers model,
    cut) from the ``save_pretrained`` directory ``path``, reading only the tensors this rank holds
    (safetensors reads by name; of experts stacked in one tensor, only this rank's experts: their
    rows, or their own tensors in a checkpoint that stores one per expert, converted as
    transformers converts them). A sharded parameter takes its shard. A parameter the checkpoint
    lacks is an error naming it. Returns what was read: ``{"tensors": n, "bytes": b}``."""
    from safetensors import safe_open

    from lightning_pp.runtime.cut.stacked import stacked_rows
    from lightning_pp.runtime.dtensors import is_dtensor, shard_like

    files = _weight_files(path)
    plan = _read_plan(model, files)
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied = tied if isinstance(tied, dict) else {}
    held = [(name, t, False) for name, t in model.named_parameters()] + [(name, t, True) for name, t in model.named_buffers()]
    missing = [name for name, t, buffer in held if not t.is_meta and not buffer and name not in plan
               and tied.get(name) not in plan]
    if missing:
        raise KeyError(f"{path} does not hold {len(missing)} parameter(s) this rank keeps, e.g. {missing[:4]} (its "
                       f"tensors are named e.g. {sorted(files)[:3]}): it is not a checkpoint of this model.")
    read = {"tensors": 0, "bytes": 0}
    handles: dict = {}

    def get(key: str, rows) -> torch.Tensor:
        file = files[key]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        value = handles[file].get_slice(key)[rows[0]:rows[1]] if rows else handles[file].get_tensor(key)
        read["tensors"] += 1
        read["bytes"] += value.numel() * value.element_size()
        return value

    with torch.no_grad():
        for name, t, _ in held:
            entry = plan.get(name) or plan.get(tied.get(name))
            if t.is_meta or entry is None:
                continue
            value = _read(model, name, entry, stacked_rows(t), get).to(dtype=t.dtype)
            (t.to_local() if is_dtensor(t) else t).copy_(shard_like(t, value).to_local() if is_dtensor(t) else value)
    handles.clear()
    return read


def save_pretrained(model: nn.Module, path) -> None:
    """Write the pipelined ``model`` (a transformers model, cut, on every rank) as a directory that
    ``AutoModelForCausalLM.from_pretrained`` loads: every rank's tensors, whole, consolidated on
    rank 0 (which builds the model once on the CPU to write it). Collective."""
    import torch.distributed as dist

    from lightning_pp.runtime.dtensors import is_dtensor

    mine = {name: (t.full_tensor() if is_dtensor(t) else t).detach().cpu()
            for name, t in model.state_dict().items() if not t.is_meta}
    rank = dist.get_rank() if dist.is_initialized() else 0
    gathered = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    else:
        gathered = [mine]
    if rank == 0:
        state: dict = {}
        for part in gathered:
            state.update(part)
        dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
        whole = type(model)(model.config).to(dtype)
        missing = [k for k in whole.state_dict() if k not in state and not k.endswith("inv_freq")]
        tied = getattr(model, "_tied_weights_keys", None) or {}
        missing = [k for k in missing if k not in tied]
        if missing:
            raise RuntimeError(f"save_pretrained: no rank holds {missing[:4]}: the pipeline lost them.")
        whole.load_state_dict(state, strict=False)
        whole.save_pretrained(str(path))
    if dist.is_initialized():
        dist.barrier()


