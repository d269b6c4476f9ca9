"""The few facts that belong to the process, not to one pipeline, in one place.

A process runs one pipeline job at a time, but some things outlive an executor or are shared by
every executor of the process:

* the watchdog thread (one per process, whatever the number of executors: ``failure/watchdog.py``);
* how many pipeline steps failed here (read at exit: a failed job's groups are left alone,
  ``failure/guard.py``);
* what the installed ``sys.excepthook`` asks about the current pipeline (``failure/outside_step.py``;
  the hook itself is installed once);
* the CUDA compute and communication streams (``plans/plan.py``);
* the storages of the persistent staging buffers that ``free_input`` must never release
  (``plans/plan.py``; a buffer pool removes its own when it is released);
* whether the exit handler is registered, and which step-method warnings were shown
  (``lightning_pp.strategies``);
* what the package knows about users' objects (layers, modules, optimizers): one weak-keyed table,
  keyed by identity (a module or tensor with its own ``__eq__`` is safe), whose records die with
  their objects. :func:`facts` gives an object's record to write, :func:`fact` reads one fact;
  the facts' names are :data:`FACTS`. A record's values must not refer to its object (the object
  would never be freed). A copy of a layer (``copy.deepcopy``) does not have its record: whoever
  copies a layer and runs it as the layer calls :func:`copy_facts`.

Everything else a layer needs is passed to it explicitly; what it may ask about the microbatch
being run is :mod:`lightning_pp.runtime.context`. Tests that start another job in the same
process call :func:`reset` (which leaves the table of facts alone: its records belong to objects
that may outlive a job, and go with them).

Four markers stay attributes, because they must travel with their objects: ``param._lpp_expert``
and ``param._lpp_stacked`` (kept through FSDP2's and materialisation's parameter replacement, which
copy a parameter's ``_lpp_`` attributes), the submodule ``_lpp_frozen_stage`` (a name in state
dicts) and ``module._lpp_executor`` (the executor refers to its module: in a weak-keyed table it
would keep it alive; see ``runtime.protocols``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class ProcessState:
    watchdog: Any = None  # failure.watchdog.Watchdog, the process's one watchdog (running or stopped)
    watchdog_lock: threading.Lock = field(default_factory=threading.Lock)
    failed_steps: int = 0  # pipeline steps that failed in this process (any executor)
    excepthook_context: Optional[Callable[[], Optional[tuple]]] = None  # see outside_step.install_excepthook
    excepthook_installed: bool = False
    streams: Any = None  # plans.plan.Streams, made on first use
    persistent_storages: set = field(default_factory=set)  # data_ptr of persistent staging buffers' storages
    exit_handler_registered: bool = False  # strategies.core.destroy_process_groups_at_exit
    warned_step_methods: set = field(default_factory=set)  # strategies.loops: (class, method) warned about


#: The process's state (module-level on purpose: it is the process's).
PROCESS = ProcessState()


def reset() -> None:
    """Forget the process's pipeline state (stop the watchdog first): for tests that run several
    jobs in one process. The excepthook, once installed, stays installed (it is chained)."""
    global PROCESS
    installed = PROCESS.excepthook_installed
    PROCESS = ProcessState(excepthook_installed=installed)


def state() -> ProcessState:
    """The process's state (read through this function, so :func:`reset` is seen everywhere)."""
    return PROCESS


# -- what the package knows about users' objects ----------------------------------------------------
CHECKPOINT = "checkpoint"  # layer: recomputed in backward (set by build, read by layer.run_layer, measure)
CHECKPOINT_COMPILED = "checkpoint_compiled"  # layer: its checkpoint is inside its compiled graph (compile.layers)
COMPILED = "compiled"  # module: compiled by compile= (compile.layers; the executor's CompileWatch reads it)
STACKED_HOOKS = "stacked_hooks"  # module: has the state-dict hooks of stacked expert rows (cut.stacked)
HF_LAYERS = "hf_layers"  # transformers model: its pipeline layers (integrations.hf), a cache
OPTIMIZER_INDEX = "optimizer_index"  # optimizer: (param-group signature, its OptimizerIndex), a cache
#: Every fact's name.
FACTS = (CHECKPOINT, CHECKPOINT_COMPILED, COMPILED, STACKED_HOOKS, HF_LAYERS, OPTIMIZER_INDEX)
#: The facts a copy of a module has as the module (what its copied attributes and hooks do); the
#: caches are the original's own.
COPIED = (CHECKPOINT, CHECKPOINT_COMPILED, COMPILED, STACKED_HOOKS)

_TABLE = WeakIdKeyDictionary()  # object -> {fact name: value}


def facts(obj: Any) -> dict:
    """``obj``'s record (created empty), to write facts into: ``facts(layer)[CHECKPOINT] = True``."""
    record = _TABLE.get(obj)
    if record is None:
        record = _TABLE[obj] = {}
    return record


def fact(obj: Any, name: str, default: Any = None) -> Any:
    """The fact ``name`` (one of :data:`FACTS`) about ``obj``, or ``default`` if none was recorded."""
    if name not in FACTS:
        raise KeyError(f"{name!r} is not a fact lightning_pp records; the facts are {FACTS}")
    record = _TABLE.get(obj)
    return default if record is None else record.get(name, default)


def copy_facts(source: nn.Module, copy: nn.Module) -> None:
    """Give ``copy`` (``copy.deepcopy(source)``) and each of its submodules the :data:`COPIED`
    facts of the module they copy."""
    for original, twin in zip(source.modules(), copy.modules()):
        record = _TABLE.get(original)
        if record:
            kept = {name: value for name, value in record.items() if name in COPIED}
            if kept:
                facts(twin).update(kept)
