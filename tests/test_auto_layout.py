"""``layout="auto"``: the layout chosen from measured per-layer costs by the schedule's simulator.

The chooser is pure, so its decisions are checked exactly on given costs (a head ten blocks
heavy, identical layers, a memory budget); the runtime's measuring is checked through real
pipelines: with every schedule at pp=2 and pp=4, a model whose head costs many blocks gets a
layout other than the even split, every rank takes the same one, and training equals one device
(float64); a model of identical layers keeps the even split. Measured times are noisy, so the
runtime cases assert only what holds for any plausible measurement (a head tens of times a
block moves layers off its stage; equal blocks measured once cost the same)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from distributed import run_distributed
from exactness_models import compare, pipelined_steps, reference_steps
from models import Layered
from lightning_pp.runtime import PipelineConfig
from lightning_pp.runtime.cut.layout import AutoLayout
from lightning_pp.schedules import make_config, schedule_spec
from lightning_pp.schedules.__main__ import main as schedule_cli
from lightning_pp.schedules.auto_layout import LayerCost, LayerCosts, choose_layout, evaluate_layout, even_layout
from lightning_pp.schedules.costs import CostModel, StageCost

BLOCK = LayerCost(1.0, 1.0, 1.0, static_bytes=100.0)
HEAD = LayerCost(10.0, 10.0, 10.0, static_bytes=1000.0)


def _vp(schedule: str) -> int:
    return 2 if schedule_spec(schedule).placement == "v" or schedule == "interleaved" else 1


BUILTIN = ("1f1b", "interleaved", "combined_1f1b", "gpipe", "zb1p", "zbv", "dualpipev")


# -- the pure chooser, on given costs ----------------------------------------------------------------
def test_a_heavy_head_gets_a_stage_of_its_own():
    # 1F1B, pp=2: a stage's step share is (m - 1) * slowest stage + both stages; nine blocks of 3
    # (F + B + W) against a head of 30: [9, 1] (27 | 30) beats the even [5, 5] (15 | 42) and every other cut.
    choice = choose_layout(make_config("1f1b", 2), [BLOCK] * 9 + [HEAD])
    assert choice.layout == [9, 1] and choice.even.layout == [5, 5]
    assert choice.chosen.step < choice.even.step and choice.exhaustive
    text = choice.describe()
    assert "[9, 1]" in text and "even split [5, 5]" in text and "stage 1 (rank 1, chunk 0): layers 9..9" in text


@pytest.mark.parametrize("schedule", BUILTIN)
def test_every_schedule_moves_layers_off_a_heavy_head_and_keeps_even_for_identical_layers(schedule):
    for pp in (2, 4):
        cfg = make_config(schedule, pp, _vp(schedule))
        num_layers = 2 * cfg.num_stages
        heavy = choose_layout(cfg, [BLOCK] * (num_layers - 1) + [HEAD])
        assert heavy.layout != even_layout(num_layers, cfg.num_stages), (schedule, pp)
        # nothing simulated beats it (the chooser tried every layout, or a search whose result no
        # single boundary move improves)
        assert heavy.chosen.step <= heavy.even.step
        assert choose_layout(cfg, [BLOCK] * num_layers).layout == even_layout(num_layers, cfg.num_stages), (schedule, pp)


def test_the_local_search_finds_what_trying_every_layout_finds():
    cfg = make_config("1f1b", 4)
    layers = [BLOCK] * 5 + [LayerCost(2.0, 2.0, 2.0)] * 5 + [HEAD]
    exhaustive = choose_layout(cfg, layers)
    searched = choose_layout(cfg, layers, exhaustive_limit=0)
    assert exhaustive.exhaustive and not searched.exhaustive and searched.candidates < exhaustive.candidates
    assert searched.chosen.step == pytest.approx(exhaustive.chosen.step, rel=1e-12)


def test_a_memory_budget_is_met_or_names_the_smallest_peak():
    cfg = make_config("1f1b", 2)
    layers = [BLOCK] * 9 + [HEAD]  # static bytes only: a rank's peak is the sum over its layers
    # The smallest peak over every cut of nine 100-byte blocks and a 1000-byte head is 1000
    # (the head's rank alone; any cut leaves the head's rank >= 1000).
    with pytest.raises(ValueError, match=r"memory_budget=999 .*smallest peak any layout .* reaches is 1000 bytes"):
        choose_layout(cfg, layers, memory_budget=999)
    # Budget 1200 allows the head with at most two blocks: the fastest such layout is still [9, 1].
    assert choose_layout(cfg, layers, memory_budget=1200).layout == [9, 1]
    # Heavy activations: in 1F1B rank 0 holds pp = 2 microbatches in flight, rank 1 one, so the
    # block activations count twice on rank 0 and a budget can push layers onto rank 1.
    kept = [LayerCost(1.0, 1.0, 1.0, 0.0, 100.0)] * 9 + [LayerCost(10.0, 10.0, 10.0, 0.0, 0.0)]
    assert choose_layout(cfg, kept).layout == [9, 1]  # 9 blocks x 100 x 2 in flight = 1800 bytes on rank 0
    choice = choose_layout(cfg, kept, memory_budget=1000)
    assert choice.chosen.peak_memory <= 1000 and choice.layout == [5, 5]  # 5 x 100 x 2 = 1000; [6, 4] holds 1200


def test_the_runtime_around_the_layers_is_priced_per_action_and_per_message(tmp_path):
    # Two layers over two stages, one microbatch: the step is one chain, derived by hand.
    # Each action pays the measured overhead (F 0.25, B 0.5, W 0.5) once, whatever its layers;
    # each cross-rank hand-off pays the link: 0.1 s + 20 bytes / (100 bytes/s) = 0.3 s.
    layer = LayerCost(1.0, 2.0, 1.0, full_backward=2.5)
    costs = LayerCosts((layer, layer), overhead=StageCost(0.25, 0.5, 0.5), p2p_latency=0.1, p2p_bandwidth=100.0,
                       boundary_bytes=20.0)
    one = dict(pp=2, vp=1, num_microbatches=1)
    # 1F1B runs its backward in one pass (full_backward): F0 1.25, hop, F1 1.25, B1 3.0, hop, B0 3.0.
    assert evaluate_layout(make_config("1f1b", **one), costs, [1, 1]).step == pytest.approx(9.1)
    # ZB-H1 splits it: B 2 + 0.5 and, after B0, W0 1 + 0.5 (W1 runs beside B0).
    assert evaluate_layout(make_config("zb1p", **one), costs, [1, 1]).step == pytest.approx(9.6)
    # Without the measured runtime (bare layer costs, no full_backward): B + W per layer, free links.
    bare = LayerCost(1.0, 2.0, 1.0)
    assert evaluate_layout(make_config("1f1b", **one), [bare, bare], [1, 1]).step == pytest.approx(8.0)
    # A link priced by the caller wins over the measured one: 2 hops of 1 s.
    priced = CostModel(p2p_latency=1.0)
    assert evaluate_layout(make_config("1f1b", **one), costs, [1, 1], priced).step == pytest.approx(10.5)
    # One stage holding both layers pays the overhead once per action and no hop.
    assert evaluate_layout(make_config("1f1b", 1, 1, 1), costs, [2]).step == pytest.approx(2.25 + 5.5)
    # A first stage whose input is data (its first layer has no input gradient) computes nothing
    # at B under a split schedule: its W is the whole backward (here 1.5 + 2.5 + 0.5 entry).
    data = LayerCost(0.5, 0.0, 1.0, full_backward=1.5)
    first = LayerCosts((data, layer, layer), overhead=StageCost(0.25, 0.5, 0.5))
    stages = evaluate_layout(make_config("zb1p", **one), first, [2, 1]).stage_costs
    assert stages == (StageCost(1.75, 0.5, 4.5), StageCost(1.25, 2.5, 1.5))
    # The cost file keeps all of it.
    again = LayerCosts.load(costs.save(tmp_path / "costs.json"))
    assert again == costs
    assert choose_layout(make_config("1f1b", **one), again).chosen.step == pytest.approx(9.1)
    assert "added per action: F 250 B 500 W 500 ms" in choose_layout(make_config("1f1b", **one), again).describe()


def test_identical_layers_keep_the_even_split_unless_the_link_is_slower_than_a_layer():
    # Eight equal layers (F + B = 0.25 each), 1F1B pp=4. A hop of 0.1 keeps the even split; at
    # 0.3 (more than a layer's work) the replay is latency-bound, and moving a layer from each
    # middle stage to an end stage saves exactly one layer's F + B at the end of the step. The
    # runtime measures the link's own cost (the fastest round trip), well under a layer here.
    layer = LayerCost(0.05, 0.0, 0.0, full_backward=0.2)
    cfg = make_config("1f1b", 4, 1, 8)
    fast = choose_layout(cfg, LayerCosts((layer,) * 8, p2p_latency=0.1, boundary_bytes=1.0))
    assert fast.layout == [2, 2, 2, 2]
    slow = choose_layout(cfg, LayerCosts((layer,) * 8, p2p_latency=0.3, boundary_bytes=1.0))
    assert slow.layout == [3, 1, 1, 3] and slow.even.step - slow.chosen.step == pytest.approx(0.25)


def test_every_rank_s_measurement_counts_and_the_link_comes_from_ranks_with_a_peer():
    from lightning_pp.runtime.measure import _combine

    def measured(scale):
        return LayerCosts((LayerCost(1.0 * scale, 2.0 * scale, 1.0 * scale, 10.0, 5.0, 2.0 * scale),),
                          overhead=StageCost(0.0, 0.1 * scale, 0.1 * scale), boundary_bytes=8.0)

    # Rank 2 of three had no peer to exchange with (0, 0): the link is the mean of ranks 0 and 1's.
    both = _combine([measured(1.0), measured(3.0), measured(2.0)], [(0.5, 0.01), (0.7, 0.03), (0.0, 0.0)])
    assert both.layers == (LayerCost(2.0, 4.0, 2.0, 10.0, 5.0, 4.0),)
    assert both.overhead == pytest.approx((0.0, 0.2, 0.2))
    # hop 0.6 s for 8 bytes at 0.02 s per byte: latency 0.44 s, bandwidth 50 bytes/s
    assert (both.p2p_latency, both.p2p_bandwidth, both.boundary_bytes) == pytest.approx((0.44, 50.0, 8.0))
    assert both.cost_model().p2p_time() == pytest.approx(0.6)
    alone = _combine([measured(1.0)], [(0.0, 0.0)])
    assert alone.cost_model().p2p_time() == 0.0 and alone.layers == measured(1.0).layers


def test_measuring_one_process_prices_the_engine_entry_and_the_boundary():
    from lightning_pp.runtime.measure import measure_layer_costs

    model = _model("heavy", 4)
    for split in (False, True):
        costs = measure_layer_costs(model, model.pipeline_layers(), _batches("heavy", 4, 2)[0], 2, split=split)
        # Entering autograd is charged once per action: B (and, split, W) of every stage.
        assert costs.overhead.forward == 0.0 and costs.overhead.backward > 0
        assert (costs.overhead.weight_grad > 0) == split
        assert all(c.full_backward is not None for c in costs.layers)
        assert costs.boundary_bytes == 8 * 8 * 8  # a microbatch of 8 rows of 8 float64 hidden units
        assert costs.layers[1] == costs.layers[2]  # equal blocks measured once
        assert costs.layers[0].backward == 0.0  # the first layer's input is data: no input gradient
    assert all(p.grad is None for p in model.parameters())  # measured on copies


def test_layout_auto_with_a_list_is_refused_by_name():
    with pytest.raises(ValueError, match=r"layout=\[2, 'auto'\] mixes 'auto' with a list-valued layout"):
        PipelineConfig(layout=[2, "auto"])
    with pytest.raises(ValueError, match=r"AutoLayout\(memory_budget=-1\) is invalid"):
        AutoLayout(memory_budget=-1)
    PipelineConfig(layout="auto")
    PipelineConfig(layout=AutoLayout(memory_budget=1e9))


def test_the_cli_answers_from_a_cost_file(tmp_path, capsys):
    path = LayerCosts(tuple([BLOCK] * 9 + [HEAD])).save(tmp_path / "costs.json")
    assert schedule_cli(["--pp", "2", "--costs", str(path), "--layout", "auto"]) == 0
    out = capsys.readouterr().out
    assert "layers per virtual stage [9, 1]" in out and "even split [5, 5]" in out
    assert schedule_cli(["--pp", "2", "--costs", str(path), "--layout", "5,5", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"] == [5, 5]
    assert report["stats"]["makespan"] == pytest.approx(choose_layout(make_config("1f1b", 2), LayerCosts.load(path)).even.step)
    assert schedule_cli(["--pp", "2", "--costs", str(path), "--memory-budget", "999"]) == 2
    assert "smallest peak any layout" in capsys.readouterr().err
    # A per-stage file (what PipelineMonitor(write_costs=True) writes) is read back, each stage's
    # time spread over its layers: 2 + 8 layers measured at 2 and 16 per microbatch.
    stages = {"stages": [{"layers": 2, "forward": 2, "backward": 2}, {"layers": 8, "forward": 16, "backward": 16}]}
    (tmp_path / "stages.json").write_text(json.dumps(stages))
    spread = LayerCosts.load(tmp_path / "stages.json")
    assert spread.layers[0] == LayerCost(1, 1, 0, 0, 0) and spread.layers[-1] == LayerCost(2, 2, 0, 0, 0)
    assert schedule_cli(["--pp", "2", "--costs", str(tmp_path / "stages.json")]) == 0
    assert "layers per virtual stage [6, 4]" in capsys.readouterr().out  # 6 + 8 | 8: the most even time


# -- the runtime: measuring on the real batch, one layout for every rank, equal to one device --------
class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class WideHead(nn.Module):
    """A large-vocabulary head in miniature: tens of blocks' compute."""

    def __init__(self, hidden: int, width: int, dim_out: int):
        super().__init__()
        self.up = nn.Linear(hidden, width)
        self.down = nn.Linear(width, dim_out)

    def forward(self, h):
        return self.down(torch.tanh(self.up(h)))


