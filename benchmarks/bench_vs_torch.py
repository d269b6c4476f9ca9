"""Side-by-side step time: lightning_pp's pipeline runtime vs ``torch.distributed.pipelining``,
for every schedule torch has.

Both implementations train the same model (input linear, ``--blocks`` residual MLP blocks,
output linear; float32) on the same 2 gloo processes, with the same batch, the same microbatch
count, the same layer-to-stage layout and the same initial weights. Per schedule (``SPECS``):

* ``1f1b``:        ours ``schedule="1f1b"``, vp=1  vs  torch ``Schedule1F1B``, one ``PipelineStage`` per rank;
* ``interleaved``: ours ``schedule="interleaved"``, vp=2  vs  ``ScheduleInterleaved1F1B``, 2 stages per rank;
* ``zb1p``:        ours ``schedule="zb1p"``, vp=1 (ZB-H1)  vs  ``ScheduleInterleavedZeroBubble`` with one
  stage per rank;
* ``zb1p_vp2``:    ours ``schedule="zb1p"``, vp=2  vs  ``ScheduleInterleavedZeroBubble``, 2 stages per rank;
* ``zbv``:         ours ``schedule="zbv"``  vs  ``ScheduleZBVZeroBubble`` (V placement: rank ``r`` holds
  stages ``r`` and ``2 * pp - 1 - r``);
* ``dualpipev``:   ours ``schedule="dualpipev"``  vs  ``ScheduleDualPipeV`` (V placement; needs
  ``microbatches >= 2 * pp``).

The loop schedules place virtual stage ``s`` on rank ``s % pp`` in both (ours: local chunk
``s // pp``; torch: its default "loop" placement); our tables equal torch's action for action
(the zero-bubble ones with torch's default grouping). Layout: every virtual stage holds
``blocks / stages`` blocks (extras spread over the ranks), the input linear rides on the first
stage and the output linear on the last, so every rank has the same work under either placement
(8 blocks: ``[5, 5]`` for one stage per rank, ``[3, 2, 2, 3]`` for two).

Loss: mean MSE per microbatch. Torch (``scale_grads=True``) divides the summed gradients by the
microbatch count; ours weights each microbatch's mean by its sample count and divides by the
batch size. With equal microbatches (the batch must be divisible by ``--microbatches``) both are
the full-batch mean gradient. Before timing, one step of each is run from identical weights and
the losses (1e-4 relative) and every local gradient are compared; a mismatch aborts the run.

A timed step is ``zero_grad`` + forward/backward of every microbatch + ``SGD.step``, measured with
``time.perf_counter`` after a barrier; the step time is the maximum over ranks. The two
implementations alternate in blocks of ``--block-size`` steps (ours first in even rounds, torch
first in odd ones) so that background noise on the machine hits both. Schedules run one after
the other in the same processes. Then our fastest schedule and torch's fastest (by those medians)
run once more, head to head in alternating blocks: ``ratio_best_vs_torch_best`` is the ratio of
their medians there (``..._across``: the same from the per-schedule medians, taken up to minutes
apart).

Shared machines: during every step rank 0 also reads the machine's busy CPU time from
``/proc/stat`` (incl. hypervisor steal) and subtracts both ranks' own CPU time; a step during
which other processes used more than ``CONTENDED`` cores is counted as contended. Besides the
all-steps figures the report gives the medians and ratio over uncontended steps only
(``clean_ratio_vs_torch_<s>``) and the median of per-round ratios (``paired_ratio_vs_torch_<s>``).
``--wait-quiet`` waits for an idle machine before starting, ``--min-clean N`` keeps measuring
(up to ``--max-steps``) until both implementations have N uncontended steps.

Usage::

    python benchmarks/bench_vs_torch.py                       # hidden 512, every schedule
    python benchmarks/bench_vs_torch.py --hidden 1024 --schedule 1f1b
    python benchmarks/bench_vs_torch.py --schedule zb1p,zbv,dualpipev
    python benchmarks/bench_vs_torch.py --quick               # smoke test

Prints a table and ``name: value`` lines (``ratio_vs_torch_1f1b: <float>`` ...,
``ratio_best_vs_torch_best``). ``run(args)`` returns the same figures as a dict for
``benchmarks/run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import launch  # noqa: E402

WORLD_SIZE = 2  # = pipeline parallel size; the machine has 2 cores

DEFAULTS = {
    "hidden": 512,
    "blocks": 8,
    "ffn_mult": 4,
    "batch": 256,
    "microbatches": 8,
    "steps": 30,
    "warmup": 3,
    "block_size": 2,
    "schedule": "all",
    "quick": False,
    "lr": 1e-3,
    "seed": 0,
    "timeout": 1800.0,
    "wait_quiet": 60.0,
    "min_clean": 0,
    "max_steps": None,  # default 10 * steps
}
QUICK = {"steps": 6, "warmup": 1, "block_size": 1}
# --dry-run: every code path (equivalence check included) on a tiny model, one step; no figure means anything.
DRY_RUN = {"hidden": 32, "blocks": 4, "ffn_mult": 2, "batch": 8, "microbatches": 4, "steps": 1, "warmup": 0,
           "block_size": 1, "wait_quiet": 0.0, "timeout": 300.0}
# name -> (our schedule, virtual stages per rank, torch's schedule class, stage placement)
SPECS = {
    "1f1b": ("1f1b", 1, "Schedule1F1B", "loop"),
    "interleaved": ("interleaved", 2, "ScheduleInterleaved1F1B", "loop"),
    "zb1p": ("zb1p", 1, "ScheduleInterleavedZeroBubble", "loop"),
    "zb1p_vp2": ("zb1p", 2, "ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("zbv", 2, "ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("dualpipev", 2, "ScheduleDualPipeV", "v"),
}
SCHEDULES = tuple(SPECS)
GROUPS = {"all": SCHEDULES, "both": ("1f1b", "interleaved")}  # "both": the two schedules of earlier runs
VP = {name: spec[1] for name, spec in SPECS.items()}
CONTENDED = 0.25  # a step during which other processes used more than this many cores is "contended"
LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-3  # float32, same ops in the same order per microbatch; the sum over microbatches may differ in order


# -- model ------------------------------------------------------------------------------------
def _model_classes():
    """Defined lazily so that importing this file (e.g. from run_all.py) does not import torch."""
    import torch.nn.functional as F
    from torch import nn

    class ResidualMLP(nn.Module):
        def __init__(self, hidden: int, mult: int):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, mult * hidden)
            self.down = nn.Linear(mult * hidden, hidden)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class BenchModel(nn.Module):
        """Linear in, residual MLP blocks, linear out; implements lightning_pp's protocol."""

        def __init__(self, hidden: int, blocks: int, mult: int):
            super().__init__()
            self.embed = nn.Linear(hidden, hidden)
            self.blocks = nn.ModuleList(ResidualMLP(hidden, mult) for _ in range(blocks))
            self.head = nn.Linear(hidden, hidden)

        def pipeline_layers(self):
            return [self.embed, *self.blocks, self.head]

        def pipeline_loss(self, output, batch):
            return F.mse_loss(output, batch[1])

    return BenchModel


