"""Properties of the per-rank action tables (lightning_pp.schedules.tables) and their validation.

The tables are the single source of truth for execution order, so they are checked here against
rules written independently of tables.py: every (microbatch, chunk) runs forward and backward
exactly once per rank, backward after forward, and across ranks the chunk order is respected
(checked by simulating and comparing start/end times).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_pp.schedules import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    SCHEDULES,
    WEIGHT_GRAD,
    ScheduleConfig,
    all_rank_actions,
    make_config,
    rank_actions,
    simulate,
    stage_owner,
    virtual_stage,
)

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)


@st.composite
def raw_configs(draw):
    """(schedule, pp, vp, microbatches, group) in the tested ranges; about half of them valid.

    Valid interleaved configurations are rare among uniform draws (with the default group the
    microbatch count must be a multiple of pp), so microbatch counts are biased towards multiples
    of pp and group sizes towards [pp, microbatches].
    """
    schedule = draw(st.sampled_from(SCHEDULES))
    pp = draw(st.integers(1, 8))
    vp = draw(st.integers(1, 4))
    if draw(st.booleans()):
        microbatches = pp * draw(st.integers(1, 64 // pp))
    else:
        microbatches = draw(st.integers(1, 64))
    group = draw(
        st.one_of(
            st.none(),
            st.none(),
            st.integers(pp, max(pp, microbatches)),
            st.integers(1, 64),
        )
    )
    return schedule, pp, vp, microbatches, group


def expected_violations(schedule: str, pp: int, vp: int, microbatches: int, group) -> dict:
    """The rules of DESIGN.md / Megatron, restated independently: {parameter name: bad value}."""
    bad = {}
    if schedule == "1f1b" and vp != 1:
        bad["virtual_pipeline_size"] = vp
    if schedule == "interleaved" and vp < 2:
        bad["virtual_pipeline_size"] = vp
    # The V schedules (torch's ZBV / DualPipeV): exactly two chunks per rank; DualPipeV needs a
    # microbatch per virtual stage (torch: "at least as many microbatches as stages").
    if schedule in ("zbv", "dualpipev") and vp != 2:
        bad["virtual_pipeline_size"] = vp
    if schedule == "dualpipev" and microbatches < 2 * pp:
        bad["num_microbatches"] = microbatches
    interleaved = schedule == "interleaved" or (schedule in ("combined_1f1b", "zb1p") and vp > 1)
    if group is not None and not interleaved:
        bad["microbatch_group_size"] = group
    if interleaved:
        size = pp if group is None else group
        if size < pp:
            bad["microbatch_group_size"] = group
        if microbatches < pp:
            bad["num_microbatches"] = microbatches
        if group is not None and group > microbatches:
            bad["microbatch_group_size"] = group
        remainder = microbatches % min(size, microbatches)
        if remainder and remainder < pp:
            bad["num_microbatches"] = microbatches
    return bad


@st.composite
def valid_configs(draw):
    schedule, pp, vp, microbatches, group = draw(raw_configs())
    assume(not expected_violations(schedule, pp, vp, microbatches, group))
    return make_config(schedule, pp, vp, microbatches, group)


def forward_parts(actions):
    return [a.forward_part() for a in actions if a.forward_part() is not None]


def backward_parts(actions):
    return [a.backward_part() for a in actions if a.backward_part() is not None]


# --------------------------------------------------------------------------------------------
# Validation


@PROPERTY_SETTINGS
@given(raw_configs())
def test_validation_accepts_exactly_the_valid_configs(raw):
    schedule, pp, vp, microbatches, group = raw
    bad = expected_violations(*raw)
    if not bad:
        cfg = make_config(schedule, pp, vp, microbatches, group)
        assert (cfg.pp, cfg.vp, cfg.num_microbatches) == (pp, vp, microbatches)
        return
    with pytest.raises(ValueError) as info:
        make_config(schedule, pp, vp, microbatches, group)
    message = str(info.value)
    # The message names one of the violated parameters together with its value.
    assert any(f"{name}={value}" in message for name, value in bad.items()), (bad, message)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # interleaving needs at least pp microbatches
        (dict(schedule="interleaved", pp=4, vp=2, num_microbatches=2), "num_microbatches=2"),
        # remainder rule: 6 % 4 = 2 is neither 0 nor >= pp
        (dict(schedule="interleaved", pp=4, vp=2, num_microbatches=6), "num_microbatches=6"),
        (dict(schedule="combined_1f1b", pp=4, vp=2, num_microbatches=10, microbatch_group_size=8), "num_microbatches=10"),
        # interleaving needs vp >= 2; 1f1b needs vp == 1
        (dict(schedule="interleaved", pp=4, vp=1, num_microbatches=8), "virtual_pipeline_size=1"),
        (dict(schedule="1f1b", pp=4, vp=2, num_microbatches=8), "virtual_pipeline_size=2"),
        # non-positive sizes
        (dict(schedule="1f1b", pp=0, vp=1, num_microbatches=4), "pipeline_parallel_size (pp)=0"),
        (dict(schedule="1f1b", pp=-2, vp=1, num_microbatches=4), "pipeline_parallel_size (pp)=-2"),
        (dict(schedule="gpipe", pp=2, vp=0, num_microbatches=4), "virtual_pipeline_size (vp)=0"),
        (dict(schedule="1f1b", pp=2, vp=1, num_microbatches=0), "num_microbatches=0"),
        (dict(schedule="1f1b", pp=2, vp=1, num_microbatches=-3), "num_microbatches=-3"),
        (dict(schedule="interleaved", pp=2, vp=2, num_microbatches=4, microbatch_group_size=0), "microbatch_group_size=0"),
        # group size rules
        (dict(schedule="interleaved", pp=4, vp=2, num_microbatches=8, microbatch_group_size=2), "microbatch_group_size=2"),
        (dict(schedule="interleaved", pp=2, vp=2, num_microbatches=4, microbatch_group_size=6), "microbatch_group_size=6"),
        (dict(schedule="1f1b", pp=2, vp=1, num_microbatches=4, microbatch_group_size=2), "microbatch_group_size=2"),
        # unknown schedule
        (dict(schedule="zero_bubble", pp=2, vp=1, num_microbatches=4), "schedule='zero_bubble'"),
    ],
)
def test_invalid_config_message_names_parameter_and_value(kwargs, expected):
    with pytest.raises(ValueError) as info:
        make_config(**kwargs)
    assert expected in str(info.value)


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="virtual_pipeline_size=3"):
        ScheduleConfig("1f1b", 2, 3, 4).validate()


def test_microbatches_default_to_twice_pp():
    assert make_config("1f1b", 3).num_microbatches == 6


def test_rank_out_of_range():
    cfg = make_config("1f1b", 2, 1, 4)
    with pytest.raises(ValueError, match="rank=2"):
        rank_actions(cfg, 2)


# --------------------------------------------------------------------------------------------
# Table properties


@PROPERTY_SETTINGS
@given(valid_configs())
def test_every_chunk_runs_forward_and_backward_exactly_once(cfg):
    expected = Counter((mb, chunk) for mb in range(cfg.num_microbatches) for chunk in range(cfg.vp))
    for rank, actions in enumerate(all_rank_actions(cfg)):
        assert Counter(forward_parts(actions)) == expected, rank
        assert Counter(backward_parts(actions)) == expected, rank
        kinds = {a.kind for a in actions}
        allowed = {FORWARD, BACKWARD}
        if cfg.schedule in ("combined_1f1b", "dualpipev"):
            allowed.add(FORWARD_BACKWARD)
        if cfg.schedule in ("zb1p", "zbv", "dualpipev"):
            allowed.add(WEIGHT_GRAD)
            assert WEIGHT_GRAD in kinds, rank
        assert kinds <= allowed, rank


@PROPERTY_SETTINGS
@given(valid_configs())
def test_backward_comes_after_its_forward_on_the_same_rank(cfg):
    for rank, actions in enumerate(all_rank_actions(cfg)):
        forwarded_at = {}
        for position, action in enumerate(actions):
            f = action.forward_part()
            b = action.backward_part()
            if b is not None:
                # Strictly earlier: an FB may not backward the microbatch it forwards.
                assert b in forwarded_at, (rank, position, action)
                assert forwarded_at[b] < position
            if f is not None:
                forwarded_at[f] = position


@PROPERTY_SETTINGS
@given(valid_configs())
def test_forward_only_order_is_the_training_forward_order(cfg):
    for rank in range(cfg.pp):
        evaluation = rank_actions(cfg, rank, forward_only=True)
        assert all(a.kind == FORWARD for a in evaluation)
        assert [(a.microbatch, a.chunk) for a in evaluation] == forward_parts(rank_actions(cfg, rank))


@PROPERTY_SETTINGS
@given(valid_configs())
def test_chunk_order_is_respected_across_ranks_in_simulation(cfg):
    result = simulate(cfg)  # finishing at all is the cross-rank deadlock check
    last_stage = cfg.num_stages - 1
    f_time = {}
    b_time = {}
    order = {}
    for rank, action, start, end in result.events:
        position = order.get(rank, -1) + 1
        order[rank] = position
        f = action.forward_part()
        b = action.backward_part()
        if f is not None:
            f_time[(f[0], cfg.stage_of(rank, f[1]))] = (start, end)
        if b is not None:
            b_time[(b[0], cfg.stage_of(rank, b[1]))] = (start, end)
    assert len(f_time) == len(b_time) == cfg.num_microbatches * cfg.num_stages
    for (mb, stage), (start, _) in f_time.items():
        if stage > 0:
            assert start >= f_time[(mb, stage - 1)][1], (mb, stage)
    for (mb, stage), (start, _) in b_time.items():
        assert start >= f_time[(mb, stage)][1], (mb, stage)
        if stage < last_stage:
            assert start >= b_time[(mb, stage + 1)][1], (mb, stage)
    # Each rank's actions run one at a time, in list order.
    by_rank = {}
    for rank, _, start, end in result.events:
        previous_end = by_rank.get(rank, 0.0)
        assert start >= previous_end
        by_rank[rank] = end


@PROPERTY_SETTINGS
@given(pp=st.integers(1, 8), microbatches=st.integers(1, 64))
def test_1f1b_warmup_is_pp_minus_rank_minus_one(pp, microbatches):
    cfg = make_config("1f1b", pp, 1, microbatches)
    for rank, actions in enumerate(all_rank_actions(cfg)):
        leading = next((i for i, a in enumerate(actions) if a.kind != FORWARD), len(actions))
        # warm-up forwards, then the first steady forward comes before the first backward
        expected = min(cfg.pp - rank - 1, cfg.num_microbatches)
        assert leading == min(expected + 1, cfg.num_microbatches)


def test_stage_helpers_round_trip():
    for pp in range(1, 6):
        for stage in range(pp * 3):
            assert virtual_stage(*stage_owner(stage, pp), pp) == stage


# --------------------------------------------------------------------------------------------
# Megatron's published order (megatron.md section 1.6 "Worked orders"), typed in from the doc.

MEGATRON_PP2_VP2_N2_M4 = {
    0: "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
    1: "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
}


@pytest.mark.parametrize("rank", [0, 1])
def test_megatron_interleaved_worked_order(rank):
    cfg = make_config("interleaved", pp=2, vp=2, num_microbatches=4, microbatch_group_size=2)
    assert " ".join(a.describe() for a in rank_actions(cfg, rank)) == MEGATRON_PP2_VP2_N2_M4[rank]


def test_megatron_interleaved_default_group_is_pp():
    with_default = make_config("interleaved", pp=2, vp=2, num_microbatches=4)
    explicit = make_config("interleaved", pp=2, vp=2, num_microbatches=4, microbatch_group_size=2)
    assert all_rank_actions(with_default) == all_rank_actions(explicit)


def test_megatron_worked_warmups_pp4_vp2_n4_m8():
    cfg = make_config("interleaved", pp=4, vp=2, num_microbatches=8)
    actions = all_rank_actions(cfg)
    for rank, warmup in ((0, 10), (3, 4)):
        leading = next(i for i, a in enumerate(actions[rank]) if a.kind != FORWARD)
        # warm-up forwards plus the first steady forward
        assert leading == warmup + 1


def test_schedule_layer_is_pure_python():
    """No torch in lightning_pp/schedules, and matplotlib only inside the plotting function."""
    import ast
    from pathlib import Path

    import lightning_pp.schedules as package

    for path in Path(package.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not name.startswith("torch"), (path.name, name)
        for node in tree.body:  # module level
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith("matplotlib") for n in names), (path.name, names)
