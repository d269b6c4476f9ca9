"""Seeing the pipeline: the analysis of recorded spans, the merged trace and picture, the
PipelineMonitor callback in a 2-process Trainer fit and capture_step from Fabric."""

from __future__ import annotations

import csv
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from distributed import run_distributed
from lightning_models import PipeRegressor, loader
from lightning_pp.callbacks import analyze, export_png, export_trace, gather_spans, merged_trace
from lightning_pp.callbacks.analysis import RankTimeline, clock_offsets, compute_busy
from lightning_pp.runtime.timeline import Span, Timeline
from lightning_pp.schedules import CostModel, StageCost, make_config, rank_actions, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


# -- pure analysis on hand-made spans ------------------------------------------------------------
def _hand_made(rank1_shift: float = 2.0, rank1_host: str = "host-a", rank1_unix_shift: float = 1.0):
    """1F1B, pp=2, 2 microbatches. Rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1 (the tables' order).
    Every F costs 1 and every B 2 of busy time; the receive waits inside actions are not busy."""
    rank0 = [
        ("F", 0, 0, 0.0, 1.0),
        ("a2a", 0, 0, 0.2, 0.9),  # an all-to-all of 0.7 of which 0.1 is exposed
        ("a2a_wait", 0, 0, 0.8, 0.9),
        ("F", 1, 0, 1.0, 2.0),
        ("B", 0, 0, 2.0, 5.0),
        ("recv_wait", 0, 0, 2.0, 2.6),  # header, then tensor: two waits of one message
        ("recv_wait", 0, 0, 2.6, 3.0),
        ("B", 1, 0, 5.0, 8.0),
        ("recv_wait", 1, 0, 5.0, 6.0),
        ("optimizer", -1, -1, 8.2, 8.7),
    ]
    rank1 = [
        ("F", 0, 0, 0.0, 1.5),
        ("recv_wait", 0, 1, 0.0, 0.5),
        ("B", 0, 0, 1.5, 3.5),
        ("F", 1, 0, 3.5, 4.5),
        ("B", 1, 0, 4.5, 6.5),
    ]
    return [
        RankTimeline(rank=0, pp_rank=0, dp_rank=0, spans=[Span(*s) for s in rank0], origin=100.0,
                     origin_unix=5000.0, host="host-a"),
        RankTimeline(rank=1, pp_rank=1, dp_rank=0, spans=[Span(*s) for s in rank1], origin=100.0 + rank1_shift,
                     origin_unix=5000.0 + rank1_unix_shift, host=rank1_host),
    ]