def _make_model(cfg: dict):
    import torch

    torch.manual_seed(cfg["seed"])
    return _model_classes()(cfg["hidden"], cfg["blocks"], cfg["ffn_mult"])


def _mse(output, target):
    import torch.nn.functional as F

    return F.mse_loss(output, target)


def stage_layout(cfg: dict, schedule: str) -> list[int]:
    """Layers per virtual stage for ``schedule``: ``blocks / stages`` blocks each, the extras one
    per rank in turn (chunk 0 of every rank first), the input linear on the first stage and the
    output linear on the last. Under either placement every rank then holds the same blocks."""
    from lightning_pp.schedules import virtual_stage

    _, vp, _, placement = SPECS[schedule]
    num_stages = WORLD_SIZE * vp
    base, extra = divmod(cfg["blocks"], num_stages)
    counts = [base] * num_stages
    for stage in [virtual_stage(r, c, WORLD_SIZE, placement) for c in range(vp) for r in range(WORLD_SIZE)][:extra]:
        counts[stage] += 1
    counts[0] += 1
    counts[-1] += 1
    return counts


def local_stages(schedule: str, rank: int) -> list[int]:
    """The virtual stages ``rank`` holds, in local chunk order (the same in both implementations)."""
    from lightning_pp.schedules import virtual_stage

    _, vp, _, placement = SPECS[schedule]
    return [virtual_stage(rank, chunk, WORLD_SIZE, placement) for chunk in range(vp)]