class HeavyHeadNet(Layered):
    def __init__(self, blocks: int, hidden: int = 8, width: int = 16384):
        super().__init__()
        self.embed = nn.Linear(4, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.head = WideHead(hidden, width, 2)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]


class SameBlocks(Layered):
    """Identical layers, each heavy enough that the loss on the last one is noise beside it."""

    def __init__(self, blocks: int, hidden: int = 256):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))

    def pipeline_layers(self):
        return list(self.blocks)


def _model(kind: str, num_layers: int, meta: bool = False, materialized: bool = False):
    """``meta``: built on the meta device (the pipeline materialises what each rank keeps);
    ``materialized``: the same, materialised whole here, as the one-device reference of it."""
    torch.manual_seed(3)
    if meta or materialized:
        with torch.device("meta"):
            model = _model(kind, num_layers)
        torch.manual_seed(3)
        if materialized:
            from lightning_pp.runtime.cut.meta import materialize

            materialize(model, torch.device("cpu"), seed=3)
        return model
    if kind == "heavy":
        return HeavyHeadNet(num_layers - 2).double()
    return SameBlocks(num_layers).double()


def _batches(kind: str, dim_in: int, dim_out: int):
    g = torch.Generator().manual_seed(5)
    rows = 16 if kind == "heavy" else 64
    return [(torch.randn(rows, dim_in, generator=g, dtype=torch.float64),
             torch.randn(rows, dim_out, generator=g, dtype=torch.float64))]


