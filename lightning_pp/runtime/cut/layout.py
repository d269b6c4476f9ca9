"""How many pipeline layers each virtual stage holds: even by default, or the user's ``layout``
(a list of counts or a Megatron-style string)."""

from __future__ import annotations

import re
from typing import Sequence, Union

Layout = Union[None, str, Sequence[int]]


def balanced_layout(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per virtual stage, as even as possible; earlier stages take the remainder."""
    if num_layers < num_stages:
        raise ValueError(
            f"the model has {num_layers} pipeline layers, too few for {num_stages} virtual stages "
            f"(pipeline_parallel_size * virtual_pipeline_size): every stage needs at least one layer. "
            f"Use pipeline_parallel_size * virtual_pipeline_size <= {num_layers}."
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


_REPEAT = re.compile(r"\(([^()]*)\)\*(\d+)")
_SYMBOL_REPEAT = re.compile(r"([A-Za-z])\*(\d+)")


def parse_layout_string(layout: str) -> list[int]:
    """Megatron-style layout: stages separated by ``|``, each letter one layer (``E`` embedding,
    ``t`` block, ``L`` head...), ``x*k`` repeats a letter, ``(...)*k`` repeats a group (which may
    contain ``|``). Example: ``"Et*2|(tt|)*2tL"`` -> ``[3, 2, 2, 2]``."""
    text = layout.replace(" ", "").replace(",", "")
    while True:
        expanded = _REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), text)
        if expanded == text:
            break
        text = expanded
    text = _SYMBOL_REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), text)
    if not re.fullmatch(r"[A-Za-z|]*", text):
        raise ValueError(
            f"layout={layout!r} is not a valid layout string: use letters for layers, '|' between "
            f"stages, 'x*k' and '(...)*k' for repeats, e.g. 'Et*2|t*3|tL'."
        )
    return [len(stage) for stage in text.split("|")]


def resolve_layout(layout: Layout, num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per virtual stage (stage order), validated against the model."""
    if layout is None:
        return balanced_layout(num_layers, num_stages)
    counts = parse_layout_string(layout) if isinstance(layout, str) else [int(c) for c in layout]
    if len(counts) != num_stages:
        raise ValueError(
            f"layout={layout!r} describes {len(counts)} stages, but the pipeline has {num_stages} "
            f"virtual stages (pipeline_parallel_size * virtual_pipeline_size). Give one entry per "
            f"virtual stage, e.g. {balanced_layout(num_layers, num_stages) if num_layers >= num_stages else '...'}."
        )
    if any(c < 1 for c in counts):
        raise ValueError(
            f"layout={layout!r} gives a stage {min(counts)} layers: every virtual stage needs at least "
            f"one layer. Move a layer into it, or use fewer stages."
        )
    if sum(counts) != num_layers:
        raise ValueError(
            f"layout={layout!r} sums to {sum(counts)} layers, but pipeline_layers() returns "
            f"{num_layers}. Make the counts sum to {num_layers}, e.g. "
            f"{balanced_layout(num_layers, num_stages) if num_layers >= num_stages else '...'}."
        )
    return counts