# -- the two implementations on one rank ------------------------------------------------------
class _Ours:
    name = "ours"

    def __init__(self, cfg: dict, schedule: str, topology, activation_checkpointing: bool = False, compile=False):
        import torch
        from lightning_pp.runtime import build_pipeline

        ours, vp, _, _ = SPECS[schedule]
        model = _make_model(cfg)
        self.executor = build_pipeline(
            model,
            pipeline_parallel_size=WORLD_SIZE,
            virtual_pipeline_size=vp,
            num_microbatches=cfg["microbatches"],
            schedule=ours,
            layout=stage_layout(cfg, schedule),
            topology=topology,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
        )
        self.layout = list(self.executor.partition.layout)
        # Per local stage, the parameters in layer order (for the gradient comparison).
        self.stage_params = {
            chunk.stage: [p for layer in chunk.layers for p in layer.parameters()]
            for chunk in self.executor.partition.chunks
        }
        self.params = [p for ps in self.stage_params.values() for p in ps]
        self.opt = torch.optim.SGD(self.params, lr=cfg["lr"])

    def step(self, batch) -> Optional[float]:
        self.opt.zero_grad(set_to_none=True)
        result = self.executor.train_step(batch)
        self.opt.step()
        return float(result.loss)


class _Torch:
    name = "torch"

    def __init__(self, cfg: dict, schedule: str, layout: list[int], rank: int):
        import torch
        from torch import nn
        from torch.distributed import pipelining

        _, vp, class_name, _ = SPECS[schedule]
        num_stages = WORLD_SIZE * vp
        if len(layout) != num_stages:
            raise AssertionError(f"layout {layout} does not have {num_stages} stages")
        layers = _make_model(cfg).pipeline_layers()
        starts = [sum(layout[:s]) for s in range(num_stages)]
        local = local_stages(schedule, rank)
        self.stage_modules = {s: nn.Sequential(*layers[starts[s] : starts[s] + layout[s]]) for s in local}
        # Torch's multi-stage schedules set the V schedules' stage-to-rank map on the stages.
        self.stages = [
            pipelining.PipelineStage(self.stage_modules[s], s, num_stages, torch.device("cpu")) for s in local
        ]
        self.stage_params = {s: list(m.parameters()) for s, m in self.stage_modules.items()}
        self.params = [p for ps in self.stage_params.values() for p in ps]
        self.opt = torch.optim.SGD(self.params, lr=cfg["lr"])
        self.n_mb = cfg["microbatches"]
        schedule_class = getattr(pipelining, class_name)
        stages = self.stages[0] if class_name == "Schedule1F1B" else self.stages
        self.schedule = schedule_class(stages, self.n_mb, loss_fn=_mse, scale_grads=True)
        self.is_first = 0 in local
        self.is_last = num_stages - 1 in local

    def step(self, batch) -> Optional[float]:
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        losses: list = []
        args = (x,) if self.is_first else ()
        kwargs = {"target": y, "losses": losses} if self.is_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.opt.step()
        if not self.is_last:
            return None
        # Mean of per-microbatch means = batch mean (equal microbatches).
        return float(sum(float(loss.detach()) for loss in losses) / self.n_mb)


