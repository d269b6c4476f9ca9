"""Command line: print, simulate and draw a pipeline schedule.

    python -m lightning_pp.schedules --pp 4 --vp 2 --microbatches 8 --schedule interleaved
    python -m lightning_pp.schedules --pp 4 --format json
    python -m lightning_pp.schedules --pp 8 --plot timeline.png --trace trace.json
    python -m lightning_pp.schedules --pp 4 --schedule zbv --microbatches 8
    python -m lightning_pp.schedules --pp 2 --stage-costs "1,2;1.4,2.6"   # a last stage 30 % heavier
    python -m lightning_pp.schedules --pp 4 --costs costs.json --layout auto   # layers per stage from a cost file

Invalid configurations print the validation message and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, Sequence

from lightning_pp.schedules.auto_layout import LayerCosts, LayoutChoice, choose_layout, evaluate_layout, even_layout
from lightning_pp.schedules.costs import CostModel, StageCost
from lightning_pp.schedules.plot import plot_timeline
from lightning_pp.schedules.render import ascii_timeline, chrome_trace, stats_table
from lightning_pp.schedules.simulator import simulate
from lightning_pp.schedules.registry import schedule_names, schedule_spec
from lightning_pp.schedules.tables import make_config


def build_parser() -> argparse.ArgumentParser:
    names = schedule_names()  # read now: schedules registered before the parser is built are listed
    two_chunks = [n for n in names if schedule_spec(n).placement == "v"]
    split = [n for n in names if schedule_spec(n).splits_backward]
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pp.schedules",
        description="Print the per-rank action tables of a pipeline schedule and simulate them.",
    )
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(names)} (default: 1f1b)")
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size (ranks)")
    parser.add_argument(
        "--vp", type=int, default=None,
        help=f"virtual pipeline size: chunks per rank (default: 2 for {', '.join(two_chunks)}, else 1)",
    )
    parser.add_argument("--num-microbatches", "--microbatches", dest="num_microbatches", type=int, default=None,
                        help="microbatches per step (default: 2 * pp); --microbatches is the same flag")
    parser.add_argument("--group-size", type=int, default=None, help="interleaved microbatch group size (default: pp)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("--width", type=int, default=None, help="timeline width in columns (default: 100)")
    parser.add_argument("--plot", metavar="PATH", help="also draw the timeline to an image (needs matplotlib)")
    parser.add_argument("--trace", metavar="PATH", help="also write a Chrome/Perfetto trace JSON")

    costs = parser.add_argument_group("cost model (per microbatch and chunk)")
    costs.add_argument("--forward", type=float, default=1.0, help="forward compute time (default: 1)")
    costs.add_argument(
        "--backward", type=float, default=None,
        help="backward compute time, input gradient only where a W is split off (default: 2; 1 for "
        f"{', '.join(split)})",
    )
    costs.add_argument(
        "--weight-grad", type=float, default=None,
        help="weight-gradient time: part of every full backward, the cost of each W (default: 0; 1 for "
        f"{', '.join(split)}, so that B + W = 2 either way)",
    )
    costs.add_argument(
        "--stage-costs", default=None, metavar="F,B[,W];...",
        help="compute prices per virtual stage, in stage order, replacing --forward/--backward/--weight-grad: "
        "'forward,backward[,weight_grad]' for each of the pp * vp stages, separated by ';'",
    )
    costs.add_argument(
        "--costs", metavar="PATH", default=None,
        help="a cost file: per-layer (or per-stage) times and bytes, as lightning_pp measures them "
        "(layout='auto' at setup, PipelineMonitor(write_costs=True)); the stages' prices follow from --layout",
    )
    costs.add_argument(
        "--layout", default=None, metavar="auto|even|N,N,...",
        help="with --costs: 'auto' (the layout this schedule's simulator predicts fastest, what layout='auto' "
        "chooses), 'even', or layers per virtual stage, e.g. 3,2,2,1 (default: auto)",
    )
    costs.add_argument("--memory-budget", type=float, default=None, metavar="BYTES",
                       help="with --layout auto: the bytes each rank may hold")
    costs.add_argument("--a2a-forward", type=float, default=0.0, help="expert all-to-all time in each forward")
    costs.add_argument("--a2a-backward", type=float, default=0.0, help="expert all-to-all time in each backward")
    costs.add_argument("--p2p-latency", type=float, default=0.0, help="stage-boundary message latency (alpha)")
    costs.add_argument("--p2p-bandwidth", type=float, default=math.inf, help="stage-boundary bandwidth, bytes/s")
    costs.add_argument("--activation-bytes", type=float, default=0, help="bytes per stage-boundary message")
    costs.add_argument("--dp", type=int, default=1, help="data-parallel replicas for the gradient all-reduce")
    costs.add_argument("--grad-bytes", type=float, default=0, help="gradient bytes per rank to all-reduce")
    costs.add_argument("--dp-latency", type=float, default=0.0, help="all-reduce per-message latency (alpha)")
    costs.add_argument("--dp-bandwidth", type=float, default=math.inf, help="all-reduce bandwidth, bytes/s")
    return parser


def parse_stage_costs(text: str) -> tuple[StageCost, ...]:
    """``--stage-costs``: ``'forward,backward[,weight_grad]'`` per virtual stage, ``;`` between stages."""
    stages = []
    for index, entry in enumerate(part.strip() for part in text.split(";")):
        try:
            numbers = [float(x) for x in entry.split(",")]
        except ValueError:
            numbers = []
        if len(numbers) not in (2, 3):
            raise ValueError(
                f"--stage-costs={text!r} is invalid at stage {index} ({entry!r}): each virtual stage takes "
                f"'forward,backward' or 'forward,backward,weight_grad' (numbers), stages separated by ';', "
                f"e.g. --stage-costs '1,2;1.3,2.6' for pp=2."
            )
        stages.append(StageCost(*numbers))
    return tuple(stages)


def layout_from_costs(cfg, args, base: CostModel) -> tuple[CostModel, Optional[LayoutChoice], list]:
    """``--costs`` / ``--layout``: the cost model with each virtual stage's prices summed over its
    layers, the choice when the layout is ``auto`` (else ``None``), and the layout."""
    if args.costs is None:
        if args.layout is not None or args.memory_budget is not None:
            raise ValueError("--layout and --memory-budget need --costs PATH: a cost file of per-layer times and "
                             "bytes (written by PipelineMonitor(write_costs=True), or measured by layout='auto').")
        return base, None, []
    if args.stage_costs:
        raise ValueError("--stage-costs and --costs both give the stages' prices: pass one of them.")
    layer_costs = LayerCosts.load(args.costs)
    base = layer_costs.cost_model(base)  # the file's measured link, unless --p2p-* price one
    spec = (args.layout or "auto").strip().lower()
    if spec == "auto":
        choice = choose_layout(cfg, layer_costs, args.memory_budget, base)
        return CostModel(**{**_fields(base), "stages": choice.chosen.stage_costs}), choice, choice.layout
    if args.memory_budget is not None:
        raise ValueError("--memory-budget applies to --layout auto only.")
    if spec == "even":
        layout = even_layout(len(layer_costs.layers), cfg.num_stages)
    else:
        try:
            layout = [int(x) for x in spec.split(",")]
        except ValueError:
            layout = []
    if len(layout) != cfg.num_stages or min(layout, default=0) < 1 or sum(layout) != len(layer_costs.layers):
        raise ValueError(f"--layout={args.layout!r} is invalid: give 'auto', 'even', or {cfg.num_stages} layer counts "
                         f">= 1 (pp * vp virtual stages) summing to the cost file's {len(layer_costs.layers)} layers, "
                         f"separated by commas, e.g. {','.join(map(str, even_layout(len(layer_costs.layers), cfg.num_stages)))}.")
    estimate = evaluate_layout(cfg, layer_costs, layout, base)
    return CostModel(**{**_fields(base), "stages": estimate.stage_costs}), None, layout


def _fields(costs: CostModel) -> dict:
    return {name: getattr(costs, name) for name in costs.__dataclass_fields__}


def _json_report(cfg, result) -> dict:
    ranks = [{"rank": rank, "actions": []} for rank in range(cfg.pp)]
    for rank, action, start, end in result.events:
        entry = action.to_dict()
        if "microbatch" not in entry:  # FB: give the common keys too (forward half), for uniform readers
            entry = {"kind": entry["kind"], "microbatch": action.microbatch, "chunk": action.chunk, **entry}
        entry["stage"] = cfg.stage_of(rank, action.chunk)
        if action.b_chunk is not None:
            entry["b_stage"] = cfg.stage_of(rank, action.b_chunk)
        entry["start"] = start
        entry["end"] = end
        ranks[rank]["actions"].append(entry)
    return {
        "schedule": cfg.schedule,
        "pp": cfg.pp,
        "vp": cfg.vp,
        "microbatches": cfg.num_microbatches,
        "ranks": ranks,
        "stats": {
            "bubble_fraction": result.bubble_fraction,
            "makespan": result.makespan,
            "peak_inflight": list(result.peak_inflight),
        },
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        vp = args.vp if args.vp is not None else (2 if schedule_spec(args.schedule).placement == "v" else 1)
        cfg = make_config(args.schedule, args.pp, vp, args.num_microbatches, args.group_size)
        split = cfg.spec.splits_backward
        costs = CostModel(
            forward=args.forward,
            backward=args.backward if args.backward is not None else (1.0 if split else 2.0),
            weight_grad=args.weight_grad if args.weight_grad is not None else (1.0 if split else 0.0),
            a2a_forward=args.a2a_forward,
            a2a_backward=args.a2a_backward,
            p2p_latency=args.p2p_latency,
            p2p_bandwidth=args.p2p_bandwidth,
            activation_bytes=args.activation_bytes,
            dp_size=args.dp,
            grad_bytes=args.grad_bytes,
            dp_latency=args.dp_latency,
            dp_bandwidth=args.dp_bandwidth,
            stages=parse_stage_costs(args.stage_costs) if args.stage_costs else (),
        )
        costs, choice, layout = layout_from_costs(cfg, args, costs)
        result = simulate(cfg, costs)
        timeline = ascii_timeline(result, cfg.pp, args.width) if args.format == "text" else None
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    try:
        if args.format == "json":
            report = _json_report(cfg, result)
            if layout:
                report["layout"] = layout
            if choice is not None:
                report["auto_layout"] = choice.to_dict()
            json.dump(report, sys.stdout)
            sys.stdout.write("\n")
        else:
            print(
                f"schedule={cfg.schedule} pp={cfg.pp} vp={cfg.vp} microbatches={cfg.num_microbatches}"
                + (f" group_size={cfg.group_size}" if cfg.is_interleaved else "")
                + (f" placement=v (chunk 0 of rank r is stage r, chunk 1 is stage {2 * cfg.pp - 1} - r)"
                   if cfg.placement == "v" else "")
            )
            if choice is not None:
                print(choice.describe())
            elif layout:
                print(f"layers per virtual stage {layout}")
            print(timeline)
            print()
            print(stats_table(result))
        sys.stdout.flush()
    except BrokenPipeError:
        # Piped into e.g. `head`: not worth a traceback. Point stdout at devnull so the flush at
        # interpreter exit does not raise again (the recipe from Python's signal docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(result, cfg), f)
        print(f"wrote trace {args.trace}", file=sys.stderr)
    if args.plot:
        try:
            plot_timeline(result, cfg, args.plot)
        except ImportError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"wrote plot {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
