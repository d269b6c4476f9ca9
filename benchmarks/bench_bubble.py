"""Measured pipeline bubble vs the simulator's, on a compute-heavy 2-stage pipeline, without and
with the stage-boundary transfer cost calibrated on this machine.

At start-up (in every launch) the two ranks play ping-pong over gloo (``dist.send`` /
``dist.recv``) with one boundary activation (a microbatch of hidden states, 64 KiB here) and with
a message 16 times larger: half the activation's median round trip is the cost of one hop,
``alpha + bytes / bandwidth``, and the slope between the two sizes splits it into latency and
bandwidth.

Then, per schedule, every step (after a barrier, so both ranks start together) each rank's timeline
(recorded by the runtime) is gathered, and after the run analysed with
``lightning_pp.callbacks.analyze``: the measured bubble (``1 - busy / window`` over all ranks; busy
excludes the waits on receives) is compared with four references for the same schedule:

* ``simulated``: the simulator with the step's measured mean ``F``, ``B`` (and ``W``) costs and
  free transfers (what ``analyze`` calls the ideal; ``W`` priced as measured);
* ``calibrated``: the same plus the calibrated alpha-beta cost on every cross-rank hand-off
  (``CostModel.p2p_latency`` / ``p2p_bandwidth`` / ``activation_bytes``);
* ``per_stage`` / ``per_stage_calibrated``: the simulator with each virtual stage's own mean
  costs (``CostModel.stages``, measured by ``analyze`` as ``stage_costs``), without and with the
  calibrated hop: the plan that knows the first stage has no input gradient to compute and the
  last computes the loss;
* ``replayed_rank_means``: each rank's actions replayed in order (the simulator's rules, the
  calibrated hop) with that rank's mean cost per kind: the simulator plus the imbalance between
  ranks (the first stage has no input gradient to compute, the last computes the loss);
* ``replayed``: the same with every action's *own* measured duration: adds the jitter of single
  actions. What is left between this and the measurement is neither compute nor the idle transfer
  cost, but time the runtime spends between or around actions and transfers slower than on an
  idle machine;
* the breakdown of every rank's window into compute, exposed receive waits, and the rest (between
  actions, before the rank's first and after its last action).

Reports medians over steps, per schedule: ``bubble_measured_over_simulated_<s>`` and
``bubble_measured_over_simulated_<s>_calibrated``, ``..._<s>_per_stage``,
``..._<s>_per_stage_calibrated``, and for the breakdown
``bubble_measured_over_rank_means_<s>`` and ``bubble_measured_over_replayed_<s>``.
``bubble_measured_over_simulated`` is the 1F1B figure (the name earlier runs used).

    python benchmarks/bench_bubble.py
    python benchmarks/bench_bubble.py --quick
    python benchmarks/bench_bubble.py --schedules 1f1b,interleaved
    python benchmarks/bench_bubble.py --dry-run --schedules zb1p,zbv     # code paths only (tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_torch as peer  # noqa: E402  (same model as the comparison with torch)
from common import launch  # noqa: E402

SCHEDULES = ("1f1b", "interleaved", "zb1p", "zbv")


# -- the transfer cost, measured --------------------------------------------------------------
def _round_trips(rank: int, num_bytes: int, reps: int) -> list[float]:
    """Round-trip seconds of ``num_bytes`` from rank 0 to rank 1 and back (rank 0's clock)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, num_bytes // 4), dtype=torch.float32)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append(time.perf_counter() - start)
    return times


def calibrate_p2p(rank: int, activation_bytes: int, reps: int = 60, warmup: int = 10) -> dict:
    """Alpha-beta cost of one boundary transfer from ping-pongs (medians; the same on every rank):
    the activation's half round trip is the hop; the slope to a 16x larger message gives the
    bandwidth, and the rest of the hop is the latency (alpha)."""
    import torch
    import torch.distributed as dist

    sizes = (activation_bytes, 16 * activation_bytes)
    medians = []
    for num_bytes in sizes:
        _round_trips(rank, num_bytes, warmup)
        medians.append(statistics.median(_round_trips(rank, num_bytes, reps)))
    t = torch.tensor(medians, dtype=torch.float64)
    dist.broadcast(t, 0)
    rtt_act, rtt_big = float(t[0]), float(t[1])
    per_byte = (rtt_big - rtt_act) / 2 / (sizes[1] - sizes[0])
    bandwidth = 1.0 / per_byte if per_byte > 0 else float("inf")
    hop = rtt_act / 2
    return {"rtt_activation_s": rtt_act, "rtt_16x_s": rtt_big, "latency_s": max(0.0, hop - activation_bytes / bandwidth),
            "bandwidth_Bps": bandwidth, "activation_bytes": activation_bytes, "hop_s": hop}


# -- references -------------------------------------------------------------------------------
def replay(config, timed: list, hop: float) -> tuple[float, float]:
    """(bubble, makespan) of each rank's actions run in order with their measured durations:
    ``timed[r]`` is rank r's ``[(action, seconds)]``. An action starts when its rank is free and its
    inputs are there (the simulator's rules; ``hop`` seconds for a hand-off between two ranks)."""
    pp, last = config.pp, config.num_stages - 1
    f_end: dict = {}
    b_end: dict = {}
    clock, busy, pos = [0.0] * pp, [0.0] * pp, [0] * pp

    def ready(r: int, action) -> Optional[float]:
        start = clock[r]
        fwd, bwd = action.forward_part(), action.backward_part()
        needs = []
        if fwd is not None and config.stage_of(r, fwd[1]) > 0:
            stage = config.stage_of(r, fwd[1])
            needs.append((f_end, (fwd[0], stage - 1), config.owner_of(stage - 1)[0] != r))
        if bwd is not None:
            stage = config.stage_of(r, bwd[1])
            needs.append((f_end, (bwd[0], stage), False))
            if stage < last:
                needs.append((b_end, (bwd[0], stage + 1), config.owner_of(stage + 1)[0] != r))
        if fwd is None and bwd is None:  # W: after its own B
            needs.append((b_end, (action.microbatch, config.stage_of(r, action.chunk)), False))
        for table, key, remote in needs:
            if key not in table:
                return None
            start = max(start, table[key] + (hop if remote else 0.0))
        return start

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(timed[r]):
                action, seconds = timed[r][pos[r]]
                start = ready(r, action)
                if start is None:
                    break
                clock[r] = start + seconds
                busy[r] += seconds
                fwd, bwd = action.forward_part(), action.backward_part()
                if fwd is not None:
                    f_end[(fwd[0], config.stage_of(r, fwd[1]))] = clock[r]
                if bwd is not None:
                    b_end[(bwd[0], config.stage_of(r, bwd[1]))] = clock[r]
                pos[r] += 1
                progress = True
    if any(pos[r] < len(timed[r]) for r in range(pp)):
        raise RuntimeError(f"replay of {config.schedule} is stuck at {pos}")
    makespan = max(clock)
    return 1.0 - sum(busy) / (pp * makespan), makespan


def _step_figures(records: list, config, p2p: dict) -> dict:
    """Measured bubble, the three references and the window breakdown of one step."""
    from lightning_pp.callbacks.analysis import analyze, compute_busy, match_actions
    from lightning_pp.schedules import CostModel, simulate

    stats = analyze(records, config)
    c = stats.compute_costs
    plain = CostModel(forward=c.get("F", 0.0), backward=c.get("B", 0.0), weight_grad=c.get("W", 0.0))
    link = dict(p2p_latency=p2p["latency_s"], p2p_bandwidth=p2p["bandwidth_Bps"], activation_bytes=p2p["activation_bytes"])
    calibrated = CostModel(forward=plain.forward, backward=plain.backward, weight_grad=plain.weight_grad, **link)
    staged = CostModel(stages=stats.stage_costs)
    staged_calibrated = CostModel(stages=stats.stage_costs, **link)
    timed = []
    for record, pp_rank in zip(records, stats.pp_ranks):
        pairs = match_actions(record, config, pp_rank)
        if any(action is None for _, action in pairs):
            raise RuntimeError(f"rank {record.rank}'s spans do not follow its {config.schedule} table")
        timed.append([(action, busy) for (_, action), (_, busy, _) in zip(pairs, compute_busy(record.spans))])
    replayed, _ = replay(config, timed, p2p["hop_s"])
    # The same with every action at its rank's mean for its kind: imbalance between ranks without jitter.
    means = [{kind: statistics.mean(d for a, d in rank_timed if a.kind == kind) for kind in {a.kind for a, _ in rank_timed}}
             for rank_timed in timed]
    replayed_means, _ = replay(config, [[(a, m[a.kind]) for a, _ in t] for t, m in zip(timed, means)], p2p["hop_s"])
    window = stats.step_time
    waits = sum(stats.recv_wait) / len(records)
    busy = sum(stats.busy) / len(records)
    return {"measured": stats.bubble_fraction, "simulated": simulate(config, plain).bubble_fraction,
            "calibrated": simulate(config, calibrated).bubble_fraction, "replayed": replayed,
            "per_stage": simulate(config, staged).bubble_fraction,
            "per_stage_calibrated": simulate(config, staged_calibrated).bubble_fraction,
            "replayed_rank_means": replayed_means,
            "rank_costs_ms": [{str(k): m[k] * 1e3 for k in ("F", "B", "FB", "W") if k in m} for m in means],
            "window_ms": window * 1e3, "busy_ms": busy * 1e3, "recv_wait_ms": waits * 1e3,
            "other_ms": (window - busy - waits) * 1e3, "costs_ms": {k: v * 1e3 for k, v in c.items()}}


# -- worker -----------------------------------------------------------------------------------
def _measure(rank: int, world: int, cfg: dict, schedule: str) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_pp.callbacks.analysis import gather_spans
    from lightning_pp.runtime import build_topology

    activation_bytes = cfg["batch"] // cfg["microbatches"] * cfg["hidden"] * 4  # float32 hidden states
    p2p = calibrate_p2p(rank, activation_bytes)
    impl = peer._Ours(cfg, schedule, build_topology(world))
    g = torch.Generator().manual_seed(cfg["seed"])
    batch = (torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g))
    steps = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()
        impl.step(batch)
        records = gather_spans(impl.executor.timeline, topology=impl.executor.topology)
        if step >= cfg["warmup"]:
            steps.append(records)
    if rank != 0:
        return {}
    config = impl.executor.schedule
    return {"p2p": p2p, "steps": [_step_figures(records, config, p2p) for records in steps]}


