"""Run a function on several gloo processes (one intra-op thread each), with a deadline, and
return each rank's result. Used by the multi-process tests.

The ranks are forked from a fork server (started once per test session) that has imported torch,
Lightning and this package already: a spawned rank spent ~4 s of CPU importing them, so each
four-process launch cost ~8 s of the two cores before running anything (about a third of the
suite). The fork server is a fresh interpreter, single-threaded after these imports (checked when
the list was chosen), so forking it is safe, and each rank still starts from a clean process: no
state of the test process reaches it, as with spawn; a rank runs its exit handlers as a process
that ends normally does. ``start_method="spawn"`` where a test needs a new interpreter per rank (a
different ``PYTHONHASHSEED``, which only interpreter start reads; no module imported yet)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable

#: What the fork server imports before forking ranks (an absent optional extra is skipped by
#: multiprocessing itself: it ignores ImportError).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo", "torch._inductor.compile_fx",
           "lightning", "torchmetrics", "lightning_pp", "lightning_pp.strategies", "transformers", "litgpt", "litdata")

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue, environ):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.clear()  # the test process's environment now, not the fork server's from its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle: torch's shared-memory reductions would die with this process.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as exc:  # report, then fail the process
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        # A forked rank ends with os._exit, which skips the exit handlers a rank of a real job runs
        # (the failure watchdog's: rank 0 keeps the store up until its peers have read a failure):
        # run them here, as interpreter shutdown does.
        import atexit

        atexit._run_exitfuncs()


class DistributedFailure(AssertionError):
    def __init__(self, errors: dict, exitcodes: dict, elapsed: float):
        self.errors, self.exitcodes, self.elapsed = errors, exitcodes, elapsed
        lines = [f"rank {r}: {e}" for r, e in sorted(errors.items())]
        super().__init__(f"distributed run failed (exit codes {exitcodes}, {elapsed:.1f}s):\n" + "\n".join(lines))


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, daemon: bool = True,
                    start_method: str = "forkserver") -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; results indexed by rank.
    Raises :class:`DistributedFailure` (with every rank's error and exit code) if any rank fails
    or the deadline passes (then all processes are killed). ``daemon=False`` for ranks that start
    processes of their own (DataLoader workers); they are still killed at the deadline.
    ``start_method``: ``"forkserver"`` (see the module docstring) or ``"spawn"``.

    The port is found free just before the ranks start, and another process can take it in
    between (seen once in CI: ``EADDRINUSE`` from rank 0's store): such a launch, which ran nothing
    of ``fn``, is repeated on a new port, up to twice."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout, daemon, start_method)
        except DistributedFailure as failure:
            lost_port = any(("EADDRINUSE" in str(e) or "address already in use" in str(e)) and "init_process_group" in str(e)
                            for e in failure.errors.values())
            if not lost_port or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts: the first launch
    return ctx


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float, daemon: bool, start_method: str) -> list[Any]:
    ctx = _context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, dict(os.environ)), daemon=daemon)
             for r in range(world_size)]
    start = time.monotonic()
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = start + timeout
    grace = None  # once every process has exited, give the queue's pipe a moment to drain
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value = queue.get(timeout=0.2)
        except Exception:
            if all(not p.is_alive() for p in procs):
                grace = grace or time.monotonic() + 2.0
                if time.monotonic() > grace:
                    break
            continue
        (results if ok else errors)[rank] = value
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    elapsed = time.monotonic() - start
    exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
    for r in range(world_size):
        if r not in results and r not in errors:
            killed = exitcodes[r] in (None, -9)
            errors[r] = "no result (killed at the deadline or died)" if killed else f"exited with {exitcodes[r]}"
    if errors:
        raise DistributedFailure(errors, exitcodes, elapsed)
    return [pickle.loads(results[r]) for r in range(world_size)]
