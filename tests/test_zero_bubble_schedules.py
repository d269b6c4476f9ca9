"""The zero-bubble schedules (zb1p, zbv, dualpipev): complete and valid tables, the published closed
forms, the V placement everywhere, and agreement with torch.distributed.pipelining.

Checks written independently of lightning_pp/schedules/zero_bubble.py: every table is complete
(counted here from the lists), the split-backward rule holds, the simulator finishes (no
deadlock) and respects every data dependency, the makespans are the papers' formulas, and torch's
own validator, send/receive lowering and comm simulator accept our tables; for ZB-V and DualPipeV
(and ZB-H1) the order is torch's, action for action.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

import lightning_pp.schedules as schedules_package
from lightning_pp.schedules import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    SCHEDULES,
    V_SCHEDULES,
    WEIGHT_GRAD,
    Action,
    CostModel,
    all_rank_actions,
    ascii_timeline,
    chrome_trace,
    check_actions,
    config_for_batch,
    make_config,
    rank_actions,
    simulate,
    split_backwards,
    stats_table,
)
from lightning_pp.schedules.__main__ import main
from lightning_pp.schedules.actions import backward, forward, forward_backward
from lightning_pp.schedules.messages import action_sends, forward_message

ZERO_BUBBLE = ("zb1p", "zbv", "dualpipev")
UNIFORM = CostModel(forward=1, backward=1, weight_grad=1)


def grid():
    """Valid configurations of the new schedules: pp 1..4, microbatches 1..3 * pp + 1."""
    configs = []
    for pp in range(1, 5):
        for m in range(1, 3 * pp + 2):
            configs.append(make_config("zb1p", pp, 1, m))
            configs.append(make_config("zbv", pp, 2, m))
            if m >= 2 * pp:
                configs.append(make_config("dualpipev", pp, 2, m))
            for vp in (2, 3):
                for group in (None, pp + 1):
                    try:
                        configs.append(make_config("zb1p", pp, vp, m, group))
                    except ValueError:
                        pass
    return configs


GRID = grid()


def held_from_lists(actions) -> list:
    """Peak of (microbatch, chunk)s whose activations are alive: from the forward until the last
    backward action, the W when the backward is split (the rank has a W for it), else the B."""
    peaks = []
    for rank_list in actions:
        split = {(a.microbatch, a.chunk) for a in rank_list if a.kind == WEIGHT_GRAD}
        live, peak = set(), 0
        for action in rank_list:
            f, b = action.forward_part(), action.backward_part()
            if f is not None:
                live.add(f)
                peak = max(peak, len(live))
            if b is not None and b not in split:
                live.discard(b)
            if action.kind == WEIGHT_GRAD:
                live.discard((action.microbatch, action.chunk))
        peaks.append(peak)
    return peaks


# --------------------------------------------------------------------------------------------
# Complete, valid tables


def _cfg_id(c):
    return f"{c.schedule}-pp{c.pp}-vp{c.vp}-m{c.num_microbatches}-g{c.microbatch_group_size}"


@pytest.mark.parametrize("cfg", GRID, ids=_cfg_id)
def test_tables_are_complete_and_follow_the_split_rule(cfg):
    tables = all_rank_actions(cfg)
    check_actions(cfg, tables)  # ids in range, every W after its B, at most one W each
    per_stage = Counter()
    for rank, rank_list in enumerate(tables):
        seen_b, seen_w = {}, {}
        for position, action in enumerate(rank_list):
            f, b = action.forward_part(), action.backward_part()
            if f is not None:
                per_stage["F", f[0], cfg.stage_of(rank, f[1])] += 1
            if b is not None:
                per_stage["B", b[0], cfg.stage_of(rank, b[1])] += 1
                seen_b[b] = position
            if action.kind == WEIGHT_GRAD:
                pair = (action.microbatch, action.chunk)
                per_stage["W", pair[0], cfg.stage_of(rank, pair[1])] += 1
                assert seen_b[pair] < position, (rank, action)
                seen_w[pair] = position
        if cfg.schedule != "dualpipev":
            # ZB-H1 and ZB-V split every backward; DualPipeV fuses full ones into its FB steps.
            assert set(seen_w) == set(seen_b), rank
        fb_halves = {a.backward_part() for a in rank_list if a.kind == FORWARD_BACKWARD}
        assert not fb_halves & set(seen_w), "torch's OVERLAP_F_B runs full backwards"
    for stage in range(cfg.num_stages):
        for mb in range(cfg.num_microbatches):
            assert per_stage["F", mb, stage] == 1 and per_stage["B", mb, stage] == 1, (mb, stage)
            assert per_stage["W", mb, stage] <= 1


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_simulation_finishes_and_respects_every_dependency(schedule):
    for cfg in (c for c in GRID if c.schedule == schedule):
        result = simulate(cfg, CostModel(forward=1, backward=2, weight_grad=1, p2p_latency=0.25))
        hop = 0.25
        f_span, b_span, w_span = {}, {}, {}
        for rank, action, start, end in result.events:
            f, b = action.forward_part(), action.backward_part()
            if f is not None:
                f_span[f[0], cfg.stage_of(rank, f[1])] = (rank, start, end)
            if b is not None:
                b_span[b[0], cfg.stage_of(rank, b[1])] = (rank, start, end)
            if action.kind == WEIGHT_GRAD:
                w_span[action.microbatch, cfg.stage_of(rank, action.chunk)] = (rank, start, end)
        assert len(f_span) == len(b_span) == cfg.num_stages * cfg.num_microbatches
        for (mb, stage), (rank, start, _) in f_span.items():
            if stage:
                before_rank, _, before_end = f_span[mb, stage - 1]
                assert start >= before_end + (hop if before_rank != rank else 0) - 1e-9
        for (mb, stage), (rank, start, _) in b_span.items():
            assert start >= f_span[mb, stage][2] - 1e-9
            if stage < cfg.num_stages - 1:
                after_rank, _, after_end = b_span[mb, stage + 1]
                assert start >= after_end + (hop if after_rank != rank else 0) - 1e-9
        for key, (rank, start, _) in w_span.items():
            assert rank == b_span[key][0] and start >= b_span[key][2]


def test_forward_only_runs_every_forward_once_without_deadlock():
    for cfg in GRID[::3]:
        evaluation = all_rank_actions(cfg, forward_only=True)
        assert all(a.kind == FORWARD for rank_list in evaluation for a in rank_list)
        assert sum(map(len, evaluation)) == cfg.num_stages * cfg.num_microbatches
        simulate(cfg, actions=evaluation)


# --------------------------------------------------------------------------------------------
# Closed forms


# ZB-H1 (Qi et al., ICLR 2024, section 3.1): with T_W <= T_F and T_W <= T_B (the paper's
# setting), 1F1B's bubble is (p - 1)(T_F + T_B + T_W) and ZB-H1's is (p - 1)(T_F + T_B - T_W);
# every rank does m (T_F + T_B + T_W) of work, so the makespan is that plus the bubble. The
# interleaved variant has the same bubble in per-chunk units over vp times the work.
@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (2, 3, 1), (3, 2, 2), (1, 2, 0)])
@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_zb1p_has_the_papers_bubble(f, b, w, pp):
    costs = CostModel(forward=f, backward=b, weight_grad=w)
    for m in range(pp, 3 * pp + 2):
        zb = simulate(make_config("zb1p", pp, 1, m), costs)
        assert zb.pipeline_makespan == pytest.approx(m * (f + b + w) + (pp - 1) * (f + b - w))
        one_f_one_b = simulate(make_config("1f1b", pp, 1, m), costs)
        assert one_f_one_b.pipeline_makespan == pytest.approx((m + pp - 1) * (f + b + w))
        for vp in (2, 3):
            if m % pp == 0:
                interleaved = simulate(make_config("zb1p", pp, vp, m), costs)
                assert interleaved.pipeline_makespan == pytest.approx(vp * m * (f + b + w) + (pp - 1) * (f + b - w))


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_zb1p_holds_no_more_than_1f1b(pp):
    for m in range(1, 3 * pp + 1):
        zb = simulate(make_config("zb1p", pp, 1, m), UNIFORM)
        base = simulate(make_config("1f1b", pp, 1, m), UNIFORM)
        assert zb.peak_inflight == held_from_lists(all_rank_actions(make_config("zb1p", pp, 1, m)))
        # 1F1B's peak is on rank 0 (min(pp, m)); ZB-H1 holds W's back on later ranks up to it.
        assert max(zb.peak_inflight) == max(base.peak_inflight) == min(pp, m)
        assert zb.peak_inflight == [min(pp, m)] * pp


# ZB-V: the last rank cannot start before the first microbatch has crossed pp - 1 forwards, and
# then has 2m (F + B + W) of work; with F = B = W and m >= 2pp - 1 ZB-V reaches that bound (the
# paper's "zero bubble" steady state). Its memory is 2pp chunk activations (half a model each):
# 1F1B's pp microbatches.
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_zbv_reaches_the_last_rank_bound_and_1f1b_memory(pp):
    for unit in (1, 2):
        costs = CostModel(forward=unit, backward=unit, weight_grad=unit)
        for m in range(2 * pp - 1, 3 * pp + 2):
            cfg = make_config("zbv", pp, 2, m)
            result = simulate(cfg, costs)
            assert result.pipeline_makespan == pytest.approx((pp - 1) * unit + 2 * m * 3 * unit)
            assert result.peak_inflight == held_from_lists(all_rank_actions(cfg)) == [2 * pp] * pp


# DualPipe's README (deepseek-ai/DualPipe) gives DualPipeV's bubble as (S/2 - 1)(F&B + B - 3W)
# for S stages (S/2 = pp ranks), B the full backward and F&B one fused step; it assumes balanced
# chunks (F = B here, W <= F). Without all-to-all an FB lasts F + B + W.
@pytest.mark.parametrize("f, w", [(1, 0), (1, 1), (2, 1), (3, 3)])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_dualpipev_has_the_dualpipe_readme_bubble(f, w, pp):
    b = f
    costs = CostModel(forward=f, backward=b, weight_grad=w)
    fused, full_backward = f + b + w, b + w
    for m in range(2 * pp, 4 * pp + 1):
        cfg = make_config("dualpipev", pp, 2, m)
        result = simulate(cfg, costs)
        expected = 2 * m * (f + b + w) + (pp - 1) * (fused + full_backward - 3 * w)
        assert result.pipeline_makespan == pytest.approx(expected)
        # The forward half of an FB allocates before the backward half frees: one chunk more
        # than ZB-V's 2pp.
        assert result.peak_inflight == held_from_lists(all_rank_actions(cfg)) == [2 * pp + 1] * pp


def test_dualpipev_hides_all_to_all_in_its_fused_steps():
    costs = CostModel(forward=1, backward=1, weight_grad=1, a2a_forward=0.5, a2a_backward=0.5)
    pp, m = 4, 16
    dual = simulate(make_config("dualpipev", pp, 2, m), costs)
    zbv = simulate(make_config("zbv", pp, 2, m), costs)
    for rank, rank_list in enumerate(all_rank_actions(make_config("dualpipev", pp, 2, m))):
        # a2a (1) < compute (3) inside an FB: only the plain F's and B's expose theirs.
        kinds = Counter(a.kind for a in rank_list)
        assert dual.exposed_a2a[rank] == pytest.approx(0.5 * (kinds[FORWARD] + kinds[BACKWARD]))
    assert sum(dual.exposed_a2a) < sum(zbv.exposed_a2a)
    assert dual.pipeline_makespan < zbv.pipeline_makespan


# --------------------------------------------------------------------------------------------
# The simulator's pricing of split backwards and the V placement


def test_split_and_full_backwards_are_priced_per_action():
    cfg = make_config("1f1b", 1, 1, 2)
    costs = CostModel(forward=1, backward=2, weight_grad=3)
    # Microbatch 0 split (B = 2, W = 3), microbatch 1 full (B = 2 + 3).
    table = [[forward(0, 0), backward(0, 0), forward(1, 0), backward(1, 0), Action(WEIGHT_GRAD, 0, 0)]]
    result = simulate(cfg, costs, actions=table)
    assert [end - start for _, _, start, end in result.events] == [1, 2, 1, 5, 3]
    assert split_backwards(table[0]) == {(0, 0)}
    # Held until W: microbatch 0 is alive through microbatch 1.
    assert result.peak_inflight == [2]


def test_fb_with_a_split_backward_half_keeps_the_activation():
    cfg = make_config("combined_1f1b", 1, 1, 2)
    costs = CostModel(forward=1, backward=2, weight_grad=3)
    table = [[forward(0, 0), forward_backward((1, 0), (0, 0)), Action(WEIGHT_GRAD, 0, 0), backward(1, 0)]]
    result = simulate(cfg, costs, actions=table)
    assert [end - start for _, _, start, end in result.events] == [1, 1 + 2, 3, 2 + 3]
    assert result.peak_inflight == [2]


@pytest.mark.parametrize(
    "table, message",
    [
        ([[forward(0, 0), Action(WEIGHT_GRAD, 0, 0), backward(0, 0)]], "no B for microbatch 0, chunk 0 before it"),
        ([[forward(0, 0), backward(0, 0), Action(WEIGHT_GRAD, 0, 0), Action(WEIGHT_GRAD, 0, 0)]], "a second W"),
        ([[forward(0, 0), backward(0, 0), Action(WEIGHT_GRAD, 1, 0)]], "no B for microbatch 1"),
    ],
)
def test_hand_made_tables_must_follow_the_split_rule(table, message):
    with pytest.raises(ValueError, match=message):
        simulate(make_config("1f1b", 1, 1, 2), actions=table)


def test_v_turn_is_a_free_local_hand_off():
    pp, hop = 3, 10.0
    cfg = make_config("zbv", pp, 2, 1)
    result = simulate(cfg, CostModel(p2p_latency=hop, forward=1, backward=1, weight_grad=1))
    free = simulate(cfg, UNIFORM)
    spans = {(rank, a.describe()): (start, end) for rank, a, start, end in result.events}
    # Stage pp - 1 (chunk 0) and stage pp (chunk 1) are both on the last rank.
    assert cfg.stage_of(pp - 1, 0) == pp - 1 and cfg.stage_of(pp - 1, 1) == pp
    assert spans[pp - 1, "F0.1"][0] == spans[pp - 1, "F0.0"][1]
    # One microbatch: its forward and backward chains are the critical path, and of their
    # 2pp - 1 boundaries each the turn is local: 2 (pp - 1) transfers each way.
    assert result.pipeline_makespan == pytest.approx(free.pipeline_makespan + 4 * (pp - 1) * hop)
    dst, message = forward_message(cfg, pp - 1, 0, 0)
    assert dst == pp - 1 and message.stage == pp
    # Rank 0 holds the first and the last stage; the loss is on rank 0.
    assert cfg.owner_of(0) == (0, 0) and cfg.owner_of(2 * pp - 1) == (0, 1) and cfg.last_stage_rank == 0


def test_deadlock_message_names_v_stages():
    cfg = make_config("zbv", 2, 2, 1)
    # Rank 1 backwards chunk 1 (stage 2) before its forward arrives from chunk 0 ... of rank 1.
    table = [[forward(0, 0), forward(0, 1), backward(0, 1), backward(0, 0)],
             [forward(0, 1), forward(0, 0), backward(0, 1), backward(0, 0)]]
    with pytest.raises(RuntimeError, match=r"forward output of microbatch 0 at stage 1 \(rank 1, chunk 0\)"):
        simulate(cfg, actions=table)


# --------------------------------------------------------------------------------------------
# Validation and short batches


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(schedule="zbv", pp=4, vp=1, num_microbatches=8), "virtual_pipeline_size=1"),
        (dict(schedule="dualpipev", pp=4, vp=3, num_microbatches=8), "virtual_pipeline_size=3"),
        (dict(schedule="dualpipev", pp=4, vp=2, num_microbatches=7), "num_microbatches=7"),
        (dict(schedule="zbv", pp=2, vp=2, num_microbatches=4, microbatch_group_size=2), "microbatch_group_size=2"),
        (dict(schedule="zb1p", pp=4, vp=2, num_microbatches=6), "num_microbatches=6"),
        (dict(schedule="zb1p", pp=2, vp=1, num_microbatches=4, microbatch_group_size=2), "microbatch_group_size=2"),
    ],
)
def test_invalid_configs_name_parameter_value_and_fix(kwargs, expected):
    with pytest.raises(ValueError) as info:
        make_config(**kwargs)
    message = str(info.value)
    assert expected in message and ("Use " in message or "Leave it unset" in message)


def test_accepted_ranges():
    for pp in range(1, 6):
        for m in range(1, 2 * pp + 2):
            make_config("zb1p", pp, 1, m)
            make_config("zbv", pp, 2, m)
            if m >= 2 * pp:
                make_config("dualpipev", pp, 2, m)
    assert set(ZERO_BUBBLE) <= set(SCHEDULES) and set(V_SCHEDULES) == {"zbv", "dualpipev"}
    assert make_config("zbv", 2, 2, 4).placement == "v" and make_config("zb1p", 2, 2, 4).placement == "loop"


@pytest.mark.parametrize(
    "schedule, vp, microbatches",
    [("zb1p", 1, 8), ("zb1p", 2, 9), ("zbv", 2, 8), ("dualpipev", 2, 12)],
)
def test_short_batches_keep_the_placement_and_run(schedule, vp, microbatches):
    cfg = make_config(schedule, 3, vp, microbatches)
    for batch in range(1, microbatches + 2):
        short = config_for_batch(cfg, batch)
        assert short.placement == cfg.placement and short.vp == cfg.vp
        assert short.num_microbatches <= min(batch, microbatches)
        if cfg.schedule != "zb1p" or cfg.vp == 1 or short.schedule == "gpipe":  # no grouping rule
            assert short.num_microbatches == min(batch, microbatches)
        simulate(short)
        if short.schedule != cfg.schedule:
            assert batch < microbatches
    assert config_for_batch(make_config("dualpipev", 3, 2, 12), 7).schedule == "dualpipev"
    assert config_for_batch(make_config("dualpipev", 3, 2, 12), 5).schedule == "zbv"


# --------------------------------------------------------------------------------------------
# CLI and renderers


def test_cli_prints_the_new_schedules(capsys):
    assert main(["--pp", "3", "--schedule", "zbv", "--microbatches", "6", "--width", "400"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("schedule=zbv pp=3 vp=2 microbatches=6 placement=v")
    assert "W0.1" in out and "B5.0" in out
    # Defaults for split schedules: backward 1 + weight grad 1; ZB-V reaches its bound 2 + 6m.
    assert "makespan: 38" in out
    assert main(["--pp", "2", "--schedule", "dualpipev", "--microbatches", "4", "--width", "400"]) == 0
    assert "+B" in capsys.readouterr().out
    assert main(["--pp", "2", "--schedule", "zb1p", "--format", "json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert {a["kind"] for r in data["ranks"] for a in r["actions"]} == {"F", "B", "W"}


def test_json_and_trace_use_v_stages(capsys):
    assert main(["--pp", "2", "--schedule", "dualpipev", "--microbatches", "4", "--format", "json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    rank0 = data["ranks"][0]["actions"]
    assert {a["stage"] for a in rank0 if a["chunk"] == 1} == {3}
    fb = next(a for a in rank0 if a["kind"] == "FB")
    assert (fb["stage"], fb["b_stage"]) == ((0, 3) if fb["f_chunk"] == 0 else (3, 0))
    cfg = make_config("zbv", 2, 2, 4)
    trace = chrome_trace(simulate(cfg, UNIFORM), cfg)
    stages = {(e["pid"], e["args"]["chunk"]): e["args"]["stage"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert stages == {(0, 0): 0, (0, 1): 3, (1, 0): 1, (1, 1): 2}
    assert trace["otherData"]["placement"] == "v"
    assert {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {"weight_grad"}


def test_ascii_stats_and_plot_show_w(tmp_path):
    cfg = make_config("zb1p", 4, 1, 8)
    result = simulate(cfg, UNIFORM)
    text = ascii_timeline(result, 4, width=300)
    assert "W0" in text and "W7" in text
    assert "bubble fraction" in stats_table(result)
    big = simulate(make_config("zbv", 8, 2, 64), UNIFORM)
    scaled = ascii_timeline(big, 8, width=100)
    assert "scaled" in scaled and any("W" in line for line in scaled.splitlines() if line.startswith("rank"))
    pytest.importorskip("matplotlib")
    from lightning_pp.schedules import plot_timeline

    path = tmp_path / "zbv.png"
    plot_timeline(simulate(make_config("zbv", 2, 2, 4), UNIFORM), make_config("zbv", 2, 2, 4), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# Against torch.distributed.pipelining (import only here; skip if its private API moved)


@pytest.fixture(scope="module")
def torch_schedules():
    module = pytest.importorskip("torch.distributed.pipelining.schedules")
    needed = ("_Action", "_validate_schedule", "_add_send_recv", "_simulate_comms_compute", "OVERLAP_F_B",
              "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleInterleavedZeroBubble")
    missing = [name for name in needed if not hasattr(module, name)]
    if missing:
        pytest.skip(f"torch.distributed.pipelining.schedules lacks {missing}")
    return module


def to_torch(S, cfg, tables) -> dict:
    """Our tables in torch's IR: F -> FORWARD, a split B -> BACKWARD_INPUT, a full B ->
    FULL_BACKWARD, W -> BACKWARD_WEIGHT, FB -> OVERLAP_F_B of (FORWARD, its backward)."""
    out = {}
    for rank, rank_list in enumerate(tables):
        split = split_backwards(rank_list)

        def backward_kind(pair, split=split):
            return S.BACKWARD_INPUT if pair in split else S.FULL_BACKWARD

        row = []
        for a in rank_list:
            if a.kind == FORWARD:
                row.append(S._Action(cfg.stage_of(rank, a.chunk), S.FORWARD, a.microbatch))
            elif a.kind == BACKWARD:
                row.append(S._Action(cfg.stage_of(rank, a.chunk), backward_kind((a.microbatch, a.chunk)), a.microbatch))
            elif a.kind == WEIGHT_GRAD:
                row.append(S._Action(cfg.stage_of(rank, a.chunk), S.BACKWARD_WEIGHT, a.microbatch))
            else:
                halves = (S._Action(cfg.stage_of(rank, a.chunk), S.FORWARD, a.microbatch),
                          S._Action(cfg.stage_of(rank, a.b_chunk), backward_kind(a.backward_part()), a.b_microbatch))
                row.append(S._Action(-1, S.OVERLAP_F_B, None, halves))
        out[rank] = row
    return out


TORCH_CHECKED = [c for c in GRID if c.pp >= 2 and c.num_microbatches % 2 == 0] + [
    make_config("1f1b", 3, 1, 5), make_config("interleaved", 2, 2, 4), make_config("combined_1f1b", 3, 2, 6),
]


def test_torch_validates_lowers_and_simulates_our_tables(torch_schedules):
    S = torch_schedules
    for cfg in TORCH_CHECKED:
        compute = to_torch(S, cfg, all_rank_actions(cfg))
        stage_to_rank = S._validate_schedule(compute, cfg.pp, cfg.num_stages, cfg.num_microbatches)
        assert stage_to_rank == {s: cfg.owner_of(s)[0] for s in range(cfg.num_stages)}
        lowered = S._add_send_recv({r: list(row) for r, row in compute.items()}, stage_to_rank.__getitem__,
                                   cfg.num_stages)
        for rank in range(cfg.pp):
            # Our messages (remote only) are torch's sends, in the same order.
            ours = [(m.direction, m.microbatch, m.stage) for a in all_rank_actions(cfg)[rank]
                    for dst, m in action_sends(cfg, rank, a) if dst != rank]
            theirs = [("F", a.microbatch_index, a.stage_index + 1) if a.computation_type == S.SEND_F
                      else ("B", a.microbatch_index, a.stage_index - 1)
                      for a in lowered[rank] if a.computation_type in (S.SEND_F, S.SEND_B)]
            assert ours == theirs, (cfg, rank)
        # torch's comm simulator runs OVERLAP_F_B's parts in sequence, as its runtime does.
        flat = {r: [part for a in row for part in (a.sub_actions or (a,))] for r, row in lowered.items()}
        S._simulate_comms_compute(flat, stage_to_rank.__getitem__, cfg.num_stages)


def torch_order(S, cfg) -> dict:
    """torch's per-rank compute order for ``cfg``, built without a process group: the schedule
    object with just the attributes its ``_calculate_single_rank_operations`` reads."""
    pp, m = cfg.pp, cfg.num_microbatches
    cls = {"zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV,
           "zb1p": S.ScheduleInterleavedZeroBubble}[cfg.schedule]
    schedule = object.__new__(cls)
    schedule.pp_group_size, schedule._n_microbatches = pp, m
    schedule.n_local_stages, schedule.num_stages, schedule._num_stages = cfg.vp, cfg.num_stages, cfg.num_stages
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    try:
        rows = {rank: schedule._calculate_single_rank_operations(rank) for rank in range(pp)}
    except AttributeError as err:  # a private attribute was renamed
        pytest.skip(f"torch's {cls.__name__} changed: {err}")
    return {rank: [a for a in row if a is not None] for rank, row in rows.items()}


def test_orders_equal_torchs(torch_schedules):
    """ZB-V and DualPipeV: torch's order on every configuration (no deliberate difference).
    ZB-H1: torch's InterleavedZeroBubble order wherever our group size is its
    microbatches_per_round (m // max(1, m // pp)); with vp == 1 the group plays no part."""
    S = torch_schedules
    compared = Counter()
    for pp in range(1, 6):
        for m in range(1, 3 * pp + 2):
            configs = [make_config("zbv", pp, 2, m), make_config("zb1p", pp, 1, m)]
            if m >= 2 * pp:
                configs.append(make_config("dualpipev", pp, 2, m))
            rounds = max(1, m // pp)
            if m % rounds == 0:  # torch's own rule for interleaved zero bubble
                for vp in (2, 3):
                    try:
                        configs.append(make_config("zb1p", pp, vp, m, m // rounds))
                    except ValueError:
                        pass
            for cfg in configs:
                assert to_torch(S, cfg, all_rank_actions(cfg)) == torch_order(S, cfg), cfg
                compared[cfg.schedule, cfg.vp > 1] += 1
    assert min(compared.values()) >= 10 and len(compared) == 4


# --------------------------------------------------------------------------------------------
# Code size rules of the schedules package (issue 14)


def test_schedules_package_size_rules():
    for path in Path(schedules_package.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 400, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, (path.name, node.name)


def test_zero_bubble_tables_are_fast():
    import time

    started = time.perf_counter()
    for schedule in ZERO_BUBBLE:
        cfg = make_config(schedule, 16, 2, 256)
        result = simulate(cfg)
        assert len(result.events) == sum(len(rank_actions(cfg, r)) for r in range(cfg.pp))
    assert time.perf_counter() - started < 10