def _dims(kind):
    return (4, 2) if kind == "heavy" else (256, 256)


def _cases(pp: int):
    cases = []
    for schedule in BUILTIN:
        vp = _vp(schedule)
        cases.append(dict(kind="heavy", schedule=schedule, pp=pp, vp=vp, layers=2 * pp * vp, m=2 * pp))
    cases.append(dict(kind="same", schedule="1f1b", pp=pp, vp=1, layers=2 * pp, m=2 * pp))
    if pp == 2:  # built on the meta device: measured one materialised copy of a layer at a time
        cases.append(dict(kind="heavy", meta=True, schedule="zbv", pp=pp, vp=2, layers=4 * pp, m=2 * pp))
        cases.append(dict(kind="budget"))
    return cases


def _run(rank, world, cases):
    from lightning_pp.runtime import build_pipeline

    from lightning_pp.runtime import AutoLayout

    out = []
    for case in cases:
        if case["kind"] == "budget":  # rank 0 finds no layout under the budget: every rank raises its error
            try:
                build_pipeline(_model("heavy", 6), pipeline_parallel_size=2, layout=AutoLayout(memory_budget=1000),
                               example_batch=_batches("heavy", 4, 2)[0])
            except ValueError as err:
                out.append(str(err))
            continue
        model = _model(case["kind"], case["layers"], meta=case.get("meta", False))
        batches = _batches(case["kind"], *_dims(case["kind"]))
        executor = build_pipeline(model, pipeline_parallel_size=case["pp"], virtual_pipeline_size=case["vp"],
                                  num_microbatches=case["m"], schedule=case["schedule"], layout="auto",
                                  example_batch=batches[0])
        out.append((list(executor.partition.layout), executor.layout_choice.describe(),
                    pipelined_steps(executor, model, batches)))
        executor.close()
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_auto_layout_under_every_schedule_equals_one_device(pp):
    cases = _cases(pp)
    per_rank = run_distributed(_run, pp, cases, timeout=400)
    for i, case in enumerate(cases):
        if case["kind"] == "budget":
            # The head's 16384-wide float64 weights alone take over a megabyte: no layout fits 1000 bytes.
            for message in (r[i] for r in per_rank):
                assert "layout='auto' cannot meet memory_budget=1000" in message and "smallest peak" in message
            continue
        layouts = {tuple(r[i][0]) for r in per_rank}
        assert len(layouts) == 1, f"{case}: ranks took different layouts {layouts}"
        layout = list(layouts.pop())
        even = even_layout(case["layers"], pp * case["vp"])
        if case["kind"] == "heavy":
            assert layout != even, f"{case}: the even split {even} kept though the head is tens of blocks\n{per_rank[0][i][1]}"
            assert layout[-1] == 1 or case["schedule"] in ("zbv", "dualpipev"), per_rank[0][i][1]
        else:
            assert layout == even, f"{case}: identical layers, yet {layout}\n{per_rank[0][i][1]}"
        model = _model(case["kind"], case["layers"], materialized=case.get("meta", False))
        batches = _batches(case["kind"], *_dims(case["kind"]))
        compare(case, reference_steps(model, batches), [r[i][2] for r in per_rank])