def test_analysis_of_hand_made_spans():
    cfg = make_config("1f1b", 2, 1, 2)
    stats = analyze(_hand_made(), cfg)
    # Same host: monotonic origins, rank 1 starts 2.0 later, so its last action ends at 8.5 and the
    # common window is [0, 8.5]. Busy: rank 0 = 1 + 1 + (3 - 1) + (3 - 1) = 6, rank 1 = 1 + 2 + 1 + 2 = 6.
    assert stats.alignment == "monotonic"
    assert stats.offsets == [0.0, 2.0]
    assert stats.window == (0.0, 8.5)
    assert stats.busy == pytest.approx([6.0, 6.0])
    assert stats.recv_wait == pytest.approx([2.0, 0.5])
    assert stats.rank_bubble == pytest.approx([1 - 6 / 8.5, 1 - 6 / 8.5])
    assert stats.bubble_fraction == pytest.approx(1 - 12 / (2 * 8.5))
    assert stats.costs == pytest.approx({"F": 1.0, "B": 2.0})
    assert stats.counts == {"F": 4, "B": 4}
    # The simulator with F = 1, B = 2: makespan (m + pp - 1)(F + B) = 9, busy 6 -> 1/3.
    assert stats.ideal_bubble == pytest.approx(1 / 3)
    assert stats.ideal_rank_bubble == pytest.approx([1 / 3, 1 / 3])
    assert stats.a2a_total == pytest.approx(0.7) and stats.a2a_exposed == pytest.approx(0.1)
    assert stats.a2a_hidden == pytest.approx(1 - 0.1 / 0.7)
    assert stats.optimizer == pytest.approx([0.5, 0.0])
    metrics = stats.metrics()
    assert metrics["pipeline/bubble"] == pytest.approx(1 - 12 / 17)
    assert metrics["pipeline/forward_ms"] == pytest.approx(1000.0)
    assert metrics["pipeline/bubble_rank1"] == pytest.approx(1 - 6 / 8.5)
    assert metrics["pipeline/a2a_hidden"] == pytest.approx(6 / 7)
    # Each stage's own prices (compute less all-to-all waits): stage 0 F (0.9 + 1) / 2, B 2; stage 1
    # F 1, B 2; plus the mean exposed all-to-all of an F (0.1 / 4). Placed by hand: rank 0 F0
    # [0, .975] F1 [.975, 1.95] B0 [4, 6] B1 [7.025, 9.025]; rank 1 F0 [.975, 2] B0 [2, 4] F1
    # [4, 5.025] B1 [5.025, 7.025]: busy 5.95 + 6.05 in a makespan of 9.025.
    assert [x for stage in stats.stage_costs for x in stage] == pytest.approx([0.95, 2.0, 0.0, 1.0, 2.0, 0.0])
    assert stats.ideal_bubble_per_stage == pytest.approx(1 - 12 / (2 * 9.025))
    assert metrics["pipeline/ideal_bubble_per_stage"] == pytest.approx(1 - 12 / 18.05)
    assert "bubble 29.4% (ideal 33.3%; 33.5% at each stage's own costs)" in stats.summary()

    # Without alignment both ranks start together: the window is [0, 8] and the bubble 1 - 6/8.
    plain = analyze(_hand_made(), cfg, alignment="none")
    assert plain.window == (0.0, 8.0)
    assert plain.bubble_fraction == pytest.approx(0.25)
    # On different hosts the wall-clock origins are used (rank 1: +1.0 -> window [0, 8]).
    other_host = analyze(_hand_made(rank1_host="host-b"), cfg)
    assert other_host.alignment == "wall"
    assert other_host.rank_bubble == pytest.approx([0.25, 0.25])
    # Plain lists of span tuples work too (rank order = global rank, no clock information).
    lists = analyze([[tuple(vars(s).values()) for s in r.spans] for r in _hand_made()], cfg)
    assert lists.alignment == "none" and lists.bubble_fraction == pytest.approx(0.25)


@pytest.mark.parametrize("schedule,pp,vp,microbatches", [
    ("1f1b", 2, 1, 4), ("gpipe", 3, 1, 5), ("interleaved", 2, 2, 4), ("combined_1f1b", 2, 2, 6), ("combined_1f1b", 3, 1, 5),
    ("zb1p", 3, 1, 5), ("zbv", 2, 2, 4), ("dualpipev", 2, 2, 4),
])
def test_a_step_that_runs_exactly_as_simulated_measures_as_simulated(schedule, pp, vp, microbatches):
    """Spans taken from the simulator (F 1.5, B 2.5 units, as seconds) are a step that ran exactly
    to plan: the measured bubble must equal the simulator's, per rank and overall, and the trace
    must name every action (combined ones with both halves) as the plan does."""
    cfg = make_config(schedule, pp, vp, microbatches)
    split = any(a.kind == "W" for r in range(pp) for a in rank_actions(cfg, r))  # zero-bubble tables
    plan = simulate(cfg, CostModel(forward=1.5, backward=2.5, weight_grad=1.0 if split else 0.0))
    spans = [[Span(action.kind, action.microbatch, action.chunk, start, end)
              for _, action, start, end in plan.rank_events(rank)] for rank in range(pp)]
    stats = analyze(spans, cfg)
    assert stats.bubble_fraction == pytest.approx(plan.bubble_fraction)
    assert stats.rank_bubble == pytest.approx(plan.rank_bubble)
    assert stats.ideal_bubble == pytest.approx(plan.bubble_fraction)
    assert stats.ideal_bubble_per_stage == pytest.approx(plan.bubble_fraction)  # the stages cost the same
    assert stats.step_time == pytest.approx(plan.pipeline_makespan)
    events = [e for e in merged_trace(spans, cfg)["traceEvents"] if e["ph"] == "X"]
    for rank in range(pp):
        planned = [(e["name"], e["ts"], e["dur"]) for e in events if e["pid"] == rank and e["args"]["track"] == "planned"]
        measured = [(e["name"], e["ts"], e["dur"]) for e in events if e["pid"] == rank and e["args"]["track"] == "measured"]
        assert [n for n, _, _ in measured] == [a.describe() for _, a, _, _ in plan.rank_events(rank)]
        assert [n for n, _, _ in measured] == [n for n, _, _ in planned]
        for (_, ts_m, dur_m), (_, ts_p, dur_p) in zip(measured, planned):
            assert ts_m == pytest.approx(ts_p) and dur_m == pytest.approx(dur_p)