def _median(steps: list, key: str) -> float:
    return statistics.median(s[key] for s in steps)


def run(args: Any = None) -> dict:
    args = args or parse_args([])
    cfg = dict(peer.DEFAULTS, hidden=args.hidden, microbatches=args.microbatches, steps=4 if args.quick else args.steps,
               warmup=1 if args.quick else 3)
    if getattr(args, "dry_run", False):  # the code paths on a tiny model (used by the tests)
        cfg.update(peer.DRY_RUN)
    schedules = [s.strip() for s in (getattr(args, "schedules", None) or ",".join(SCHEDULES)).split(",") if s.strip()]
    out: dict = {"config": {k: cfg[k] for k in ("hidden", "blocks", "batch", "microbatches", "steps")},
                 "schedules": schedules}
    for schedule in schedules:
        r = launch(_measure, peer.WORLD_SIZE, cfg, schedule)[0]
        steps = r["steps"]
        res = {key: _median(steps, key) for key in ("measured", "simulated", "calibrated", "per_stage", "per_stage_calibrated",
                                                    "replayed_rank_means", "replayed", "window_ms", "busy_ms",
                                                    "recv_wait_ms", "other_ms")}
        for ref in ("simulated", "calibrated", "per_stage", "per_stage_calibrated", "replayed_rank_means", "replayed"):
            ratios = [s["measured"] / s[ref] for s in steps if s[ref] > 0]
            res[f"over_{ref}"] = statistics.median(ratios) if ratios else float("nan")
            res[f"over_{ref}_range"] = (min(ratios), max(ratios)) if ratios else (float("nan"),) * 2
        res["costs_ms"] = {k: statistics.median(s["costs_ms"][k] for s in steps) for k in steps[0]["costs_ms"]}
        res["rank_costs_ms"] = [{k: statistics.median(s["rank_costs_ms"][r][k] for s in steps) for k in costs}
                                for r, costs in enumerate(steps[0]["rank_costs_ms"])]
        res["p2p"] = r["p2p"]
        out[schedule] = res
        out[f"bubble_measured_over_simulated_{schedule}"] = res["over_simulated"]
        out[f"bubble_measured_over_simulated_{schedule}_calibrated"] = res["over_calibrated"]
        out[f"bubble_measured_over_simulated_{schedule}_per_stage"] = res["over_per_stage"]
        out[f"bubble_measured_over_simulated_{schedule}_per_stage_calibrated"] = res["over_per_stage_calibrated"]
        out[f"bubble_measured_over_replayed_{schedule}"] = res["over_replayed"]
        out[f"bubble_measured_over_rank_means_{schedule}"] = res["over_replayed_rank_means"]
    if "1f1b" in schedules:
        out["bubble_measured_over_simulated"] = out["1f1b"]["over_simulated"]
    out["p2p"] = out[schedules[0]]["p2p"]
    return out


