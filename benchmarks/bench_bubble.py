"""Measured pipeline bubble vs the simulator's, on a compute-heavy 2-stage pipeline.

Every step, each rank's timeline (recorded by the runtime) is gathered and analysed with
``lightning_pp.callbacks.analyze``: the measured bubble (``1 - busy / window`` over all ranks) is
compared with the simulator's bubble for the same schedule and the step's measured mean forward
and backward costs. Reports the median over steps of measured / simulated, per schedule.

    python benchmarks/bench_bubble.py
    python benchmarks/bench_bubble.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_torch as peer  # noqa: E402  (same model as the comparison with torch)
from common import launch  # noqa: E402


def _measure(rank: int, world: int, cfg: dict, schedule: str) -> dict:
    import torch

    from lightning_pp.callbacks.analysis import analyze, gather_spans
    from lightning_pp.runtime import build_topology

    impl = peer._Ours(cfg, schedule, build_topology(world))
    g = torch.Generator().manual_seed(cfg["seed"])
    batch = (torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g))
    measured, ideal = [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        impl.step(batch)
        stats = analyze(gather_spans(impl.executor.timeline, topology=impl.executor.topology), impl.executor.config)
        if step >= cfg["warmup"]:
            measured.append(stats.bubble_fraction)
            ideal.append(stats.ideal_bubble)
    return {"measured": measured, "ideal": ideal}


def run(args: Any = None) -> dict:
    args = args or parse_args([])
    cfg = dict(peer.DEFAULTS, hidden=args.hidden, microbatches=args.microbatches, steps=4 if args.quick else args.steps,
               warmup=1 if args.quick else 3)
    out = {"config": {k: cfg[k] for k in ("hidden", "blocks", "batch", "microbatches", "steps")}}
    for schedule in ("1f1b", "interleaved"):
        r = launch(_measure, peer.WORLD_SIZE, cfg, schedule)[0]
        ratios = [m / i for m, i in zip(r["measured"], r["ideal"]) if i > 0]
        out[schedule] = {"measured": statistics.median(r["measured"]), "ideal": statistics.median(r["ideal"]),
                         "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    out["bubble_measured_over_simulated"] = out["1f1b"]["ratio"]
    return out


def format_report(res: dict) -> str:
    c = res["config"]
    lines = [f"2 ranks, hidden {c['hidden']}, {c['blocks']} blocks, batch {c['batch']}, {c['microbatches']} microbatches, "
             f"{c['steps']} steps", f"{'schedule':14}{'measured':>10}{'simulated':>11}{'ratio':>8}{'min':>7}{'max':>7}"]
    for s in ("1f1b", "interleaved"):
        r = res[s]
        lines.append(f"{s:14}{r['measured']:10.3f}{r['ideal']:11.3f}{r['ratio']:8.2f}{r['ratio_min']:7.2f}{r['ratio_max']:7.2f}")
    lines.append(f"bubble_measured_over_simulated: {res['bubble_measured_over_simulated']:.3f}")
    lines.append(f"bubble_measured_over_simulated_interleaved: {res['interleaved']['ratio']:.3f}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    print(format_report(run(parse_args())))
