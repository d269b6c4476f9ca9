"""Splitting a batch into microbatches along dim 0 (uneven splits allowed)."""

from __future__ import annotations

from typing import Any, Optional

import torch


def batch_size(batch: Any) -> Optional[int]:
    """Size of dim 0 of the first tensor found in ``batch`` (tensors, tuples, lists, dicts)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    if isinstance(batch, (tuple, list)):
        for item in batch:
            size = batch_size(item)
            if size is not None:
                return size
    if isinstance(batch, dict):
        for item in batch.values():
            size = batch_size(item)
            if size is not None:
                return size
    return None


def _split(obj: Any, num: int, size: int) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] != size:
            # Scalars and tensors without the batch dimension are given to every microbatch.
            return [obj] * num
        return list(torch.tensor_split(obj, num, dim=0))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        parts = [_split(item, num, size) for item in obj]
        return [type(obj)(*items) for items in zip(*parts)]
    if isinstance(obj, (tuple, list)):
        parts = [_split(item, num, size) for item in obj]
        return [type(obj)(items) for items in zip(*parts)] if parts else [type(obj)()] * num
    if isinstance(obj, dict):
        parts = {key: _split(value, num, size) for key, value in obj.items()}
        return [type(obj)((key, parts[key][i]) for key in obj) for i in range(num)]
    return [obj] * num


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """``num_microbatches`` pieces of ``batch``; sizes differ by at most one (the first ones are
    larger, as ``torch.tensor_split``). Every tensor whose dim 0 equals the batch size is split."""
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
    return _split(batch, num_microbatches, size)
