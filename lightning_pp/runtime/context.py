"""What layers may ask the executor about the microbatch being run: the one channel from the
executor to the layers it runs.

Set by the executor around each action; read by layers and schedule-plan nodes that need it (MoE
auxiliary losses scale their gradient by the microbatch's sample count, because the pipeline
normalises every loss by the global count after the step; all-to-all waits are recorded on the
step's timeline and bounded by the step's wait; a zero-bubble B tells its compute nodes where to
leave their weight gradients). Outside a pipelined step the defaults describe plain
single-process training.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional


@dataclass
class MicrobatchContext:
    loss_weight: float = 1.0  # multiplier for auxiliary losses added through autograd
    microbatch: int = -1
    chunk: int = -1
    timeline: Optional[object] = None
    # ``wait(work, what)``: waits for an in-step collective with the pipeline's timeout, turning a
    # failure into an error that names the rank that failed first (None: a plain ``work.wait()``).
    wait: Optional[Callable[[Any, str], None]] = None
    # A zero-bubble B run through a schedule plan: where its compute nodes leave their weight
    # gradients for the W (a ``weight_grad.DeferredWeights``); ``None``: whole backwards.
    deferred_weights: Optional[Any] = None


# A module global, not a ContextVar, on purpose: on CUDA the autograd engine runs backward on its
# own device threads, where a context variable set by the main thread is not visible, and the
# layers' backward (an expert all-to-all's wait) needs it there too. Only the executor sets it,
# around each action, on the one thread that runs the schedule.
_current = MicrobatchContext()


def current() -> MicrobatchContext:
    return _current


@contextmanager
def microbatch_context(loss_weight: float, microbatch: int, chunk: int, timeline=None, wait=None,
                       deferred_weights=None) -> Iterator[None]:
    """What layers see while the executor runs one action of (``microbatch``, ``chunk``)."""
    global _current
    previous = _current
    _current = MicrobatchContext(loss_weight, microbatch, chunk, timeline, wait, deferred_weights)
    try:
        yield
    finally:
        _current = previous
