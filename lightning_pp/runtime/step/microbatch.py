"""Batches: their size, their split into microbatches along the batch dimension (uneven splits
allowed), and what keeps the stages of one pipeline on the same batch (a fingerprint compared
every step, or the first stage's batch broadcast).

The rule, applied recursively through tuples, lists, namedtuples and dicts:

* the batch size is dim 0 of the first tensor found in the batch;
* a tensor (or NumPy array) whose dim 0 equals the batch size is split along dim 0; any other
  tensor (a scalar, a lookup table) is given whole to every microbatch;
* a list or tuple *inside* the batch whose length equals the batch size lists one item per sample
  (strings, numbers, boxes of different counts, tensors of different lengths) and is split like a
  tensor, sample ``i`` staying with row ``i``, unless every item holds a tensor whose dim 0 is the
  batch size: then it is a set of fields, split item by item (as is the batch itself, whatever its
  length). Tensors of one rank of which only some are as long as the batch are ragged per-sample
  items; any other mix of batch-sized tensors and other items is ambiguous and raises;
* anything else (numbers, strings, ``None``, lists of another length) is given whole to every
  microbatch.

Microbatch sizes differ by at most one, the first ones larger, as ``torch.tensor_split``.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch

try:  # optional: NumPy arrays in a batch are split like tensors
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
    _np = None


# -- the one walk over a batch's containers ------------------------------------------------------------
# Containers are tuples, lists, namedtuples and dicts (subclasses included), rebuilt with their own
# type; everything else is a leaf. The split below, the fingerprint, the broadcast, the shape key of
# a step and the strategies' output handling all walk batches this way.
def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def flatten(obj: Any) -> tuple[list, Any]:
    """``(leaves, spec)``: the leaves of ``obj`` in order, and its structure as a picklable value
    (container types, dict keys, lengths) that :func:`unflatten` rebuilds from."""
    if _is_namedtuple(obj):
        parts = [flatten(item) for item in obj]
        return [leaf for leaves, _ in parts for leaf in leaves], ("namedtuple", type(obj), None, [sp for _, sp in parts])
    if isinstance(obj, (tuple, list)):
        parts = [flatten(item) for item in obj]
        return [leaf for leaves, _ in parts for leaf in leaves], ("sequence", type(obj), None, [sp for _, sp in parts])
    if isinstance(obj, dict):
        keys = list(obj)
        parts = [flatten(obj[key]) for key in keys]
        return [leaf for leaves, _ in parts for leaf in leaves], ("dict", type(obj), keys, [sp for _, sp in parts])
    return [obj], None


def unflatten(leaves: list, spec: Any) -> Any:
    """The inverse of :func:`flatten`."""
    it = iter(leaves)

    def build(sp):
        if sp is None:
            return next(it)
        kind, cls, keys, children = sp
        items = [build(child) for child in children]
        if kind == "namedtuple":
            return cls(*items)
        if kind == "dict":
            return cls(zip(keys, items))
        return cls(items)

    return build(spec)


def map_tensors(fn, obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (containers rebuilt, other leaves kept)."""
    leaves, spec = flatten(obj)
    return unflatten([fn(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in order."""
    return [leaf for leaf in flatten(obj)[0] if isinstance(leaf, torch.Tensor)]


def first_tensor(obj: Any) -> Optional[torch.Tensor]:
    """The first tensor in ``obj``, or ``None``."""
    return next(iter(tensors_in(obj)), None)


def batch_size(batch: Any) -> Optional[int]:
    """Size of dim 0 of the first tensor found in ``batch`` (tensors, tuples, lists, dicts)."""
    tensor = first_tensor(batch)
    return tensor.shape[0] if tensor is not None and tensor.dim() > 0 else None


def microbatch_sizes(size: int, num: int) -> list[int]:
    """Samples per microbatch: as even as possible, the first ones larger."""
    base, extra = divmod(size, num)
    return [base + (1 if i < extra else 0) for i in range(num)]


def _is_sequence(obj: Any) -> bool:
    return isinstance(obj, (tuple, list)) and not _is_namedtuple(obj)


def _holds_batch_tensor(obj: Any, size: int) -> bool:
    return any(t.dim() > 0 and t.shape[0] == size for t in tensors_in(obj))


def _per_sample(obj: Any, size: int, path: str) -> bool:
    """Whether a nested list/tuple lists one item per sample (see the module docstring)."""
    if len(obj) != size:
        return False
    holding = [_holds_batch_tensor(item, size) for item in obj]
    if not any(holding):
        return True
    if all(holding):
        return False
    if all(isinstance(item, torch.Tensor) for item in obj) and len({item.dim() for item in obj}) == 1:
        return True  # ragged tensors, some of which happen to be as long as the batch
    raise ValueError(
        f"cannot split batch{path} into microbatches: it is a {type(obj).__name__} of {size} items, the "
        f"batch size, but items {[i for i, h in enumerate(holding) if h]} hold tensors whose first dimension "
        f"is {size} and the others do not, so it is ambiguous whether it lists one item per sample or the "
        f"fields of the batch. Put fields in a dict or a tuple of batch-sized tensors, and per-sample items "
        f"(strings, ragged tensors) in a list of their own."
    )


def _cut(obj: Any, sizes: list[int]) -> list[Any]:
    out, start = [], 0
    for n in sizes:
        out.append(obj[start:start + n])
        start += n
    return out


def _split(obj: Any, sizes: list[int], size: int, path: str, top: bool) -> list[Any]:
    num = len(sizes)
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] != size:
            # Scalars and tensors without the batch dimension are given to every microbatch.
            return [obj] * num
        return list(torch.split(obj, sizes, dim=0))
    if _np is not None and isinstance(obj, _np.ndarray):
        return _cut(obj, sizes) if obj.ndim > 0 and obj.shape[0] == size else [obj] * num
    if _is_namedtuple(obj):  # fields
        parts = [_split(item, sizes, size, f"{path}.{name}", False) for name, item in zip(obj._fields, obj)]
        return [type(obj)(*items) for items in zip(*parts)]
    if _is_sequence(obj):
        if not top and _per_sample(obj, size, path):
            return [type(obj)(piece) for piece in _cut(list(obj), sizes)]
        parts = [_split(item, sizes, size, f"{path}[{i}]", False) for i, item in enumerate(obj)]
        return [type(obj)(items) for items in zip(*parts)] if parts else [type(obj)()] * num
    if isinstance(obj, dict):
        parts = {key: _split(value, sizes, size, f"{path}[{key!r}]", False) for key, value in obj.items()}
        return [type(obj)((key, parts[key][i]) for key in obj) for i in range(num)]
    return [obj] * num


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """``num_microbatches`` pieces of ``batch`` (see the module docstring for what is split)."""
    size = batch_size(batch)
    if size is None:
        raise ValueError(
            f"cannot split the batch into num_microbatches={num_microbatches}: it holds no tensor with a "
            f"batch dimension. Give the pipeline a batch of tensors (or tuples/dicts of tensors)."
        )
    if size < num_microbatches:
        raise ValueError(
            f"a batch of size {size} cannot be split into num_microbatches={num_microbatches}: every "
            f"microbatch needs at least one sample. Use a batch size >= {num_microbatches} "
            f"(ideally a multiple of it) or num_microbatches <= {size}."
        )
    return _split(batch, microbatch_sizes(size, num_microbatches), size, "", True)


# -- every stage of a pipeline must see the same batch ---------------------------------------------
_FOLD = 1_000_003  # odd multiplier that folds one part's hash into the running hash (mod 2**64)
_ROW_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd, as a signed int64
_COL_MIX = 0xC2B2AE3D27D4EB4F - (1 << 64)
_FINGERPRINT_BITS = (1 << 52) - 1  # what a float64 holds exactly
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[tuple, torch.Tensor] = {}


def _position_weights(length: int, mix: int, device: torch.device) -> torch.Tensor:
    key = (length, mix, device)
    weights = _weights.get(key)
    if weights is None:
        weights = (torch.arange(1, length + 1, dtype=torch.int64, device=device) * mix) | 1
        if len(_weights) > 64:
            _weights.clear()
        _weights[key] = weights
    return weights


def _tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """An int64 hash of a tensor's exact contents and their positions, on its device (no sync).
    Row sums weighted by row and column sums weighted by column: one pass over the data, and a
    change of any value, or a reordering of samples or of positions inside a sample, changes it."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    x = x.contiguous()
    if x.is_floating_point():
        x = x.view(_INT_OF_SIZE[x.element_size()])  # the exact bits, so -0.0 != 0.0 and nan == nan
    rows = x.shape[0] if x.dim() > 0 else 1
    values = x.reshape(rows, -1).to(torch.int64)
    by_row = (values.sum(1) * _position_weights(rows, _ROW_MIX, x.device)).sum()
    by_col = (values.sum(0) * _position_weights(values.shape[1], _COL_MIX, x.device)).sum()
    return by_row + by_col


def _structure(spec: Any) -> str:
    """A batch structure as text that is the same in every process (types by qualified name)."""
    if spec is None:
        return "*"
    kind, cls, keys, children = spec
    return f"{kind}:{cls.__module__}.{cls.__qualname__}{keys!r}({','.join(_structure(c) for c in children)})"


def _stable_hash(value: Any) -> int:
    """A hash of a plain Python value that is the same in every process (``hash()`` of a string is
    salted per process)."""
    return zlib.crc32(repr(value).encode("utf-8", "backslashreplace"))


def batch_fingerprint(batch: Any, device: torch.device) -> torch.Tensor:
    """A float64 scalar on ``device`` that differs, with overwhelming probability, between two
    batches that differ in any tensor value, shape, dtype, sample order, in their structure, or in
    any string or number they hold. Computed without a host sync, so it can ride on a collective
    that already runs."""
    leaves, spec = flatten(batch)
    plain = _stable_hash(_structure(spec))  # the structure: containers, their keys and lengths
    parts: list[torch.Tensor] = []
    for leaf in leaves:
        if _np is not None and isinstance(leaf, _np.ndarray):
            leaf = torch.from_numpy(_np.ascontiguousarray(leaf))
        if isinstance(leaf, torch.Tensor):
            plain = plain * _FOLD + _stable_hash((tuple(leaf.shape), str(leaf.dtype)))
            parts.append(_tensor_hash(leaf).to(device))
        elif leaf is None or isinstance(leaf, (str, bytes, int, float, bool)):
            plain = plain * _FOLD + _stable_hash(leaf)
        else:  # an object without a stable value: only its type takes part
            plain = plain * _FOLD + _stable_hash(type(leaf).__qualname__)
        plain &= (1 << 63) - 1
    total = torch.tensor(plain, dtype=torch.int64, device=device)
    for part in parts:
        total = total * _FOLD + part
    return (total & _FINGERPRINT_BITS).to(torch.float64)


def broadcast_batch(batch: Any, src: int, group, device: torch.device) -> Any:
    """``batch`` as global rank ``src`` of ``group`` holds it, on every rank of ``group``: its
    structure and plain values as one pickled object, then each tensor by a broadcast on
    ``device``."""
    import torch.distributed as dist

    leaves, spec = flatten(batch)
    mine = dist.get_rank() == src
    described = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in leaves]
    box = [(spec, described, [None if isinstance(t, torch.Tensor) else t for t in leaves]) if mine else None]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type != "cpu" else None)
    spec, described, plain = box[0]
    out = []
    for i, (tensor_spec, value) in enumerate(zip(described, plain)):
        if tensor_spec is not None:
            shape, dtype = tensor_spec
            value = leaves[i].to(device).contiguous() if mine else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(value, src=src, group=group)
        out.append(value)
    return unflatten(out, spec)