@pytest.mark.parametrize("schedule,pp,vp,microbatches", [
    ("1f1b", 3, 1, 6), ("interleaved", 2, 2, 4), ("zb1p", 3, 1, 5), ("zbv", 2, 2, 4),
])
def test_the_ideal_at_each_stages_own_costs_is_the_plan_of_a_step_with_unequal_stages(schedule, pp, vp, microbatches):
    """A step that ran exactly to a plan whose stages cost different amounts: the measured bubble,
    and the ideal made from each stage's own measured prices, equal the plan's; the ideal with one
    price per kind (the means) does not."""
    cfg = make_config(schedule, pp, vp, microbatches)
    split = any(a.kind == "W" for r in range(pp) for a in rank_actions(cfg, r))
    stages = [StageCost(1.0 + 0.5 * s, 2.0 + s, 1.0 + 0.25 * s if split else 0.0) for s in range(cfg.num_stages)]
    plan = simulate(cfg, CostModel(stages=stages))
    spans = [[Span(action.kind, action.microbatch, action.chunk, start, end)
              for _, action, start, end in plan.rank_events(rank)] for rank in range(pp)]
    stats = analyze(spans, cfg)
    assert stats.bubble_fraction == pytest.approx(plan.bubble_fraction)
    assert [x for stage in stats.stage_costs for x in stage] == pytest.approx([x for stage in stages for x in stage])
    assert stats.ideal_bubble_per_stage == pytest.approx(plan.bubble_fraction)
    assert stats.ideal_bubble != pytest.approx(plan.bubble_fraction)


def test_overlapping_all_to_alls_get_their_own_trace_lanes():
    cfg = make_config("1f1b", 2, 1, 2)
    records = _hand_made()
    # With the one already there ([0.2, 0.9]): two in flight from 0.5 to 0.9, the third fits after.
    records[0].spans += [Span("a2a", 1, 0, 0.5, 1.5), Span("a2a", 0, 0, 1.0, 1.2)]
    events = [e for e in merged_trace(records, cfg)["traceEvents"] if e.get("cat") == "a2a"]
    lanes = {(e["args"]["microbatch"], round(e["ts"])): e["tid"] for e in events}
    assert lanes == {(0, 200_000): 3, (1, 500_000): 4, (0, 1_000_000): 3}
    by_lane: dict = {}
    for e in events:
        by_lane.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_lane.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_busy_time_excludes_only_waits_inside_each_action():
    spans = [Span("F", 0, 0, 0.0, 2.0), Span("recv_wait", 0, 0, 1.5, 3.0), Span("B", 0, 0, 2.5, 4.0),
             Span("recv_wait", 0, 0, 5.0, 6.0)]
    busy = [(s.kind, b, w) for s, b, w in compute_busy(spans)]
    assert busy == [("F", pytest.approx(1.5), pytest.approx(0.5)), ("B", pytest.approx(1.0), pytest.approx(0.5))]


def test_analysis_with_data_parallel_pipelines_and_bad_input():
    cfg = make_config("1f1b", 2, 1, 2)
    hand = _hand_made(rank1_shift=0.0)
    # Four ranks (pp=2 x dp=2) given as plain lists: rank = pp_rank * dp + dp_rank.
    lists = [[vars(s) for s in hand[0].spans], [vars(s) for s in hand[0].spans],
             [vars(s) for s in hand[1].spans], [vars(s) for s in hand[1].spans]]
    stats = analyze(lists, cfg)
    assert stats.pp_ranks == [0, 0, 1, 1]
    assert stats.rank_bubble == pytest.approx([0.25] * 4)
    assert len(merged_trace(lists, cfg)["otherData"]["ranks"]) == 4
    with pytest.raises(ValueError, match="multiple of pp"):
        analyze(lists[:3], cfg)
    with pytest.raises(ValueError, match="alignment"):
        clock_offsets(hand, "sundial")