# -- worker -----------------------------------------------------------------------------------
def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (incl. hypervisor steal) since boot;
    0.0 where /proc/stat is unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def _timed_step(impl, batch, rank: int) -> tuple[float, float]:
    """(step time = max over ranks, CPU used by *other* processes during the step, in cores).

    The second figure is the machine's busy time (from rank 0's /proc/stat reading) minus both
    ranks' own process CPU time, divided by the step time: about 0 on a quiet machine, about 1
    when another job took a core. It is coarse (10 ms ticks) but flags contended steps."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    busy0 = _machine_busy_s() if rank == 0 else 0.0
    cpu0 = time.process_time()
    start = time.perf_counter()
    impl.step(batch)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    busy = _machine_busy_s() - busy0 if rank == 0 else 0.0
    t = torch.zeros(2 * WORLD_SIZE + 1, dtype=torch.float64)
    t[rank], t[WORLD_SIZE + rank] = wall, cpu
    t[-1] = busy
    dist.all_reduce(t)
    step = float(t[:WORLD_SIZE].max())
    foreign = (float(t[-1]) - float(t[WORLD_SIZE : 2 * WORLD_SIZE].sum())) / step
    return step, max(0.0, foreign)


def _check_equivalence(ours: _Ours, theirs: _Torch, batch, rank: int) -> dict:
    """Step 1 of both from identical weights: losses and gradients must agree."""
    import torch
    import torch.distributed as dist

    for s in ours.stage_params:
        a, b = ours.stage_params[s], theirs.stage_params[s]
        if len(a) != len(b) or any(pa.shape != pb.shape or not torch.equal(pa, pb) for pa, pb in zip(a, b)):
            raise AssertionError(f"rank {rank}: stage {s} does not start from the same weights in both implementations")
    # Run the step by hand (not .step) so the gradients can be read before the optimizer step.
    ours.opt.zero_grad(set_to_none=True)
    loss_ours = float(ours.executor.train_step(batch).loss)
    theirs.opt.zero_grad(set_to_none=True)
    x, y = batch
    losses: list = []
    theirs.schedule.step(
        *((x,) if theirs.is_first else ()),
        return_outputs=False,
        **({"target": y, "losses": losses} if theirs.is_last else {}),
    )
    loss_torch_local = sum(float(loss.detach()) for loss in losses) / theirs.n_mb if theirs.is_last else 0.0
    t = torch.tensor([loss_torch_local], dtype=torch.float64)
    dist.all_reduce(t)  # only the last-stage rank contributes
    loss_torch = float(t[0])
    worst = 0.0
    for s in ours.stage_params:
        for pa, pb in zip(ours.stage_params[s], theirs.stage_params[s]):
            ga, gb = pa.grad, pb.grad
            if ga is None or gb is None:
                raise AssertionError(f"rank {rank}: stage {s} has a parameter without a gradient")
            worst = max(worst, float((ga - gb).norm() / gb.norm().clamp_min(1e-30)))
    worst = _max_over_ranks(worst)
    ours.opt.step()
    theirs.opt.step()
    rel = abs(loss_ours - loss_torch) / max(abs(loss_torch), 1e-30)
    if rel > LOSS_RTOL:
        raise AssertionError(
            f"step-1 losses differ: ours {loss_ours:.8g} vs torch {loss_torch:.8g} (relative {rel:.2e} > {LOSS_RTOL})"
        )
    if worst > GRAD_RTOL:
        raise AssertionError(f"step-1 gradients differ: worst relative difference {worst:.2e} > {GRAD_RTOL}")
    return {"loss_ours": loss_ours, "loss_torch": loss_torch, "loss_rel_diff": rel, "grad_rel_diff": worst}


def _alternate(cfg: dict, impls: tuple, batch, rank: int) -> dict:
    """Time ``impls`` (ours, torch) in alternating blocks after ``warmup`` steps of each."""
    for _ in range(cfg["warmup"]):
        for impl in impls:
            _timed_step(impl, batch, rank)
    times = {"ours": [], "torch": []}
    foreign = {"ours": [], "torch": []}  # other processes' CPU use during each step, in cores
    blocks = []  # (round, name, [times]) in execution order

    def clean_count() -> int:
        return min(sum(f < CONTENDED for f in v) for v in foreign.values())

    # ``steps`` per implementation; then, with ``min_clean``, more rounds until each has that many
    # uncontended steps or ``max_steps`` is reached. Every rank sees the same all-reduced figures,
    # so all take the same decision.
    r = 0
    while True:
        done = len(times["ours"])
        if done >= cfg["steps"] and (clean_count() >= cfg["min_clean"] or done >= cfg["max_steps"]):
            break
        n = cfg["block_size"] if done >= cfg["steps"] else min(cfg["block_size"], cfg["steps"] - done)
        for impl in impls if r % 2 == 0 else impls[::-1]:
            block = [_timed_step(impl, batch, rank) for _ in range(n)]
            times[impl.name].extend(t for t, _ in block)
            foreign[impl.name].extend(f for _, f in block)
            blocks.append((r, impl.name, [t for t, _ in block]))
        r += 1
    return {"times": times, "foreign": foreign, "blocks": blocks}


def _bench_schedule(cfg: dict, schedule: str, topology, batch, rank: int) -> dict:
    ours = _Ours(cfg, schedule, topology)
    theirs = _Torch(cfg, schedule, ours.layout, rank)
    check = _check_equivalence(ours, theirs, batch, rank)
    return {"layout": ours.layout, "check": check} | _alternate(cfg, (ours, theirs), batch, rank)


def _head_to_head(cfg: dict, results: dict, topology, batch, rank: int) -> dict:
    """Our fastest schedule (by the medians of the per-schedule runs) against torch's fastest, in
    alternating blocks like one schedule: ``ratio_best_vs_torch_best`` from steps taken side by
    side, not from medians taken minutes apart (and without the bias of picking the smallest of
    several noisy medians). The times are all-reduced, so every rank picks the same two."""
    best = {name: min(results, key=lambda s, n=name: statistics.median(results[s]["times"][n])) for name in ("ours", "torch")}
    ours = _Ours(cfg, best["ours"], topology)
    theirs = _Torch(cfg, best["torch"], stage_layout(cfg, best["torch"]), rank)
    for impl in (ours, theirs):  # torch infers its stage shapes in its first step
        impl.step(batch)
    return {"best": best} | _alternate(cfg, (ours, theirs), batch, rank)


def _measure(rank: int, world: int, cfg: dict) -> dict:
    import torch

    from lightning_pp.runtime import build_topology

    topology = build_topology(world)
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    batch = (
        torch.randn(cfg["batch"], cfg["hidden"], generator=g),
        torch.randn(cfg["batch"], cfg["hidden"], generator=g),
    )
    results = {s: _bench_schedule(cfg, s, topology, batch, rank) for s in cfg["schedules"]}
    if len(results) > 1:
        results["head_to_head"] = _head_to_head(cfg, results, topology, batch, rank)
    return results


def _wait_quiet(max_wait: float, window: float = 2.0, threshold: float = 0.15) -> Optional[float]:
    """Wait (at most ``max_wait`` seconds) until the machine's CPUs were used by less than
    ``threshold`` cores over a ``window``-second interval. Returns the load seen in the last
    window (None without /proc/stat): a best effort, since other jobs may start at any time."""
    deadline = time.monotonic() + max_wait
    while True:
        before, t0 = _machine_busy_s(), time.monotonic()
        time.sleep(window)
        if before == 0.0:
            return None
        load = (_machine_busy_s() - before) / (time.monotonic() - t0)
        if load < threshold or time.monotonic() >= deadline:
            return load


def _launch(cfg: dict) -> dict:
    """Run the workers; rank 0's results. Kills everything at ``cfg['timeout']`` seconds."""
    return launch(_measure, WORLD_SIZE, cfg, timeout=cfg["timeout"])[0]


