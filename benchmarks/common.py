"""Helpers shared by the benchmarks: launching gloo processes and summarising timings."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import statistics
import time
import traceback
from typing import Any, Callable, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException as exc:
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def launch(fn: Callable, world: int, *args: Any, timeout: float = 600.0, env: Optional[dict] = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo processes (one thread each); the
    results by rank. A rank's error (or a rank that died, or the deadline) ends every process at
    once and raises with each rank's message. ``env``: variables the processes start with (read
    by libraries at process start, as glibc's ``MALLOC_*``), this launch only."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, queue), daemon=True) for r in range(world)]
    saved = {name: os.environ.get(name) for name in (env or {})}
    os.environ.update(env or {})
    try:
        for p in procs:
            p.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    deadline = time.monotonic() + timeout
    results: dict = {}
    errors: dict = {}
    all_dead_since = None
    try:
        while len(results) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, ok, value = queue.get(timeout=0.5)
            except Exception:
                if all(not p.is_alive() for p in procs):
                    all_dead_since = all_dead_since or time.monotonic()
                    if time.monotonic() - all_dead_since > 3.0:  # let the queue's pipe drain
                        break
                continue
            (results if ok else errors)[rank] = value
            if errors:  # the peers are likely stuck in a collective: do not wait for them
                break
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors or len(results) < world:
        timed_out = time.monotonic() >= deadline
        lines = [f"rank {r}: {e}" for r, e in sorted(errors.items())]
        lines += [f"rank {r}: no result ({'killed at the timeout' if timed_out else 'died'})"
                  for r in range(world) if r not in results and r not in errors]
        raise RuntimeError("benchmark failed:\n" + "\n".join(lines))
    return [pickle.loads(results[r]) for r in range(world)]


def summary(values: list[float]) -> dict:
    """Median and interquartile range."""
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "q1": q[0], "q3": q[2], "n": len(ordered)}


def max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def link_args(doc: str, argv=None):
    """Command line of the benchmarks with an emulated expert link: ``--delay`` and ``--quick``."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay", type=float, default=0.0015, help="emulated seconds per expert exchange")
    p.add_argument("--quick", action="store_true")
    return p.parse_args(argv)