def test_layout_auto_without_a_batch_says_how_to_give_one():
    from lightning_pp.runtime import build_pipeline

    # Checked before any process group exists (a resolved configuration needs none to get there).
    resolved = PipelineConfig(pipeline_parallel_size=2, layout="auto").resolve(2)
    with pytest.raises(ValueError, match=r"layout=.auto. measures .* a `pipeline_example_batch"):
        build_pipeline(HeavyHeadNet(2), resolved)


def test_measured_costs_choose_through_the_same_simulator():
    # What the runtime hands the chooser is what the CLI reads: evaluate_layout of the chosen
    # layout gives the step the choice reports.
    cfg = make_config("zb1p", 2)
    costs = LayerCosts(tuple([BLOCK] * 5 + [HEAD]))
    choice = choose_layout(cfg, costs)
    assert evaluate_layout(cfg, costs.layers, choice.layout).step == choice.chosen.step


# -- the Trainer: the first training batch is measured; the monitor's costs go back into the CLI -----
def _fit(rank, world, log_root):
    import os

    import lightning as L

    from lightning_models import PipeRegressor, loader
    from lightning_pp import PipelineMonitor, PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    monitor = PipelineMonitor(every_n_steps=1, trace_step=2, write_trace=False, write_png=False, write_costs=True,
                              dirpath=log_root)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=3, callbacks=[monitor], logger=False,
        strategy=PipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, layout="auto"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
    )
    trainer.fit(PipeRegressor(hidden=32, blocks=4), loader(16, n=48))
    executor = trainer.strategy.engine.executor
    return list(executor.partition.layout), executor.layout_choice.to_dict(), [str(p) for p in monitor.written]


def test_the_trainer_measures_its_first_batch_and_the_monitor_writes_costs_the_cli_reads(tmp_path, capsys):
    per_rank = run_distributed(_fit, 2, str(tmp_path), timeout=240)
    (layout0, choice0, written), (layout1, choice1, _) = per_rank
    assert layout0 == layout1 == choice0["layout"] == choice1["layout"] and sum(layout0) == 6
    assert choice0["even"]["layout"] == [3, 3] and choice0["candidates"] == 5
    assert [p.rsplit("/", 1)[-1] for p in written] == ["pipeline_costs_step2.json"]
    costs = LayerCosts.load(written[0])
    assert costs.stage_layout == tuple(layout0) and len(costs.layers) == 6
    assert all(c.forward > 0 and c.backward > 0 and c.static_bytes > 0 for c in costs.layers)
    assert schedule_cli(["--pp", "2", "--microbatches", "4", "--costs", written[0], "--layout", "auto"]) == 0
    assert "layout='auto' for 1f1b pp=2 vp=1 microbatches=4" in capsys.readouterr().out
