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


def load_pretrained(model: nn.Module, path) -> dict:
    """Fill this rank's parameters (and persistent buffers) of ``model`` (a transformers model,
    cut) from the ``save_pretrained`` directory ``path``, reading only the tensors this rank holds
    (safetensors reads by name). A sharded parameter takes its shard. Returns what was read:
    ``{"tensors": n, "bytes": b}``."""
    from safetensors import safe_open

    from lightning_pp.runtime.step.sharded_grads import is_dtensor, shard_like

    files = _weight_files(path)
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied = tied if isinstance(tied, dict) else {}
    wanted = [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()]
              if not t.is_meta and (name in files or tied.get(name) in files)]
    by_file: dict[str, list] = {}
    for name, t in wanted:
        key = name if name in files else tied[name]
        by_file.setdefault(files[key], []).append((key, t))
    read = {"tensors": 0, "bytes": 0}
    with torch.no_grad():
        for file, items in by_file.items():
            with safe_open(file, framework="pt") as f:
                for key, t in items:
                    value = f.get_tensor(key)
                    read["tensors"] += 1
                    read["bytes"] += value.numel() * value.element_size()
                    value = value.to(dtype=t.dtype)
                    (t.to_local() if is_dtensor(t) else t).copy_(shard_like(t, value).to_local() if is_dtensor(t) else value)
    return read


def save_pretrained(model: nn.Module, path) -> None:
    """Write the pipelined ``model`` (a transformers model, cut, on every rank) as a directory that
    ``AutoModelForCausalLM.from_pretrained`` loads: every rank's tensors, whole, consolidated on
    rank 0 (which builds the model once on the CPU to write it). Collective."""
    import torch.distributed as dist

    from lightning_pp.runtime.step.sharded_grads import is_dtensor

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


