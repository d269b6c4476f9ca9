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
  (``lightning_pp.strategies``).

Everything else a layer needs is passed to it explicitly; what it may ask about the microbatch
being run is :mod:`lightning_pp.runtime.context`. Tests that start another job in the same
process call :func:`reset`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


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