# -- statistics and reporting -----------------------------------------------------------------
def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _summary(times_s: list[float]) -> dict:
    ms = [t * 1e3 for t in times_s]
    return {
        "median": statistics.median(ms),
        "q25": _quantile(ms, 0.25),
        "q75": _quantile(ms, 0.75),
        "iqr": _quantile(ms, 0.75) - _quantile(ms, 0.25),
        "min": min(ms),
        "n": len(ms),
    }


def _schedule_list(spec: str) -> list[str]:
    """``all``, ``both`` (1f1b and interleaved) or a comma-separated list of ``SCHEDULES``."""
    names = list(GROUPS[spec]) if spec in GROUPS else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in SPECS]
    if unknown or not names:
        raise ValueError(f"schedule={spec!r}: use 'all', 'both' or a comma-separated list of {SCHEDULES}")
    return names


def _config(args: Any) -> dict:
    if args is None:
        cfg = {}
    elif isinstance(args, dict):
        cfg = dict(args)
    else:
        cfg = {k: v for k, v in vars(args).items() if v is not None}
    unknown = set(cfg) - set(DEFAULTS) - {"dry_run"}
    if unknown:
        raise ValueError(f"unknown benchmark options {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    quick = bool(cfg.get("quick", False))
    merged = dict(DEFAULTS)
    if quick:
        merged.update(QUICK)
    if cfg.pop("dry_run", False):
        merged.update(DRY_RUN)
    merged.update(cfg)
    merged["schedules"] = _schedule_list(merged["schedule"])
    if merged["max_steps"] is None:
        merged["max_steps"] = 10 * merged["steps"]
    if merged["batch"] % merged["microbatches"] != 0:
        raise ValueError(
            f"batch={merged['batch']} is not divisible by microbatches={merged['microbatches']}: equal "
            f"microbatches are needed for torch's scale_grads and ours to compute the same gradient."
        )
    if merged["microbatches"] < WORLD_SIZE:
        raise ValueError(f"microbatches={merged['microbatches']} must be >= {WORLD_SIZE} (pipeline size)")
    if "dualpipev" in merged["schedules"] and merged["microbatches"] < 2 * WORLD_SIZE:
        raise ValueError(f"dualpipev needs microbatches >= {2 * WORLD_SIZE} (2 * pipeline size)")
    if merged["blocks"] < WORLD_SIZE * max(VP[s] for s in merged["schedules"]):
        raise ValueError(f"blocks={merged['blocks']}: every virtual stage needs a block; use blocks >= "
                         f"{WORLD_SIZE * max(VP[s] for s in merged['schedules'])}")
    for key in ("steps", "block_size", "hidden", "blocks", "batch", "ffn_mult"):
        if merged[key] < 1:
            raise ValueError(f"{key}={merged[key]} must be >= 1")
    return merged


def _code_version() -> str:
    """Where ``lightning_pp`` is imported from, and its git commit (+ "dirty" if its files have
    uncommitted changes): the runtime is edited concurrently, so results must say what ran."""
    import subprocess

    import lightning_pp

    root = os.path.dirname(os.path.dirname(os.path.abspath(lightning_pp.__file__)))
    try:
        commit = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return root
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "lightning_pp"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return f"{root} @ {commit.stdout.strip()}{' + uncommitted changes' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return root


def run(args: Any = None) -> dict:
    """Run the benchmark (spawns the processes) and return its figures.

    ``args``: an ``argparse.Namespace`` from :func:`parse_args`, a dict of options (keys of
    ``DEFAULTS``), or None for the defaults. The result holds, per schedule ``s`` run,
    ``ratio_vs_torch_<s>``, ``median_ms_{ours,torch}_<s>``, ``iqr_ms_{ours,torch}_<s>``, the
    step-1 check, plus ``config`` and the raw ``times_ms``; over all schedules run,
    ``best_ours``, ``best_torch`` and ``ratio_best_vs_torch_best``.
    """
    import torch

    cfg = _config(args)
    started = time.monotonic()
    load_before = _wait_quiet(cfg["wait_quiet"]) if cfg["wait_quiet"] > 0 else None
    raw = _launch(cfg)
    out: dict[str, Any] = {
        "config": {k: cfg[k] for k in DEFAULTS}
        | {"torch": torch.__version__, "world_size": WORLD_SIZE, "lightning_pp": _code_version()},
        "times_ms": {},
        "load_before_start": load_before,
    }
    for s in cfg["schedules"]:
        res = raw[s]
        ours, theirs = _summary(res["times"]["ours"]), _summary(res["times"]["torch"])
        out[f"median_ms_ours_{s}"] = ours["median"]
        out[f"median_ms_torch_{s}"] = theirs["median"]
        out[f"iqr_ms_ours_{s}"] = ours["iqr"]
        out[f"iqr_ms_torch_{s}"] = theirs["iqr"]
        out[f"ratio_vs_torch_{s}"] = ours["median"] / theirs["median"]
        # Per round, ratio of the block medians: robust to slow drifts of the machine's speed.
        by_round: dict[int, dict[str, float]] = {}
        for r, name, block in res["blocks"]:
            by_round.setdefault(r, {})[name] = statistics.median(block)
        paired = [v["ours"] / v["torch"] for v in by_round.values() if len(v) == 2]
        out[f"paired_ratio_vs_torch_{s}"] = statistics.median(paired)
        # The same figures over the steps during which no other process used the CPUs.
        clean = {
            name: [t for t, f in zip(res["times"][name], res["foreign"][name]) if f < CONTENDED]
            for name in ("ours", "torch")
        }
        out[f"contended_steps_{s}"] = sum(len(res["times"][n]) - len(clean[n]) for n in clean)
        if all(len(v) >= 5 for v in clean.values()):
            out[f"clean_median_ms_ours_{s}"] = _summary(clean["ours"])["median"]
            out[f"clean_median_ms_torch_{s}"] = _summary(clean["torch"])["median"]
            out[f"clean_ratio_vs_torch_{s}"] = out[f"clean_median_ms_ours_{s}"] / out[f"clean_median_ms_torch_{s}"]
        out[f"loss_rel_diff_{s}"] = res["check"]["loss_rel_diff"]
        out[f"grad_rel_diff_{s}"] = res["check"]["grad_rel_diff"]
        out[f"summary_{s}"] = {"ours": ours, "torch": theirs, "layout": res["layout"], "check": res["check"]}
        out["times_ms"][s] = {k: [t * 1e3 for t in v] for k, v in res["times"].items()}
        out.setdefault("foreign_cores", {})[s] = res["foreign"]
    _best_of_each(out, raw, cfg["schedules"])
    out["wall_s"] = time.monotonic() - started
    return out


def _best_of_each(out: dict, raw: dict, schedules: list[str]) -> None:
    """``ratio_best_vs_torch_best``: our fastest schedule against torch's fastest, from their
    head-to-head run (see ``_head_to_head``); ``..._across`` is the same from the per-schedule
    medians (and ``clean_...`` over the uncontended steps where every schedule has them)."""
    for prefix in ("", "clean_"):
        if not all(f"{prefix}median_ms_ours_{s}" in out for s in schedules):
            continue
        best = {name: min(schedules, key=lambda s, n=name: out[f"{prefix}median_ms_{n}_{s}"]) for name in ("ours", "torch")}
        out[f"{prefix}best_ours_across"], out[f"{prefix}best_torch_across"] = best["ours"], best["torch"]
        out[f"{prefix}ratio_best_vs_torch_best_across"] = (
            out[f"{prefix}median_ms_ours_{best['ours']}"] / out[f"{prefix}median_ms_torch_{best['torch']}"]
        )
    if "head_to_head" not in raw:
        out["best_ours"], out["best_torch"] = out["best_ours_across"], out["best_torch_across"]
        out["ratio_best_vs_torch_best"] = out["ratio_best_vs_torch_best_across"]
        return
    h = raw["head_to_head"]
    ours, theirs = _summary(h["times"]["ours"]), _summary(h["times"]["torch"])
    by_round: dict[int, dict[str, float]] = {}
    for r, name, block in h["blocks"]:
        by_round.setdefault(r, {})[name] = statistics.median(block)
    out["best_ours"], out["best_torch"] = h["best"]["ours"], h["best"]["torch"]
    out["head_to_head"] = {"ours": ours, "torch": theirs}
    out["ratio_best_vs_torch_best"] = ours["median"] / theirs["median"]
    out["paired_ratio_best_vs_torch_best"] = statistics.median(
        v["ours"] / v["torch"] for v in by_round.values() if len(v) == 2)
    out["contended_steps_head_to_head"] = sum(f >= CONTENDED for v in h["foreign"].values() for f in v)


def format_report(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"lightning_pp vs torch.distributed.pipelining (torch {cfg['torch']}), {cfg['world_size']} processes, gloo, CPU",
        f"lightning_pp from {cfg.get('lightning_pp', '?')}",
        f"model: linear {cfg['hidden']}->{cfg['hidden']}, {cfg['blocks']} x residual MLP "
        f"(LayerNorm, {cfg['hidden']}->{cfg['ffn_mult'] * cfg['hidden']}->{cfg['hidden']}, GELU), linear; float32",
        f"batch {cfg['batch']}, {cfg['microbatches']} microbatches, SGD; >= {cfg['steps']} measured steps per "
        f"implementation (+{cfg['warmup']} warm-up), alternating blocks of {cfg['block_size']}"
        + (f", until {cfg['min_clean']} uncontended (max {cfg['max_steps']})" if cfg["min_clean"] else ""),
        "CPU load by other processes just before the start: "
        + ("n/a" if result.get("load_before_start") is None else f"{result['load_before_start']:.2f} cores"),
        "",
        f"{'schedule':<12} {'impl':<6} {'n':>4} {'median ms':>10} {'q25':>9} {'q75':>9} {'IQR':>8} {'min':>9}   "
        f"{'ratio ours/torch':>16} {'paired':>7}   step-1 check",
    ]
    for s in SCHEDULES:
        if f"summary_{s}" not in result:
            continue
        summ = result[f"summary_{s}"]
        for name in ("ours", "torch"):
            st = summ[name]
            extra = ""
            if name == "ours":
                ch = summ["check"]
                extra = (
                    f"   {result[f'ratio_vs_torch_{s}']:>16.3f} {result[f'paired_ratio_vs_torch_{s}']:>7.3f}   "
                    f"loss {ch['loss_ours']:.6f} vs {ch['loss_torch']:.6f} (rel {ch['loss_rel_diff']:.1e}), "
                    f"grads rel {ch['grad_rel_diff']:.1e}"
                )
            lines.append(
                f"{s:<12} {name:<6} {st['n']:>4} {st['median']:>10.2f} {st['q25']:>9.2f} {st['q75']:>9.2f} "
                f"{st['iqr']:>8.2f} {st['min']:>9.2f}{extra}"
            )
        lines.append(f"{'':<12} layout (layers per virtual stage): {summ['layout']}")
        n_steps = sum(st["n"] for st in (summ["ours"], summ["torch"]))
        contended = result[f"contended_steps_{s}"]
        note = f"{'':<12} {contended}/{n_steps} steps contended (other processes used > {CONTENDED} core)"
        if f"clean_ratio_vs_torch_{s}" in result:
            note += (
                f"; uncontended steps only: ours {result[f'clean_median_ms_ours_{s}']:.2f} ms, torch "
                f"{result[f'clean_median_ms_torch_{s}']:.2f} ms, ratio {result[f'clean_ratio_vs_torch_{s}']:.3f}"
            )
        lines.append(note)
    lines.append("")
    for s in SCHEDULES:
        if f"ratio_vs_torch_{s}" not in result:
            continue
        for key in (
            f"median_ms_ours_{s}",
            f"median_ms_torch_{s}",
            f"iqr_ms_ours_{s}",
            f"iqr_ms_torch_{s}",
            f"paired_ratio_vs_torch_{s}",
            f"contended_steps_{s}",
            f"clean_ratio_vs_torch_{s}",
            f"ratio_vs_torch_{s}",
        ):
            if key in result:
                lines.append(f"{key}: {result[key]:.4f}" if isinstance(result[key], float) else f"{key}: {result[key]}")
    for prefix in ("clean_", ""):
        if f"{prefix}ratio_best_vs_torch_best_across" in result:
            lines.append(f"by the medians above: {prefix}best_ours_across {result[f'{prefix}best_ours_across']}, "
                         f"{prefix}best_torch_across {result[f'{prefix}best_torch_across']}, "
                         f"{prefix}ratio_best_vs_torch_best_across: {result[f'{prefix}ratio_best_vs_torch_best_across']:.4f}")
    if "head_to_head" in result:
        h = result["head_to_head"]
        lines.append(f"head to head, alternating: ours {result['best_ours']} {h['ours']['median']:.2f} ms (IQR "
                     f"{h['ours']['iqr']:.2f}) vs torch {result['best_torch']} {h['torch']['median']:.2f} ms (IQR "
                     f"{h['torch']['iqr']:.2f}), {result['contended_steps_head_to_head']}/"
                     f"{h['ours']['n'] + h['torch']['n']} steps contended")
        lines.append(f"paired_ratio_best_vs_torch_best: {result['paired_ratio_best_vs_torch_best']:.4f}")
    lines.append(f"best_ours: {result['best_ours']}")
    lines.append(f"best_torch: {result['best_torch']}")
    lines.append(f"ratio_best_vs_torch_best: {result['ratio_best_vs_torch_best']:.4f}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, help=f"hidden size (default {DEFAULTS['hidden']})")
    p.add_argument("--blocks", type=int, help=f"residual MLP blocks (default {DEFAULTS['blocks']})")
    p.add_argument("--ffn-mult", dest="ffn_mult", type=int, help=f"MLP expansion (default {DEFAULTS['ffn_mult']})")
    p.add_argument("--batch", type=int, help=f"batch size, divisible by --microbatches (default {DEFAULTS['batch']})")
    p.add_argument("--microbatches", type=int, help=f"microbatches per step (default {DEFAULTS['microbatches']})")
    p.add_argument("--steps", type=int, help=f"measured steps per implementation "
                   f"(default {DEFAULTS['steps']}, quick {QUICK['steps']})")
    p.add_argument("--warmup", type=int, help=f"warm-up steps per implementation (default {DEFAULTS['warmup']})")
    p.add_argument("--block-size", dest="block_size", type=int, help=f"steps per alternation block "
                   f"(default {DEFAULTS['block_size']})")
    p.add_argument("--schedule", help=f"'all' (default), 'both' (1f1b and interleaved) or a comma-separated list of "
                   f"{', '.join(SCHEDULES)}")
    p.add_argument("--quick", action="store_true", default=None, help="few steps: a smoke test, not a measurement")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", default=None,
                   help="tiny model, one step of every schedule: checks the code paths (used by the tests)")
    p.add_argument("--lr", type=float, help=f"SGD learning rate (default {DEFAULTS['lr']})")
    p.add_argument("--seed", type=int, help=f"weights/data seed (default {DEFAULTS['seed']})")
    p.add_argument(
        "--wait-quiet",
        dest="wait_quiet",
        type=float,
        help=f"wait up to this many seconds for the other processes to leave the CPUs idle before starting "
        f"(default {DEFAULTS['wait_quiet']:.0f}; 0 = start at once)",
    )
    p.add_argument(
        "--min-clean",
        dest="min_clean",
        type=int,
        help="after --steps, keep measuring until each implementation has this many steps during which no "
        "other process used the CPUs (default 0: off)",
    )
    p.add_argument("--max-steps", dest="max_steps", type=int, help="cap for --min-clean (default 10 * steps)")
    p.add_argument("--timeout", type=float, help=f"kill the run after this many seconds (default {DEFAULTS['timeout']:.0f})")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    result = run(parse_args(argv))
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
