"""How many pipeline layers each virtual stage holds: even by default, or the user's ``layout``
(a list of counts or a Megatron-style string), or ``"auto"`` / :class:`AutoLayout` (measured and
chosen before the cut, see :mod:`lightning_pp.runtime.measure`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from lightning_pp.schedules.auto_layout import even_layout


@dataclass(frozen=True)
class AutoLayout:
    """``layout="auto"`` with its options: the layout chosen from each pipeline layer's measured
    costs and memory (:mod:`lightning_pp.runtime.measure`, :mod:`lightning_pp.schedules.auto_layout`).

    ``memory_budget``: bytes each rank may hold (parameters, gradients, optimizer state,
    activations in flight), or ``None`` for no limit; no layout under it is an error naming the
    smallest peak a layout reaches. ``repeats``: the fewest timed runs per distinct layer (more until
    50 ms have passed; the interquartile mean is taken)."""

    memory_budget: Optional[float] = None
    repeats: int = 3

    def __post_init__(self) -> None:
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
            raise ValueError(f"AutoLayout(memory_budget={budget!r}) is invalid: give the bytes each rank may hold "
                             f"(> 0, e.g. 40e9), or None for no limit.")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"AutoLayout(repeats={self.repeats!r}) is invalid: give the timed runs per layer (>= 1).")


Layout = Union[None, str, Sequence[int], AutoLayout]
AUTO = "auto"


def auto_layout_of(layout: Any) -> Optional[AutoLayout]:
    """The :class:`AutoLayout` that ``layout`` asks for (``"auto"`` is ``AutoLayout()``), or ``None``."""
    if isinstance(layout, AutoLayout):
        return layout
    if isinstance(layout, str) and layout.strip().lower() == AUTO:
        return AutoLayout()
    return None


def check_layout_option(layout: Any) -> None:
    """Raise ``ValueError`` for a ``layout`` option of the wrong form (before any group exists):
    ``"auto"`` mixed into a list of counts is refused by name."""
    if layout is None or isinstance(layout, (str, AutoLayout)):
        return
    try:
        items = list(layout)
    except TypeError:
        raise ValueError(f"layout={layout!r} is invalid: give None (even), a list of layer counts per virtual stage, "
                         f"a Megatron-style string, or 'auto'.") from None
    if any(isinstance(item, AutoLayout) or (isinstance(item, str) and item.strip().lower() == AUTO) for item in items):
        raise ValueError(f"layout={layout!r} mixes 'auto' with a list-valued layout: 'auto' chooses every stage's "
                         f"layer count itself. Give layout='auto' alone, or a list of layer counts without 'auto'.")
    if any(isinstance(item, bool) or not isinstance(item, int) for item in items):
        raise ValueError(f"layout={layout!r} is invalid: a list-valued layout holds one integer layer count per "
                         f"virtual stage, e.g. [3, 2, 2, 3].")


def balanced_layout(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per virtual stage, as even as possible; earlier stages take the remainder."""
    if num_layers < num_stages:
        raise ValueError(
            f"the model has {num_layers} pipeline layers, too few for {num_stages} virtual stages "
            f"(pipeline_parallel_size * virtual_pipeline_size): every stage needs at least one layer. "
            f"Use pipeline_parallel_size * virtual_pipeline_size <= {num_layers}."
        )
    return even_layout(num_layers, num_stages)


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
    if auto_layout_of(layout) is not None:
        raise ValueError(
            f"layout={layout!r} is chosen by measuring the model (build_pipeline and the strategies do that before "
            f"the cut); here a layout of layer counts is needed: pass the chosen list, e.g. "
            f"{balanced_layout(num_layers, num_stages) if num_layers >= num_stages else '...'}.")
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
