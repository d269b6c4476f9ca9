"""Models larger than a host: build on the meta device, cut, then materialise only what stays.

A module built under ``torch.device("meta")`` (Lightning's ``configure_model`` /
``init_module(empty_init=True)``) holds shapes but no memory. After the cut, only this rank's
layers (and the few modules outside the layers, such as a rotary cache) are still in the tree;
:func:`materialize` gives those real storage on the rank's device and initialises them, so no rank
ever holds the whole model.

Initialisation is the model's own, module by module: ``reset_parameters()`` where the module has
it, then ``init_fn(module)`` if given (litgpt: ``GPT._init_weights``). Each module is initialised
with the random generator seeded from the run's seed and the module's name, so the values do not
depend on which rank materialises which layers: a one-device run that materialises the whole
model with the same seed gets the same weights (and is what the tests compare with). A parameter
that holds only its rank's rows of experts stacked along dim 0 (:mod:`.stacked`) is initialised
whole, then cut to its rows, for the same reason.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

import torch
from torch import nn

from lightning_pp.runtime.cut.stacked import global_shape, stacked_rows


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def init_seed(seed: int, name: str) -> int:
    """The seed a module named ``name`` is initialised with."""
    digest = hashlib.blake2b(f"lightning_pp/init/{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def materialize(module: nn.Module, device: torch.device, seed: int,
                init_fn: Optional[Callable[[nn.Module], None]] = None,
                within: Optional[nn.Module] = None) -> dict[int, nn.Parameter]:
    """Give every meta parameter and buffer still in ``module`` storage on ``device`` and initialise
    the modules holding them (see the module docstring). A parameter shared by several modules
    stays shared; attributes set on a parameter (e.g. ``_lpp_expert``) are kept. Returns
    ``{id(meta parameter): its replacement}`` so that whoever indexed the meta parameters can
    follow. Raises ``ValueError``, naming them, for modules it cannot initialise. ``within``: only
    the modules of that subtree (named as in ``module``, so seeded alike), e.g. one layer at a time
    where each is sharded as soon as it exists."""
    replaced: dict[int, nn.Parameter] = {}
    stacked: list[nn.Parameter] = []
    touched: list[tuple[str, nn.Module]] = []
    inside = None if within is None else {id(m) for m in within.modules()}
    for name, sub in module.named_modules():
        if inside is not None and id(sub) not in inside:
            continue
        meta = False
        for key, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = replaced.get(id(p))
            if new is None:
                new = nn.Parameter(torch.empty(global_shape(p), dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                replaced[id(p)] = new
                if stacked_rows(p) is not None:
                    stacked.append(new)
            sub._parameters[key] = new
            meta = True
        for key, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                sub._buffers[key] = torch.empty_like(b, device=device)
                meta = True
        if meta:
            touched.append((name, sub))
    if init_fn is None:
        unknown = [name or type(sub).__name__ for name, sub in touched if not callable(getattr(sub, "reset_parameters", None))]
        if unknown:
            raise ValueError(
                f"cannot initialise {len(unknown)} module(s) built on the meta device: {', '.join(unknown[:6])} "
                f"{'...' if len(unknown) > 6 else ''}have no reset_parameters(). Give them one, or give the "
                f"model a pipeline_init_weights(module) method that initialises any module in place."
            )
    devices = [device] if device.type == "cuda" else []
    for name, sub in touched:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(init_seed(seed, name))
            with torch.no_grad():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
                if init_fn is not None:
                    init_fn(sub)
    with torch.no_grad():
        for p in stacked:  # initialised whole, as on one device; this rank keeps its rows
            shard = stacked_rows(p)
            p.data = p.data.narrow(0, shard.start, shard.rows).clone()
    return replaced
