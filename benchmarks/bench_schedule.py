"""Time generating and simulating a large interleaved schedule.

    python benchmarks/bench_schedule.py [--pp 64 --vp 4 --microbatches 1024 --repeats 5]

pp=64, vp=4, 1024 microbatches is 524,288 actions. The target is under 2 s (median) on a slow
2-core machine; ``simulate(cfg)`` builds the tables (all_rank_actions) and places every action.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_pp.schedules import make_config, simulate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="interleaved")
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--vp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    timings = []
    result = None
    for _ in range(args.repeats):
        result = None  # free the previous run's events outside the timed region
        started = time.perf_counter()
        cfg = make_config(args.schedule, args.pp, args.vp, args.microbatches)
        result = simulate(cfg)
        timings.append(time.perf_counter() - started)

    median = statistics.median(timings)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    print(f"command: {command}")
    print(
        f"config: schedule={args.schedule} pp={args.pp} vp={args.vp} microbatches={args.microbatches} "
        f"actions={len(result.events)} bubble_fraction={result.bubble_fraction:.6f}"
    )
    print(f"runs: {', '.join(f'{t:.3f}' for t in timings)}")
    print(f"schedule_generate_simulate_seconds: {median:.3f}")


if __name__ == "__main__":
    main()