def test_trace_and_png_of_hand_made_spans(tmp_path):
    cfg = make_config("1f1b", 2, 1, 2)
    trace = export_trace(_hand_made(), cfg, tmp_path / "trace.json", step=3)
    assert json.loads((tmp_path / "trace.json").read_text()) == json.loads(json.dumps(trace))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        for track in ("planned", "measured"):
            names = Counter(e["name"] for e in events if e["pid"] == rank and e["args"]["track"] == track
                            and e["cat"] in ("forward", "backward"))
            assert names == Counter({"F0.0": 1, "F1.0": 1, "B0.0": 1, "B1.0": 1}), (rank, track)
    measured_b0 = next(e for e in events if e["pid"] == 0 and e["args"]["track"] == "measured" and e["name"] == "B0.0")
    assert measured_b0["ts"] == pytest.approx(2.0e6) and measured_b0["dur"] == pytest.approx(3.0e6)
    assert measured_b0["args"]["busy_ms"] == pytest.approx(2000.0)
    # Rank 1 is moved by its clock offset (2 s): its F0 starts at 2 s on the common axis.
    assert next(e for e in events if e["pid"] == 1 and e["args"]["track"] == "measured")["ts"] == pytest.approx(2.0e6)
    planned_b1 = next(e for e in events if e["pid"] == 0 and e["args"]["track"] == "planned" and e["name"] == "B1.0")
    assert planned_b1["ts"] + planned_b1["dur"] == pytest.approx(9.0e6)  # simulator, measured costs
    assert sum(e["cat"] == "recv_wait" for e in events) == 4 and sum(e["cat"] == "optimizer" for e in events) == 1
    assert [(e["cat"], e["tid"]) for e in events if e["cat"].startswith("a2a")] == [("a2a", 3), ("a2a_wait", 2)]
    assert trace["otherData"]["ideal_bubble_fraction"] == pytest.approx(1 / 3)
    assert trace["otherData"]["step"] == 3

    path = export_png(_hand_made(), cfg, tmp_path / "step.png", step=3)
    width, height = _png_size(path)
    assert width > 600 and height > 150 and path.stat().st_size > 5000


def test_timeline_marks_and_local_gather():
    timeline = Timeline()
    timeline.begin_step()
    with timeline.span("F", 0, 0):
        pass
    timeline.end_step()
    start = timeline.mark()
    timeline.add_between("optimizer", -1, -1, start, timeline.mark())
    assert [s.kind for s in timeline.resolve()] == ["F", "optimizer"]
    assert timeline.origin > 0 and timeline.origin_unix > 1e9
    records = gather_spans(timeline)  # no process group: this process alone
    assert len(records) == 1 and records[0].host and [s.kind for s in records[0].spans] == ["F", "optimizer"]
    off = Timeline(enabled=False)
    assert off.mark() is None
    off.add_between("optimizer", -1, -1, None, None)
    assert off.spans == []


@pytest.mark.cuda
def test_cuda_marks_are_events_resolved_after_the_step():
    timeline = Timeline(device=torch.device("cuda"))
    timeline.begin_step()
    with timeline.span("F", 0, 0, device_side=True):
        torch.cuda._sleep(2_000_000)
    timeline.end_step()
    start = timeline.mark()
    assert isinstance(start, torch.cuda.Event)
    torch.cuda._sleep(2_000_000)
    timeline.add_between("optimizer", -1, -1, start, timeline.mark())
    forward, optimizer = timeline.resolve()
    assert (forward.kind, optimizer.kind) == ("F", "optimizer")
    assert 0 <= forward.start < forward.end <= optimizer.start < optimizer.end


def test_importing_the_callbacks_does_not_import_lightning():
    code = ("import sys, lightning_pp, lightning_pp.callbacks as c; "
            "assert not any(m == 'lightning' or m.startswith('lightning.') for m in sys.modules), 'lightning imported'; "
            "assert c.PipelineMonitor is lightning_pp.PipelineMonitor; "
            "assert 'lightning.pytorch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_monitor_arguments_are_checked():
    from lightning_pp import PipelineMonitor

    with pytest.raises(ValueError, match="every_n_steps"):
        PipelineMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="trace_step"):
        PipelineMonitor(trace_step=-1)
    with pytest.raises(ValueError, match="tokens_per_sample"):
        PipelineMonitor(tokens_per_sample=0)


# -- a 2-process Trainer fit with the callback ---------------------------------------------------
MICROBATCHES = 4
STEPS = 12
TRACE_STEP = STEPS - 1  # the last batch: writing the files does not disturb a later measurement


def _fit_with_monitor(rank, world, log_root):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pp import PipelineMonitor, PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    # Wide enough that one action (~10 ms) dwarfs the per-action Python and p2p overhead.
    model = PipeRegressor(hidden=512, blocks=6)
    monitor = PipelineMonitor(every_n_steps=1, trace_step=TRACE_STEP)
    records_per_step = []

    class KeepRecords(L.Callback):  # after the monitor: what it gathered for this batch
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            records_per_step.append([r.to_dict() for r in monitor.last_records])

    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=STEPS, callbacks=[monitor, KeepRecords()],
        strategy=PipelineStrategy(pipeline_parallel_size=2, num_microbatches=MICROBATCHES),
        logger=CSVLogger(log_root, name="logs", version=0), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
    )
    trainer.fit(model, loader(256, n=256 * STEPS))
    return {
        "history": list(monitor.history),
        "written": [str(p) for p in monitor.written],
        "records": records_per_step,
        "prog_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        "log_dir": trainer.log_dir,
    }


