"""The schedule simulator: closed forms, communication costs, DP all-reduce, deadlock detection."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_pp.schedules import (
    CostModel,
    SimulationResult,
    StageCost,
    all_rank_actions,
    allreduce_time,
    make_config,
    simulate,
    warmup_count,
)
from lightning_pp.schedules.actions import backward, forward, forward_backward, Action, WEIGHT_GRAD

PROPERTY_SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)

unit_costs = st.tuples(st.integers(1, 5), st.integers(1, 5)).map(lambda fb: CostModel(forward=fb[0], backward=fb[1]))


def inflight_from_lists(actions) -> list:
    """Peak of (microbatch, chunk) forwarded but not yet backwarded, counted straight from the list."""
    peaks = []
    for rank_actions in actions:
        live = set()
        peak = 0
        for action in rank_actions:
            f, b = action.forward_part(), action.backward_part()
            if f is not None:
                live.add(f)
                peak = max(peak, len(live))
            if b is not None:
                live.discard(b)
        peaks.append(peak)
    return peaks


# --------------------------------------------------------------------------------------------
# Closed forms


@PROPERTY_SETTINGS
@given(pp=st.integers(1, 8), microbatches=st.integers(1, 64), costs=unit_costs)
def test_1f1b_bubble_and_memory_closed_forms(pp, microbatches, costs):
    cfg = make_config("1f1b", pp, 1, microbatches)
    result = simulate(cfg, costs)
    step = costs.forward + costs.backward
    assert result.pipeline_makespan == pytest.approx((microbatches + pp - 1) * step, rel=1e-12)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (microbatches + pp - 1), abs=1e-12)
    assert result.peak_inflight == [min(pp - rank, microbatches) for rank in range(pp)]
    assert result.busy == [pytest.approx(microbatches * step)] * pp


@PROPERTY_SETTINGS
@given(pp=st.integers(1, 8), microbatches=st.integers(1, 64))
def test_gpipe_has_the_1f1b_bubble_but_holds_every_microbatch(pp, microbatches):
    result = simulate(make_config("gpipe", pp, 1, microbatches))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (microbatches + pp - 1), abs=1e-12)
    assert result.peak_inflight == [microbatches] * pp


@st.composite
def interleaved_configs(draw, schedule="interleaved"):
    pp = draw(st.integers(1, 8))
    vp = draw(st.integers(2, 4))
    microbatches = pp * draw(st.integers(1, 64 // pp))
    if draw(st.booleans()):
        group = None
    else:
        group = draw(st.integers(pp, microbatches))
        remainder = microbatches % group
        assume(remainder == 0 or remainder >= pp)
    return make_config(schedule, pp, vp, microbatches, group)


# Tolerance for the interleaved closed form, and why it is only float rounding (1e-9):
#
# Lower bound, any schedule: rank pp-1 cannot start before microbatch 0 has been forwarded
# through stages 0..pp-2 ((pp-1) * f), then has v*m*(f+b) work of its own, and its last action
# is a chunk-0 backward whose gradient still has to cross stages pp-2..0 ((pp-1) * b). So the
# makespan is >= (v*m + pp - 1) * (f + b) and bubble >= (pp-1) / (v*m + pp - 1).
#
# Upper bound: with free communication and uniform per-chunk costs, Megatron's warm-up
# 2*(pp-r-1) + (v-1)*group makes every rank's steady state run back to back, so the bound is
# attained, not merely approached. This was checked exhaustively for pp<=8, vp<=4, m<=64, every
# legal group size and several f:b ratios; the property test re-checks random samples of it.
# With integer costs every start and end is an integer, so any stall adds at least one unit to
# a makespan of at most (4*64 + 7) * 10 units: a bubble error above 1e-4, far beyond the 1e-9
# allowed for float rounding. A looser tolerance would only hide real stalls.
INTERLEAVED_BUBBLE_TOLERANCE = 1e-9


@PROPERTY_SETTINGS
@given(cfg=interleaved_configs(), costs=unit_costs)
def test_interleaved_bubble_closed_form(cfg, costs):
    result = simulate(cfg, costs)
    closed_form = (cfg.pp - 1) / (cfg.vp * cfg.num_microbatches + cfg.pp - 1)
    assert abs(result.bubble_fraction - closed_form) <= INTERLEAVED_BUBBLE_TOLERANCE
    assert result.peak_inflight == inflight_from_lists(all_rank_actions(cfg))


@PROPERTY_SETTINGS
@given(cfg=interleaved_configs("combined_1f1b"), costs=unit_costs)
def test_combined_interleaved_without_a2a_matches_interleaved(cfg, costs):
    base = make_config("interleaved", cfg.pp, cfg.vp, cfg.num_microbatches, cfg.microbatch_group_size)
    assert simulate(cfg, costs).pipeline_makespan == pytest.approx(simulate(base, costs).pipeline_makespan)


@PROPERTY_SETTINGS
@given(pp=st.integers(1, 8), vp=st.integers(1, 4), microbatches=st.integers(1, 64))
def test_combined_holds_one_more_microbatch_on_rank0(pp, vp, microbatches):
    base_schedule = "1f1b" if vp == 1 else "interleaved"
    try:
        base = make_config(base_schedule, pp, vp, microbatches)
        combined = make_config("combined_1f1b", pp, vp, microbatches)
    except ValueError:
        assume(False)
    # "Large enough": the extra warm-up forward exists and a steady FB follows it.
    assume(microbatches * vp > warmup_count(combined, 0))
    peak = simulate(combined).peak_inflight[0]
    if vp > 1:
        assert peak == simulate(base).peak_inflight[0] + 1
    else:
        # vp == 1 takes the interleaved warm-up 2 * (pp - 1) + 1: 2 * pp in flight on rank 0.
        assert peak == 2 * pp


@PROPERTY_SETTINGS
@given(
    schedule=st.sampled_from(["1f1b", "gpipe", "combined_1f1b"]),
    pp=st.integers(1, 8),
    microbatches=st.integers(1, 64),
)
def test_peak_inflight_matches_the_lists(schedule, pp, microbatches):
    cfg = make_config(schedule, pp, 1, microbatches)
    result = simulate(cfg)
    assert result.peak_inflight == inflight_from_lists(all_rank_actions(cfg))
    assert result.rank_bubble == [pytest.approx(1 - b / result.pipeline_makespan) for b in result.busy]


def test_combined_pp1_runs_two_microbatches_back_to_back():
    result = simulate(make_config("combined_1f1b", 1, 1, 5))
    assert result.bubble_fraction == 0.0
    assert result.peak_inflight == [2]


# combined_1f1b with vp=1 once paired F(k+pp-r) with B(k), so ranks took turns (pp=4, m=8: 51
# units vs 1F1B's 33); the interleaved warm-up fixes it.
def test_combined_vp1_pp_gt1_is_as_fast_as_1f1b_without_a2a():
    combined = simulate(make_config("combined_1f1b", 4, 1, 8))
    plain = simulate(make_config("1f1b", 4, 1, 8))
    assert combined.pipeline_makespan == pytest.approx(plain.pipeline_makespan)


# --------------------------------------------------------------------------------------------
# Expert all-to-all and FB overlap


def test_a2a_is_exposed_in_plain_actions():
    costs = CostModel(forward=1, backward=2, a2a_forward=1, a2a_backward=1)
    result = simulate(make_config("1f1b", 1, 1, 4), costs)
    assert result.pipeline_makespan == 4 * (2 + 3)
    assert result.exposed_a2a == [8]


def test_combined_hides_a2a_behind_the_other_half():
    costs = CostModel(forward=1, backward=2, a2a_forward=1, a2a_backward=1)
    plain = simulate(make_config("1f1b", 1, 1, 4), costs)
    combined = simulate(make_config("combined_1f1b", 1, 1, 4), costs)
    # F0 (1+1), three FB of max(1+2, 1+1) = 3, B3 (2+1)
    assert combined.pipeline_makespan == 2 + 3 * 3 + 3
    assert combined.exposed_a2a == [1 + 1]
    assert combined.pipeline_makespan < plain.pipeline_makespan


def test_combined_hides_a2a_with_pipelining():
    costs = CostModel(forward=1, backward=2, a2a_forward=0.8, a2a_backward=0.8)
    interleaved = simulate(make_config("interleaved", 4, 2, 8), costs)
    combined = simulate(make_config("combined_1f1b", 4, 2, 8), costs)
    assert combined.makespan < interleaved.makespan
    assert sum(combined.exposed_a2a) < sum(interleaved.exposed_a2a)


def test_fb_duration_is_comm_bound_when_a2a_dominates():
    costs = CostModel(forward=1, backward=2, a2a_forward=5, a2a_backward=5)
    result = simulate(make_config("combined_1f1b", 1, 1, 3), costs)
    fb = [(start, end) for _, action, start, end in result.events if action.kind == "FB"]
    assert [end - start for start, end in fb] == [10, 10]
    # F0: 5 exposed, each FB: 10 - 3 = 7, last B: 5
    assert result.exposed_a2a == [5 + 7 + 7 + 5]


def test_weight_grad_joins_backward_unless_w_actions_exist():
    cfg = make_config("1f1b", 1, 1, 1)
    costs = CostModel(forward=1, backward=2, weight_grad=1)
    merged = simulate(cfg, costs)
    assert [(a.kind, end - start) for _, a, start, end in merged.events] == [("F", 1), ("B", 3)]
    split = simulate(cfg, costs, actions=[[forward(0, 0), backward(0, 0), Action(WEIGHT_GRAD, 0, 0)]])
    assert [(a.kind, end - start) for _, a, start, end in split.events] == [("F", 1), ("B", 2), ("W", 1)]
    assert split.pipeline_makespan == merged.pipeline_makespan == 4


# --------------------------------------------------------------------------------------------
# Costs per virtual stage


def test_per_stage_costs_two_stages_by_hand():
    # pp=2, m=2, 1F1B, stage 0: F=1 B=2, stage 1: F=3 B=5 (free transfers):
    #   rank 1: F0 [1,4]  B0 [4,9]  F1 [9,12]  B1 [12,17]
    #   rank 0: F0 [0,1]  F1 [1,2]  B0 [9,11] (waits for rank 1's B0)  B1 [17,19]
    cfg = make_config("1f1b", 2, 1, 2)
    result = simulate(cfg, CostModel(stages=[(1, 2), (3, 5)]))
    spans = {(rank, a.describe()): (start, end) for rank, a, start, end in result.events}
    assert spans[(1, "F1.0")] == (9, 12) and spans[(0, "B0.0")] == (9, 11) and spans[(0, "B1.0")] == (17, 19)
    assert result.pipeline_makespan == 19
    assert result.busy == [6, 16]
    assert result.bubble_fraction == pytest.approx(1 - 22 / 38)


def _reference_replay(cfg, stages, actions):
    """The simulator's rules written plainly (fixed point over the ranks' lists, dictionaries):
    per-rank busy time and the makespan, an independent check of the per-stage pricing."""
    split = {(cfg.stage_of(r, a.chunk), a.microbatch) for r, lst in enumerate(actions) for a in lst if a.kind == "W"}
    last = cfg.num_stages - 1
    f_end, b_end, clock, busy, pos = {}, {}, [0.0] * cfg.pp, [0.0] * cfg.pp, [0] * cfg.pp

    def place(r, action):
        start, duration = clock[r], 0.0
        fwd, bwd = action.forward_part(), action.backward_part()
        if fwd is not None:
            mb, stage = fwd[0], cfg.stage_of(r, fwd[1])
            if stage:
                if (mb, stage - 1) not in f_end:
                    return False
                start = max(start, f_end[(mb, stage - 1)])  # free transfers
            duration += stages[stage].forward
        if bwd is not None:
            mb, stage = bwd[0], cfg.stage_of(r, bwd[1])
            if (mb, stage) not in f_end:
                return False
            start = max(start, f_end[(mb, stage)])
            if stage < last:
                if (mb, stage + 1) not in b_end:
                    return False
                start = max(start, b_end[(mb, stage + 1)])
            duration += stages[stage].backward + (0.0 if (stage, mb) in split else stages[stage].weight_grad)
        if fwd is None and bwd is None:  # W after its own B
            key = (action.microbatch, cfg.stage_of(r, action.chunk))
            if key not in b_end:
                return False
            start = max(start, b_end[key])
            duration = stages[key[1]].weight_grad
        end = start + duration
        if fwd is not None:
            f_end[(fwd[0], cfg.stage_of(r, fwd[1]))] = end
        if bwd is not None:
            b_end[(bwd[0], cfg.stage_of(r, bwd[1]))] = end
        clock[r], busy[r] = end, busy[r] + duration
        return True

    progress = True
    while progress:
        progress = False
        for r in range(cfg.pp):
            while pos[r] < len(actions[r]) and place(r, actions[r][pos[r]]):
                pos[r], progress = pos[r] + 1, True
    assert all(pos[r] == len(actions[r]) for r in range(cfg.pp))
    return busy, max(clock)


@PROPERTY_SETTINGS
@given(
    schedule=st.sampled_from(["1f1b", "interleaved", "combined_1f1b", "zb1p", "zbv", "dualpipev"]),
    pp=st.integers(2, 4),
    data=st.data(),
)
def test_per_stage_costs_match_a_plain_replay(schedule, pp, data):
    vp = 2 if schedule in ("interleaved", "zbv", "dualpipev") else data.draw(st.sampled_from([1, 2]))
    microbatches = data.draw(st.sampled_from([2 * pp, 3 * pp]))
    try:
        cfg = make_config(schedule, pp, vp, microbatches)
    except ValueError:
        assume(False)
    price = st.integers(0, 6).map(float)
    stages = [StageCost(data.draw(price), data.draw(price), data.draw(price)) for _ in range(cfg.num_stages)]
    result = simulate(cfg, CostModel(stages=stages))
    busy, makespan = _reference_replay(cfg, stages, all_rank_actions(cfg))
    assert result.pipeline_makespan == pytest.approx(makespan)
    assert result.busy == pytest.approx(busy)


def test_uniform_stages_equal_the_uniform_prices():
    cfg = make_config("zbv", 2, 2, 8)
    uniform = CostModel(forward=1, backward=2, weight_grad=1.5)
    staged = CostModel(forward=9, backward=9, weight_grad=9, stages=[StageCost(1, 2, 1.5)] * 4)
    assert simulate(cfg, staged).events == simulate(cfg, uniform).events


def test_per_stage_costs_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match=r"CostModel.stages has 2 entries but the table has 4 virtual stages"):
        simulate(make_config("interleaved", 2, 2, 4), CostModel(stages=[(1, 2), (1, 2)]))
    with pytest.raises(ValueError, match=r"stages\[1\].backward=-1"):
        CostModel(stages=[(1, 2), (1, -1)])


# --------------------------------------------------------------------------------------------
# Pipeline point-to-point


def test_p2p_cost_two_stages_by_hand():
    # pp=2, m=2, 1F1B with F=1, B=2 and a message time d = 0.5 + 1000 / 4000 = 0.75:
    #   rank 0: F0 [0,1]  F1 [1,2]                      B0 [4+2d, 6+2d]  B1 [7+2d, 9+2d]
    #   rank 1: F0 [1+d, 2+d]  B0 [2+d, 4+d]  F1 [4+d, 5+d]  B1 [5+d, 7+d]
    # rank 0's B0 waits for rank 1's B0 (4+d) plus d; its B1 for rank 1's B1 (7+d) plus d.
    d = 0.75
    costs = CostModel(p2p_latency=0.5, activation_bytes=1000, p2p_bandwidth=4000)
    cfg = make_config("1f1b", 2, 1, 2)
    result = simulate(cfg, costs)
    free = simulate(cfg)
    assert free.makespan == 9
    assert result.makespan == pytest.approx(9 + 2 * d)
    spans = {(rank, a.describe()): (start, end) for rank, a, start, end in result.events}
    assert spans[(1, "F0.0")] == pytest.approx((1 + d, 2 + d))
    assert spans[(1, "F1.0")] == pytest.approx((4 + d, 5 + d))
    assert spans[(0, "B0.0")] == pytest.approx((4 + 2 * d, 6 + 2 * d))
    assert spans[(0, "B1.0")] == pytest.approx((7 + 2 * d, 9 + 2 * d))


def test_same_rank_chunk_handoff_is_free():
    cfg = make_config("interleaved", 1, 2, 1)
    costs = CostModel(p2p_latency=10, activation_bytes=1e9, p2p_bandwidth=1)
    assert simulate(cfg, costs).makespan == 2 * (1 + 2)


# --------------------------------------------------------------------------------------------
# DP all-reduce


def test_allreduce_formulas():
    seconds, algorithm = allreduce_time(4e6, 4, 1e-5, 1e9)
    ring = 2 * 3 * 1e-5 + 2 * 3 / 4 * 4e6 / 1e9
    tree = 2 * 2 * (1e-5 + 4e6 / 1e9)
    assert (seconds, algorithm) == (pytest.approx(min(ring, tree)), "ring")
    assert allreduce_time(123, 1, 1.0, 1.0) == (0.0, "none")


def test_allreduce_tree_for_small_messages_on_many_ranks():
    seconds, algorithm = allreduce_time(1e3, 64, 1e-5, 1e10)
    assert algorithm == "tree"
    assert seconds == pytest.approx(2 * 6 * (1e-5 + 1e-7))


def test_allreduce_ring_for_large_messages():
    seconds, algorithm = allreduce_time(1e9, 8, 1e-5, 1e10)
    assert algorithm == "ring"
    assert seconds == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * 0.1)


def test_allreduce_runs_after_each_ranks_last_action():
    costs = CostModel(dp_size=4, grad_bytes=100, dp_latency=0.5)
    result = simulate(make_config("1f1b", 4, 1, 8), costs)
    ar, algorithm = allreduce_time(100, 4, 0.5, math.inf)
    assert (result.allreduce_algorithm, result.allreduce_time) == (algorithm, ar)
    assert result.makespan == pytest.approx(max(end + ar for end in result.rank_end))
    # In 1F1B rank 0 finishes last, so the all-reduce adds fully to the makespan there ...
    assert result.makespan == pytest.approx(result.pipeline_makespan + ar)
    # ... while the bubble stays a compute-only figure.
    assert result.bubble_fraction == pytest.approx(3 / 11)


# --------------------------------------------------------------------------------------------
# Deadlocks and bad input


def test_deadlock_on_crossed_order_names_ranks_and_actions():
    # Rank 1 runs microbatch 1 first, rank 0 microbatch 0 first: rank 0's B0 needs rank 1's B0,
    # which comes after rank 1's F1, which needs rank 0's F1, which comes after rank 0's B0.
    cfg = make_config("1f1b", 2, 1, 2)
    actions = [
        [forward(0, 0), backward(0, 0), forward(1, 0), backward(1, 0)],
        [forward(1, 0), backward(1, 0), forward(0, 0), backward(0, 0)],
    ]
    with pytest.raises(RuntimeError) as info:
        simulate(cfg, actions=actions)
    message = str(info.value)
    assert "rank 0" in message and "B0.0" in message
    assert "rank 1" in message and "F1.0" in message


def test_deadlock_on_backward_before_forward():
    cfg = make_config("1f1b", 1, 1, 1)
    with pytest.raises(RuntimeError, match=r"rank 0 waits at action #0 B0\.0"):
        simulate(cfg, actions=[[backward(0, 0), forward(0, 0)]])


def test_fb_cannot_backward_its_own_forward():
    cfg = make_config("combined_1f1b", 1, 1, 1)
    with pytest.raises(RuntimeError, match="F0.0\\+B0.0"):
        simulate(cfg, actions=[[forward_backward((0, 0), (0, 0))]])


def test_hand_made_actions_are_checked():
    cfg = make_config("1f1b", 2, 1, 2)
    with pytest.raises(ValueError, match="1 per-rank lists but pp=2"):
        simulate(cfg, actions=[[forward(0, 0)]])
    with pytest.raises(ValueError, match="microbatch=5"):
        simulate(cfg, actions=[[forward(5, 0)], []])
    with pytest.raises(ValueError, match="chunk=1"):
        simulate(cfg, actions=[[forward(0, 1)], []])


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(forward=-1.0), "forward=-1.0"),
        (dict(a2a_backward=float("nan")), "a2a_backward=nan"),
        (dict(p2p_bandwidth=0), "p2p_bandwidth=0"),
        (dict(dp_size=0), "dp_size=0"),
        (dict(grad_bytes=-5), "grad_bytes=-5"),
    ],
)
def test_cost_model_validation(kwargs, expected):
    with pytest.raises(ValueError) as info:
        CostModel(**kwargs)
    assert expected in str(info.value)


# --------------------------------------------------------------------------------------------
# Result object and speed


def test_result_to_dict_is_json_ready():
    result = simulate(make_config("combined_1f1b", 2, 2, 4), CostModel(dp_size=2, grad_bytes=10))
    assert isinstance(result, SimulationResult)
    data = json.loads(json.dumps(result.to_dict()))
    assert len(data["events"]) == len(result.events)
    assert data["peak_inflight"] == result.peak_inflight
    assert "events" not in result.to_dict(events=False)
    assert [e[0] for e in result.rank_events(1)] == [1] * len(result.rank_events(1))


def test_large_schedule_is_linear_time():
    # Guard against an accidental O(actions * ranks) or worse: 131k actions take ~0.2 s.
    cfg = make_config("interleaved", 32, 4, 512)
    started = time.perf_counter()
    result = simulate(cfg)
    assert time.perf_counter() - started < 10
    assert len(result.events) == 2 * 32 * 4 * 512
    assert result.bubble_fraction == pytest.approx(31 / (4 * 512 + 31))


def test_the_readme_per_stage_example_runs():
    """docs/planning.md ("Planning a pipeline"): the per-stage example runs as printed, and the uneven stages
    (a first stage without input gradient, a last one with the loss) plan a larger bubble."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "planning.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "StageCost" in b]
    scope: dict = {}
    exec(block.replace("print(", "_ = ("), scope)
    assert scope["uneven"].bubble_fraction > scope["even"].bubble_fraction > 0
