"""How much of a pipelined step is the runtime's own Python, per schedule: the bench_vs_torch model
at pp = 2, each rank's steps under ``cProfile``, summing the time spent inside ``lightning_pp``'s
own functions (tottime: not the torch kernels or collectives they call, but including Python
object bookkeeping and the memory freed there). A profiler slows Python more than kernels, so the
share is an upper bound.

    python benchmarks/bench_runtime_python.py                       # 1f1b, interleaved, zb1p, zbv
    python benchmarks/bench_runtime_python.py --schedules zbv --steps 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_torch as peer  # noqa: E402  (same model as the comparison with torch)
from common import launch  # noqa: E402


def _profile(rank: int, world: int, cfg: dict, schedule: str, steps: int) -> dict:
    import cProfile
    import pstats

    import torch
    import torch.distributed as dist

    from lightning_pp.runtime import build_topology

    impl = peer._Ours(cfg, schedule, build_topology(world))
    g = torch.Generator().manual_seed(cfg["seed"])
    batch = (torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g))
    for _ in range(2):
        impl.step(batch)
    dist.barrier()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        impl.step(batch)
    profile.disable()
    stats = pstats.Stats(profile).stats
    ours = {k: v[2] for k, v in stats.items() if "/lightning_pp/" in k[0]}
    top = sorted(ours.items(), key=lambda kv: -kv[1])[:5]
    return {"ours_ms": sum(ours.values()) * 1e3 / steps, "total_ms": sum(v[2] for v in stats.values()) * 1e3 / steps,
            "top": [(f"{k[0].split('lightning_pp/')[-1]}:{k[1]}({k[2]})", t * 1e3 / steps) for k, t in top]}


def run(args: Optional[argparse.Namespace] = None) -> dict:
    args = args or parse_args([])
    cfg = dict(peer.DEFAULTS)
    out: dict = {}
    for schedule in [s.strip() for s in args.schedules.split(",") if s.strip()]:
        ranks = launch(_profile, peer.WORLD_SIZE, cfg, schedule, args.steps)
        out[schedule] = ranks
        out[f"runtime_python_share_{schedule}"] = max(r["ours_ms"] / r["total_ms"] for r in ranks)
    return out


def format_report(res: dict) -> str:
    lines = ["runtime's own Python time per step under cProfile (upper bound), per rank; top functions by own time"]
    for key, ranks in res.items():
        if key.startswith("runtime_python_share_"):
            continue
        for rank, r in enumerate(ranks):
            lines.append(f"{key:12} rank {rank}: {r['ours_ms']:.1f} of {r['total_ms']:.1f} ms "
                         f"({r['ours_ms'] / r['total_ms']:.1%}); " + ", ".join(f"{n} {t:.2f}" for n, t in r["top"][:3]))
    lines += [f"{key}: {value:.4f}" for key, value in res.items() if key.startswith("runtime_python_share_")]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", default="1f1b,interleaved,zb1p,zbv")
    p.add_argument("--steps", type=int, default=6)
    return p.parse_args(argv)


if __name__ == "__main__":
    print(format_report(run(parse_args())))