def _mean_costs(records: list[dict]) -> tuple[float, float]:
    """Mean busy time of F and B actions: each action's span minus the receive waits inside it,
    computed here from the raw spans independently of lightning_pp.callbacks.analysis."""
    costs = {"F": [], "B": []}
    for record in records:
        spans = record["spans"]
        waits = [(s, e) for kind, _, _, s, e in spans if kind == "recv_wait"]
        for kind, _, _, start, end in spans:
            if kind in costs:
                inside = sum(max(0.0, min(end, we) - max(start, ws)) for ws, we in waits)
                costs[kind].append(end - start - inside)
    return statistics.mean(costs["F"]), statistics.mean(costs["B"])


def _foreign_cores(fn):
    """(fn(), CPU cores that processes other than this one and its children used meanwhile)."""
    def busy():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait

    def own():
        return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                   for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

    try:
        busy0, own0, start = busy(), own(), time.monotonic()
    except OSError:  # no /proc: assume a quiet machine
        return fn(), 0.0
    result = fn()
    return result, max(0.0, (busy() - busy0 - (own() - own0)) / (time.monotonic() - start))


def _bubbles(result) -> tuple[float, float, list, list]:
    """(median logged bubble, median simulator bubble, per-step logged, per-step simulated) over the
    steps after the first (warm-up) one; the simulator is run here with the per-action costs
    measured in each step."""
    cfg = make_config("1f1b", 2, 1, MICROBATCHES)
    with open(os.path.join(result["log_dir"], "metrics.csv")) as f:
        logged = [float(row["pipeline/bubble"]) for row in csv.DictReader(f) if row.get("pipeline/bubble")]
    simulated = []
    for records in result["records"]:
        forward, backward = _mean_costs(records)
        simulated.append(simulate(cfg, CostModel(forward=forward, backward=backward)).bubble_fraction)
    return statistics.median(logged[1:]), statistics.median(simulated[1:]), logged, simulated


