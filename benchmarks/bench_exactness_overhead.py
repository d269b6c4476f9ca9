"""What the exactness guards cost: the per-step batch check, the broadcast alternative, and the
per-stage random streams.

On 2 gloo processes (pp=2, 1F1B; model: input linear, ``--blocks`` residual MLP blocks of width
``--hidden`` (4x expansion), output linear; float32; a batch of ``--batch`` rows of ``--hidden``
features in ``--microbatches``), a step is ``zero_grad`` + ``executor.train_step`` + ``SGD.step``,
timed after a barrier, the step time being the maximum over the ranks. Rounds of three blocks of
``--block-size`` steps (the order rotates every round), one per setting of the same executor:

* ``off``: ``check_batches="off"`` (no fingerprint),
* ``check``: ``check_batches="raise"`` (the default: every rank fingerprints its batch, and the
  fingerprints ride on the loss all-reduce),
* ``broadcast``: ``broadcast_batches=True`` (pipeline rank 0's batch sent to rank 1 every step).

``check_overhead`` / ``broadcast_overhead`` = median over rounds of median(block) / median(off
block), minus 1. In-process, without the noise of whole steps: ``fingerprint_ms`` is the median
time to fingerprint one batch, ``rng_swap_us`` the median time to enter and leave one chunk's
random stream (done once per chunk forward), and ``*_bound`` those costs per step over the median
step time.

Usage::

    python benchmarks/bench_exactness_overhead.py            # about a minute
    python benchmarks/bench_exactness_overhead.py --quick    # smoke test

Prints ``name: value`` lines; ``run(args)`` returns the figures as a dict.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch  # noqa: E402

SETTINGS = ("off", "check", "broadcast")


def _model(hidden: int, blocks: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def pipeline_layers(self):
            return [self.inp, *self.blocks, self.out]

        def pipeline_loss(self, output, batch):
            return nn.functional.mse_loss(output, batch[1])

    return Net()


def _apply(executor, setting: str) -> None:
    executor.broadcast_batches = setting == "broadcast"
    executor.check_batches = "raise" if setting == "check" else "off"


def _bench(rank, world, args):
    import torch
    import torch.distributed as dist

    from lightning_pp.runtime import build_pipeline
    from lightning_pp.runtime.step.microbatch import batch_fingerprint

    torch.manual_seed(0)
    model = _model(args.hidden, args.blocks)
    executor = build_pipeline(model, pipeline_parallel_size=2, num_microbatches=args.microbatches)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(args.batch, args.hidden, generator=g), torch.randn(args.batch, args.hidden, generator=g))

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        executor.train_step(batch)
        optimizer.step()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for setting in SETTINGS:  # warm up every path
        _apply(executor, setting)
        step()
    ratios = {s: [] for s in SETTINGS[1:]}
    times = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        order = SETTINGS[r % 3:] + SETTINGS[:r % 3]
        block = {}
        for setting in order:
            _apply(executor, setting)
            block[setting] = statistics.median(step() for _ in range(args.block_size))
            times[setting].append(block[setting])
        for setting in ratios:
            ratios[setting].append(block[setting] / block["off"])
    _apply(executor, "check")
    fingerprint = []
    for _ in range(50):
        start = time.perf_counter()
        float(batch_fingerprint(batch, torch.device("cpu")))
        fingerprint.append(time.perf_counter() - start)
    swap = []
    for _ in range(2000):
        start = time.perf_counter()
        with executor.rng.stream(0):
            pass
        swap.append(time.perf_counter() - start)
    executor.close()
    step_time = statistics.median(times["off"])
    chunk_forwards = args.microbatches * len(executor.partition.chunks)
    return {
        "step_ms_off": 1e3 * step_time,
        "step_ms_check": 1e3 * statistics.median(times["check"]),
        "step_ms_broadcast": 1e3 * statistics.median(times["broadcast"]),
        "check_overhead": statistics.median(ratios["check"]) - 1,
        "broadcast_overhead": statistics.median(ratios["broadcast"]) - 1,
        "fingerprint_ms": 1e3 * statistics.median(fingerprint),
        "fingerprint_bound": statistics.median(fingerprint) / step_time,
        "rng_swap_us": 1e6 * statistics.median(swap),
        "rng_bound": statistics.median(swap) * chunk_forwards / step_time,
    }


def run(args) -> dict:
    return launch(_bench, 2, args, timeout=900)[0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--block-size", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.rounds, args.block_size = 128, 3, 2
    figures = run(args)
    for name, value in figures.items():
        print(f"{name}: {value:.4g}")
    return figures


if __name__ == "__main__":
    main()
