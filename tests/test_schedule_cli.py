"""``python -m lightning_pp.schedules`` and the renderers behind it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pp.schedules import (
    CostModel,
    ascii_timeline,
    chrome_trace,
    make_config,
    plot_timeline,
    simulate,
    stats_table,
)
from lightning_pp.schedules.__main__ import main

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "lightning_pp.schedules", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
    )


def rank_rows(text: str, pp: int) -> dict:
    return {rank: [line for line in text.splitlines() if line.startswith(f"rank {rank} |")] for rank in range(pp)}


# --------------------------------------------------------------------------------------------
# CLI
#
# Each subprocess pays the package's import time (the top-level package imports Lightning to
# register the strategies), so only a few cases go through a real process and the rest call
# ``main()`` in-process with the same arguments.


def test_text_output_has_one_row_per_rank_and_stats():
    proc = run_cli("--pp", "4", "--vp", "2", "--microbatches", "8", "--schedule", "interleaved", "--width", "400")
    assert proc.returncode == 0, proc.stderr
    rows = rank_rows(proc.stdout, 4)
    assert all(len(lines) == 1 for lines in rows.values()), rows
    assert "F0.0" in rows[0][0] and "B7.0" in rows[0][0]
    assert "bubble fraction: 15.79%" in proc.stdout
    assert "peak in-flight" in proc.stdout


def test_text_output_wraps_with_every_rank_in_every_block(capsys):
    assert main(["--pp", "4", "--vp", "2", "--microbatches", "8", "--schedule", "interleaved"]) == 0
    out = capsys.readouterr().out
    rows = rank_rows(out, 4)
    assert len({len(lines) for lines in rows.values()}) == 1 and len(rows[0]) >= 1
    assert max(len(line) for line in out.splitlines() if line.startswith("rank")) <= 100


def test_json_output_schema_and_trace(tmp_path):
    trace_path = tmp_path / "trace.json"
    proc = run_cli(
        "--pp", "2", "--vp", "2", "--microbatches", "4", "--schedule", "combined_1f1b", "--format", "json",
        "--trace", str(trace_path),
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) == {"schedule", "pp", "vp", "microbatches", "ranks", "stats"}
    assert (data["schedule"], data["pp"], data["vp"], data["microbatches"]) == ("combined_1f1b", 2, 2, 4)
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    kinds = set()
    for rank in data["ranks"]:
        for action in rank["actions"]:
            kinds.add(action["kind"])
            assert action["kind"] in ("F", "B", "FB")
            assert isinstance(action["microbatch"], int) and isinstance(action["chunk"], int)
            assert action["end"] >= action["start"]
            if action["kind"] == "FB":
                assert {"f_microbatch", "f_chunk", "b_microbatch", "b_chunk"} <= set(action)
    assert kinds == {"F", "B", "FB"}
    stats = data["stats"]
    assert set(stats) == {"bubble_fraction", "makespan", "peak_inflight"}
    assert isinstance(stats["bubble_fraction"], float)
    assert len(stats["peak_inflight"]) == 2 and all(isinstance(p, int) for p in stats["peak_inflight"])

    # --trace: valid JSON with complete events on every rank, one per action
    trace = json.loads(trace_path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1}
    assert len(complete) == sum(len(r["actions"]) for r in data["ranks"])
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in complete)


def test_json_defaults_and_cost_flags(capsys):
    argv = ["--pp", "3", "--format", "json", "--forward", "2", "--backward", "4", "--dp", "4", "--grad-bytes", "10",
            "--dp-latency", "1"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["schedule"], data["vp"], data["microbatches"]) == ("1f1b", 1, 6)
    # (m + p - 1) * (f + b) + ring/tree all-reduce over 4 replicas of latency 1: min(2*3, 2*2) = 4
    assert data["stats"]["makespan"] == pytest.approx(8 * 6 + 4)
    assert data["stats"]["peak_inflight"] == [3, 2, 1]


def test_stage_costs_flag(capsys):
    # pp=2, m=2, 1F1B, stage 0: F=1 B=2, stage 1: F=3 B=5: the makespan placed by hand in
    # test_simulator.test_per_stage_costs_two_stages_by_hand is 19 (uniform F=1 B=2: (m+p-1)*3 = 9).
    assert main(["--pp", "2", "--microbatches", "2", "--format", "json", "--stage-costs", "1,2; 3,5"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["makespan"] == pytest.approx(19)
    uneven = "1,0.1,1.9;1,1,1;1,1,1;1.3,1.2,1"  # zbv: 4 virtual stages, W split
    assert main(["--pp", "2", "--schedule", "zbv", "--microbatches", "4", "--stage-costs", uneven]) == 0
    assert "bubble" in capsys.readouterr().out


def test_invalid_input_exits_2_with_message_and_no_traceback():
    proc = run_cli("--pp", "4", "--vp", "1", "--schedule", "interleaved")
    assert proc.returncode == 2
    assert "virtual_pipeline_size=1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pp", "4", "--vp", "2", "--schedule", "interleaved", "--microbatches", "6"], "num_microbatches=6"),
        (["--pp", "0"], "pipeline_parallel_size (pp)=0"),
        (["--pp", "2", "--schedule", "nope"], "schedule='nope'"),
        (["--pp", "2", "--forward", "-1"], "forward=-1.0"),
        (["--pp", "2", "--dp", "0"], "dp_size=0"),
        (["--pp", "2", "--stage-costs", "1,2"], "CostModel.stages has 1 entries but the table has 2 virtual stages"),
        (["--pp", "2", "--stage-costs", "1,2;1"], "--stage-costs='1,2;1' is invalid at stage 1 ('1')"),
        (["--pp", "2", "--stage-costs", "1,2;1,x"], "each virtual stage takes 'forward,backward'"),
        (["--pp", "2", "--stage-costs", "1,2;1,-2"], "stages[1].backward=-2.0"),
    ],
)
def test_invalid_input_returns_2_with_message(args, message, capsys):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    proc = run_cli("--pp", "2", "--vp", "2", "--microbatches", "4", "--schedule", "combined_1f1b", "--plot", str(path))
    assert proc.returncode == 0, proc.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# Renderers (in-process)


def test_ascii_timeline_small_1f1b_fits_and_labels_actions():
    result = simulate(make_config("1f1b", 2, 1, 3))
    text = ascii_timeline(result, 2)
    rows = rank_rows(text, 2)
    assert rows[0][0].startswith("rank 0 |F0 F1 .")
    assert "B2" in rows[1][0]
    assert all(len(line) <= 100 for line in text.splitlines())


def test_ascii_timeline_scales_large_configs():
    result = simulate(make_config("interleaved", 8, 4, 64))
    text = ascii_timeline(result, 8, width=100)
    assert all(len(line) <= 100 for line in text.splitlines() if line.startswith("rank"))
    assert all(len(lines) == 1 for lines in rank_rows(text, 8).values())
    assert "scaled" in text


def test_ascii_timeline_shows_combined_and_allreduce():
    costs = CostModel(a2a_forward=1, a2a_backward=1, dp_size=2, grad_bytes=1, dp_latency=2)
    text = ascii_timeline(simulate(make_config("combined_1f1b", 1, 1, 3), costs), 1)
    assert "F1+B0" in text and "AR" in text


def test_stats_table_lists_every_rank():
    result = simulate(make_config("1f1b", 4, 1, 8))
    table = stats_table(result)
    lines = table.splitlines()
    assert "bubble fraction: 27.27%" in table
    assert "makespan: 33" in table
    assert any(line.split()[:1] == ["3"] and line.split()[3] == "1" for line in lines)


def test_chrome_trace_units_and_args():
    cfg = make_config("combined_1f1b", 2, 2, 4)
    result = simulate(cfg)
    trace = chrome_trace(result, cfg)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    first = min(complete, key=lambda e: (e["pid"], e["ts"]))
    assert first["ts"] == 0 and first["dur"] == 1000  # 1 cost unit = 1000 us
    fb = next(e for e in complete if e["cat"] == "forward_backward")
    assert {"f_microbatch", "f_chunk", "b_microbatch", "b_chunk"} <= set(fb["args"])
    json.dumps(trace)


def test_plot_timeline_in_process(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = make_config("interleaved", 2, 2, 4)
    path = tmp_path / "plot.png"
    plot_timeline(simulate(cfg, CostModel(dp_size=2, grad_bytes=1, dp_latency=1)), cfg, path)
    assert path.stat().st_size > 1000