@pytest.mark.timeout(240)
def test_monitor_in_a_two_process_fit(tmp_path):
    # Another job on the machine's cores stretches random actions and so the bubble: such a run
    # is repeated once, and if the machine stayed busy the comparison with the simulator is skipped
    # (every other check still runs).
    for attempt in range(2):
        log_root = tmp_path / f"attempt{attempt}"
        results, foreign = _foreign_cores(lambda root=log_root: run_distributed(_fit_with_monitor, 2, str(root), timeout=100))
        measured, ideal, logged, simulated = _bubbles(results[0])
        if abs(measured - ideal) <= 0.3 * ideal:
            break
    zero, one = results

    # Every rank analysed the same gathered data: identical values, also in the progress bar.
    assert [h["step"] for h in zero["history"]] == list(range(STEPS))
    assert zero["history"] == one["history"]
    assert zero["prog_bar"]["pp_bubble"] == pytest.approx(zero["history"][-1]["pipeline/bubble"], rel=1e-6)
    assert one["prog_bar"]["pp_bubble"] == zero["prog_bar"]["pp_bubble"]
    assert zero["prog_bar"]["pp_ideal"] == pytest.approx(zero["history"][-1]["pipeline/ideal_bubble"], rel=1e-6)

    # The loggers got the metrics of every step (rank 0's CSV logger).
    with open(os.path.join(zero["log_dir"], "metrics.csv")) as f:
        rows = [row for row in csv.DictReader(f) if row.get("pipeline/bubble")]
    assert len(rows) == STEPS
    for row, history in zip(rows, zero["history"]):
        assert float(row["pipeline/bubble"]) == pytest.approx(history["pipeline/bubble"])
        assert 0.0 <= float(row["pipeline/bubble"]) < 1.0
        assert float(row["pipeline/samples_per_s"]) > 0
        assert float(row["pipeline/forward_ms"]) > 0 and float(row["pipeline/backward_ms"]) > 0
        assert float(row["pipeline/optimizer_ms"]) > 0
        for rank in (0, 1):
            assert 0.0 <= float(row[f"pipeline/bubble_rank{rank}"]) < 1.0

    # The trace of the chosen step: valid JSON, both ranks, every action of the step on both the
    # planned and the measured track, and the waits and optimizer step the runtime recorded.
    trace_path = os.path.join(zero["log_dir"], f"pipeline_trace_step{TRACE_STEP}.json")
    png_path = os.path.join(zero["log_dir"], f"pipeline_timeline_step{TRACE_STEP}.png")
    assert sorted(zero["written"]) == sorted([trace_path, png_path]) and one["written"] == []
    with open(trace_path) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    expected = Counter({f"{kind}{mb}.0": 1 for kind in "FB" for mb in range(MICROBATCHES)})
    for rank in (0, 1):
        for track in ("planned", "measured"):
            names = Counter(e["name"] for e in events if e["pid"] == rank and e["args"]["track"] == track
                            and e["cat"] in ("forward", "backward"))
            assert names == expected, (rank, track, names)
        mine = [e for e in events if e["pid"] == rank]
        assert all(e["dur"] >= 0 for e in mine)
        assert sum(e["cat"] == "optimizer" for e in mine) == 1
        # Every message into this rank was waited for: F inputs on rank 1, B gradients on rank 0.
        waited = {e["args"]["microbatch"] for e in mine if e["cat"] == "recv_wait"}
        assert waited == set(range(MICROBATCHES))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"planned (simulator, measured costs)", "measured"} <= names
    last = zero["history"][-1]
    assert trace["otherData"]["bubble_fraction"] == pytest.approx(last["pipeline/bubble"])
    assert trace["otherData"]["step"] == TRACE_STEP and trace["otherData"]["alignment"] == "monotonic"
    # Ranks are on one time axis: rank 1's first receive cannot end before rank 0's first forward,
    # which sends it, has even begun.
    f0 = next(e for e in events if e["pid"] == 0 and e["args"]["track"] == "measured" and e["name"] == "F0.0")
    first_recv_end = min(e["ts"] + e["dur"] for e in events if e["pid"] == 1 and e["cat"] == "recv_wait")
    assert first_recv_end >= f0["ts"]

    width, height = _png_size(png_path)
    assert width > 600 and height > 200 and os.path.getsize(png_path) > 10_000

    # Logged bubble vs the simulator's for the measured per-action costs (medians over steps).
    detail = (f"measured bubble {measured:.3f} vs simulator {ideal:.3f} (per step: logged {logged}, "
              f"simulated {simulated}; other processes used {foreign:.2f} cores)")
    if abs(measured - ideal) > 0.3 * ideal and foreign > 0.3:
        pytest.skip(f"machine busy in both attempts, bubble comparison not meaningful: {detail}")
    assert abs(measured - ideal) <= 0.3 * ideal, detail


# -- Fabric: the same through a plain function ---------------------------------------------------
def _fabric_capture(rank, world, out_dir, schedule="1f1b", vp=1):
    import lightning as L

    import lightning_pp
    from lightning_pp.callbacks import capture_step

    os.environ["LOCAL_RANK"] = str(rank)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=lightning_pp.FabricPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, schedule=schedule, virtual_pipeline_size=vp))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(PipeRegressor())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-2))
    from lightning_pp.runtime import executor_of

    executor = executor_of(model)
    summaries = []
    for step, batch in enumerate(loader(16, n=48)):
        opt.zero_grad()
        fabric.strategy.pipeline_step(model, batch)
        with executor.timeline.span("optimizer"):
            opt.step()
        stats = capture_step(executor, out_dir if step == 2 else None, step=step)
        summaries.append((stats.bubble_fraction, stats.summary(), dict(stats.counts)))
    return summaries


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule,vp,counts", [
    ("1f1b", 1, {"F": 8, "B": 8}),
    ("zbv", 2, {"F": 16, "B": 16, "W": 16}),  # two chunks per rank in a V, backward split into B and W
])
def test_capture_step_from_fabric(tmp_path, schedule, vp, counts):
    results = run_distributed(_fabric_capture, 2, str(tmp_path), schedule, vp, timeout=100)
    assert results[0] == results[1]
    assert all(c == counts for _, _, c in results[0])
    with open(tmp_path / "pipeline_trace_step2.json") as f:
        trace = json.load(f)
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert sum(e.get("cat") == "optimizer" for e in trace["traceEvents"]) == 2
    assert _png_size(tmp_path / "pipeline_timeline_step2.png")[0] > 600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline_timeline_step2.png", "pipeline_trace_step2.json"]