def format_report(res: dict) -> str:
    c, p = res["config"], res["p2p"]
    lines = [f"2 ranks, hidden {c['hidden']}, {c['blocks']} blocks, batch {c['batch']}, {c['microbatches']} microbatches, "
             f"{c['steps']} steps; medians over steps",
             f"p2p calibration (ping-pong over gloo, first launch): round trip {p['rtt_activation_s'] * 1e6:.0f} us "
             f"({p['activation_bytes']} B), {p['rtt_16x_s'] * 1e6:.0f} us (16x) -> alpha {p['latency_s'] * 1e6:.0f} us, "
             f"bandwidth {p['bandwidth_Bps'] / 1e9:.2f} GB/s, one activation hop {p['hop_s'] * 1e6:.0f} us",
             "bubble of: the measurement; the simulator with mean costs, free transfers (sim) and with the calibrated "
             "hop (sim+p2p); the simulator with each stage's mean costs (stage) and the hop (stage+p2p); replays "
             "with each rank's mean cost per kind (rank mean) and with every action's own duration (replay)",
             f"{'schedule':12}{'measured':>9}{'sim':>7}{'sim+p2p':>8}{'stage+p2p':>10}{'rank mean':>10}{'replay':>8}"
             f"{'/sim':>7}{'/sim+p2p':>9}{'/stage':>7}{'/stage+p2p':>11}{'/rank mean':>11}{'/replay':>8}"
             f"   window = busy + recv_wait + other (ms, mean rank)"]
    for s in res["schedules"]:
        r = res[s]
        lines.append(f"{s:12}{r['measured']:9.3f}{r['simulated']:7.3f}{r['calibrated']:8.3f}{r['per_stage_calibrated']:10.3f}"
                     f"{r['replayed_rank_means']:10.3f}{r['replayed']:8.3f}"
                     f"{r['over_simulated']:7.2f}{r['over_calibrated']:9.2f}{r['over_per_stage']:7.2f}"
                     f"{r['over_per_stage_calibrated']:11.2f}{r['over_replayed_rank_means']:11.2f}"
                     f"{r['over_replayed']:8.2f}"
                     f"   {r['window_ms']:.1f} = {r['busy_ms']:.1f} + {r['recv_wait_ms']:.1f} + {r['other_ms']:.1f}")
    lines.append("mean busy ms per action, all ranks | per rank:")
    for s in res["schedules"]:
        r = res[s]
        per_rank = " | ".join(" ".join(f"{k} {v:.2f}" for k, v in costs.items()) for costs in r["rank_costs_ms"])
        lines.append(f"  {s:12}{' '.join(f'{k} {v:.2f}' for k, v in r['costs_ms'].items())} | {per_rank}")
    for s in res["schedules"]:
        for key in (f"bubble_measured_over_simulated_{s}", f"bubble_measured_over_simulated_{s}_calibrated",
                    f"bubble_measured_over_simulated_{s}_per_stage", f"bubble_measured_over_simulated_{s}_per_stage_calibrated",
                    f"bubble_measured_over_rank_means_{s}", f"bubble_measured_over_replayed_{s}"):
            lines.append(f"{key}: {res[key]:.3f}")
    if "bubble_measured_over_simulated" in res:
        lines.append(f"bubble_measured_over_simulated: {res['bubble_measured_over_simulated']:.3f}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of {', '.join(peer.SCHEDULES)}")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="tiny model, one step: checks the code paths")
    return p.parse_args(argv)


if __name__ == "__main__":
    print(format_report(run(parse_args())))
