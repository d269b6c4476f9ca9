"""What seeing the pipeline costs: step time with timeline recording and the PipelineMonitor on vs off.

Three measurements on 2 gloo processes (pp=2, 1F1B; model: input linear, ``--blocks`` residual MLP
blocks of width ``--hidden`` (4x expansion), output linear; float32; batch ``--batch`` in
``--microbatches``):

1. **Recording** (runtime only, no Lightning): a step is ``zero_grad`` + ``executor.train_step`` +
   ``SGD.step``, timed after a barrier, the step time being the maximum over the ranks. Rounds of
   two blocks of ``--block-size`` steps, one with ``executor.timeline.enabled = True`` and one with
   ``False`` (which goes first alternates), ``--steps`` steps per setting. ``timeline_overhead`` =
   the median over rounds of median(on block) / median(off block), minus 1.
2. **Recording cost per span**, timed in-process: ``Timeline.span`` around an empty body (on minus
   off), times the spans of one step; ``timeline_bound`` = that / median step time is the
   recording cost without the noise of whole steps.
3. **Callback** (Trainer fit): ``PipelineMonitor(every_n_steps=10)`` (no files) together with
   recording, switched on and off for alternating blocks of 10 batches (so every "on" block holds
   one gather), ``--fit-rounds`` rounds after a warm-up block; a batch's time runs from one
   ``on_train_batch_end`` to the next. ``monitor_overhead`` compares block means (not medians:
   the gather every 10th batch is part of the cost). Directly:
   ``monitor_hook_fraction`` = time spent inside the monitor's hooks (gathers, analysis, marks)
   / time of the batches it was on for.

Other jobs on the machine's 2 cores distort all of this. Each block measures the CPU that
processes other than the benchmark used meanwhile (from ``/proc/stat``); rounds in which a block
saw more than 0.25 cores of it are left out when at least 3 clean rounds remain (``*_rounds_clean``
says how many were clean). ``*_noise_floor`` is the same paired comparison between the "off"
blocks of consecutive rounds: overheads below it are noise. ``--wait-quiet S`` first waits up to S seconds for
an idle machine.

Usage::

    python benchmarks/bench_monitor_overhead.py --wait-quiet 120     # hidden 512, ~1.5 minutes
    python benchmarks/bench_monitor_overhead.py --quick              # smoke test

Prints ``name: value`` lines, the last one ``monitor_overhead: <fraction>``; ``run(args)`` returns
the figures as a dict.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch  # noqa: E402
from lightning_pp.runtime import executor_of

WORLD_SIZE = 2
DEFAULTS = {
    "hidden": 512,
    "blocks": 6,
    "batch": 256,
    "microbatches": 4,
    "steps": 48,
    "block_size": 3,
    "warmup": 3,
    "fit_rounds": 8,
    "every_n_steps": 10,
    "timeout": 900.0,
    "wait_quiet": 0.0,
    "quick": False,
}
CONTENDED = 0.25  # a block during which other processes used more cores than this is left out
QUICK = {"steps": 6, "block_size": 3, "warmup": 1, "fit_rounds": 2, "hidden": 256}


# -- model ------------------------------------------------------------------------------------------
def _model(hidden: int, blocks: int, lightning: bool):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    base = nn.Module
    if lightning:
        import lightning as L

        base = L.LightningModule

    class Model(base):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(hidden, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.head = nn.Linear(hidden, hidden)

        def pipeline_layers(self):
            return [self.embed, *self.blocks, self.head]

        def pipeline_loss(self, output, batch):
            return F.mse_loss(output, batch[1])

        def training_step(self, batch, batch_idx):  # single-device form; the strategy pipelines it
            x = batch[0]
            for layer in self.pipeline_layers():
                x = layer(x)
            return self.pipeline_loss(x, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return Model()


def _data(cfg: dict, n: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(n, cfg["hidden"], generator=g), torch.randn(n, cfg["hidden"], generator=g)


# -- 1 + 2: the runtime alone ----------------------------------------------------------------------
def _timed_step(executor, optimizer, batch) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    executor.train_step(batch)
    optimizer.step()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _span_cost_seconds(repeats: int = 20000) -> float:
    """Seconds one ``Timeline.span`` adds around an empty body (recording on minus off)."""
    from lightning_pp.runtime.timeline import Timeline

    def loop(timeline) -> float:
        timeline.begin_step()
        start = time.perf_counter()
        for i in range(repeats):
            with timeline.span("F", i, 0):
                pass
        return time.perf_counter() - start

    on, off = Timeline(enabled=True), Timeline(enabled=False)
    best_on = min(loop(on) for _ in range(5))
    best_off = min(loop(off) for _ in range(5))
    return max(0.0, best_on - best_off) / repeats


def _runtime_part(cfg: dict, rank: int) -> dict:
    import torch
    from lightning_pp.runtime import build_pipeline

    executor = build_pipeline(_model(cfg["hidden"], cfg["blocks"], lightning=False), pipeline_parallel_size=WORLD_SIZE,
                              num_microbatches=cfg["microbatches"], schedule="1f1b")
    optimizer = torch.optim.SGD([p for p in executor.module.parameters()], lr=1e-3)
    batch = _data(cfg, cfg["batch"])
    for _ in range(cfg["warmup"]):
        _timed_step(executor, optimizer, batch)
    executor.timeline.enabled = True
    _timed_step(executor, optimizer, batch)
    spans_per_step = len(executor.timeline.spans)
    blocks = []  # (round, recording on?, step times, foreign cores)
    rounds = -(-cfg["steps"] // cfg["block_size"])
    for round_index in range(rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for enabled in order:
            executor.timeline.enabled = enabled
            load = _Load()
            times = [_timed_step(executor, optimizer, batch) for _ in range(cfg["block_size"])]
            blocks.append((round_index, enabled, times, load.stop()))
    executor.timeline.enabled = True
    return {"blocks": blocks, "spans_per_step": spans_per_step,
            "span_cost_s": _span_cost_seconds() if rank == 0 else None}


# -- 3: the callback in a Trainer fit ------------------------------------------------------------------
def _fit_part(cfg: dict, rank: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineMonitor, PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    rounds = cfg["fit_rounds"]
    # One gather per "on" block: its last batch (the monitor analyses batches n-1, 2n-1, ...).
    block_size = cfg["every_n_steps"]
    batches = 2 * block_size * rounds + block_size  # a first block to warm up, then on/off pairs
    monitor = PipelineMonitor(every_n_steps=cfg["every_n_steps"], write_trace=False, write_png=False, prog_bar=False)
    # Time spent inside the monitor's own hooks (the gathers included), while it is on: its direct
    # cost, which other jobs on the machine blur much less than a whole-batch comparison.
    in_hooks = {"seconds": 0.0}

    def timed(method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if monitor.enabled and switch.block >= 0:  # not in the warm-up block
                    in_hooks["seconds"] += time.perf_counter() - start
        return wrapper

    for name in ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end", "_after_optimizer_step"):
        setattr(monitor, name, timed(getattr(monitor, name)))

    blocks: list = []  # (round, on?, batch times, foreign cores), like the runtime part

    class Switch(L.Callback):
        """Before each batch (first in the callback list): at a block boundary, close the last
        block's load measurement and switch the monitor and recording on or off for the next
        block; the same on every rank."""

        state = True
        load = None
        block = -1

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.global_step
            if step % block_size:
                return
            if self.load is not None and self.block >= 0:
                blocks.append((self.block // 2, self.state, list(times), self.load.stop()))
            times.clear()
            self.block = step // block_size - 1  # block -1: warm-up
            pair, second = divmod(self.block, 2)
            self.state = (second == 0) if pair % 2 == 0 else (second == 1)  # flip the order every pair
            monitor.enabled = self.state
            executor_of(pl_module).timeline.enabled = self.state
            self.load = _Load()

        def on_train_end(self, trainer, pl_module):
            if self.load is not None and self.block >= 0:
                blocks.append((self.block // 2, self.state, list(times), self.load.stop()))

    class Timer(L.Callback):
        """After each batch (last in the list, so after the monitor's gather): the batch's time."""

        last = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if self.last is not None:
                times.append(now - self.last)
            self.last = now

    times: list = []
    switch = Switch()
    x, y = _data(cfg, cfg["batch"] * block_size)  # one epoch = one block; epochs repeat the data
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, max_steps=batches, callbacks=[switch, monitor, Timer()],
        strategy=PipelineStrategy(pipeline_parallel_size=WORLD_SIZE, num_microbatches=cfg["microbatches"]),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    model = _model(cfg["hidden"], cfg["blocks"], lightning=True)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=cfg["batch"]))
    return {"blocks": blocks, "gathers": len(monitor.history),
            "bubble": monitor.history[-1]["pipeline/bubble"] if monitor.history else None,
            "hook_seconds": in_hooks["seconds"],
            "on_seconds": sum(sum(t) for _, on, t, _ in blocks if on),
            "on_batches": sum(len(t) for _, on, t, _ in blocks if on)}


# -- processes ---------------------------------------------------------------------------------------
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_seconds() -> Optional[float]:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


class _Load:
    """CPU cores that processes other than the benchmark's own used from construction to
    :meth:`stop` (collective: every rank calls ``stop``). About 0 on a quiet machine, about 1 when
    another job took a core; coarse (10 ms ticks), so measured over whole blocks of steps."""

    def __init__(self) -> None:
        self.busy = _machine_busy_seconds()
        self.cpu = time.process_time()
        self.start = time.perf_counter()

    def stop(self) -> Optional[float]:
        import torch
        import torch.distributed as dist

        own = torch.tensor([time.process_time() - self.cpu], dtype=torch.float64)
        dist.all_reduce(own)
        busy, wall = _machine_busy_seconds(), time.perf_counter() - self.start
        if self.busy is None or busy is None or wall <= 0:
            return None
        return max(0.0, (busy - self.busy - float(own[0])) / wall)


def _measure(rank: int, world: int, cfg: dict) -> dict:
    return {"runtime": _runtime_part(cfg, rank), "fit": _fit_part(cfg, rank)}


def _launch(cfg: dict) -> list:
    return launch(_measure, WORLD_SIZE, cfg, timeout=cfg["timeout"])


def _compare(blocks: list, statistic) -> dict:
    """Paired comparison: per round, statistic(on block) / statistic(off block); the overhead is the
    median of these ratios minus 1, over the rounds in which neither block was contended (all
    rounds if fewer than 3 are clean). The noise floor is the same figure for identical settings:
    the median of |off(r) / off(r + 1) - 1| over consecutive rounds used."""
    by_round: dict = {}
    for round_index, enabled, times, foreign in blocks:
        by_round.setdefault(round_index, {})[enabled] = (times, foreign)
    complete = {r: b for r, b in sorted(by_round.items()) if True in b and False in b and b[True][0] and b[False][0]}
    clean = {r: b for r, b in complete.items() if all(f is not None and f < CONTENDED for _, f in b.values())}
    used = clean if len(clean) >= 3 else complete
    ratios = [statistic(b[True][0]) / statistic(b[False][0]) for b in used.values()]
    offs = [statistic(b[False][0]) for b in used.values()]
    floor = [abs(a / b - 1) for a, b in zip(offs, offs[1:])]
    foreign = [f for b in complete.values() for _, f in b.values() if f is not None]
    return {
        "on": statistic([t for b in used.values() for t in b[True][0]]),
        "off": statistic([t for b in used.values() for t in b[False][0]]),
        "overhead": statistics.median(ratios) - 1,
        "noise_floor": statistics.median(floor) if floor else None,
        "rounds": len(complete),
        "clean_rounds": len(clean),
        "steps_per_setting": sum(len(b[True][0]) for b in used.values()),
        "foreign_cores_mean": statistics.mean(foreign) if foreign else None,
    }


def run(args: Any = None) -> dict:
    """Run the benchmark; ``args`` is an argparse namespace or dict overriding :data:`DEFAULTS`."""
    cfg = dict(DEFAULTS)
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    if given.get("quick"):
        cfg.update(QUICK)
    cfg.update({k: v for k, v in given.items() if v is not None and k in DEFAULTS and k != "quick"})
    if cfg["wait_quiet"] > 0:
        _wait_quiet(cfg["wait_quiet"])
    results = _launch(cfg)
    runtime, fit = results[0]["runtime"], results[0]["fit"]  # step times are already max over ranks
    recording = _compare(runtime["blocks"], statistics.median)
    callback = _compare(fit["blocks"], statistics.mean)
    return {
        "config": {k: cfg[k] for k in ("hidden", "blocks", "batch", "microbatches", "steps", "block_size",
                                       "fit_rounds", "every_n_steps")},
        "step_ms_recording_off": recording["off"] * 1e3,
        "step_ms_recording_on": recording["on"] * 1e3,
        "timeline_overhead": recording["overhead"],
        "timeline_noise_floor": recording["noise_floor"],
        "timeline_rounds_clean": f"{recording['clean_rounds']}/{recording['rounds']}",
        "spans_per_step": runtime["spans_per_step"],
        "span_cost_us": runtime["span_cost_s"] * 1e6,
        "timeline_bound": runtime["spans_per_step"] * runtime["span_cost_s"] / recording["off"],
        "fit_batch_ms_off": callback["off"] * 1e3,
        "fit_batch_ms_on": callback["on"] * 1e3,
        "monitor_noise_floor": callback["noise_floor"],
        "monitor_rounds_clean": f"{callback['clean_rounds']}/{callback['rounds']}",
        "monitor_batches_per_setting": callback["steps_per_setting"],
        "monitor_gathers": fit["gathers"],
        "monitor_last_bubble": fit["bubble"],
        "monitor_hook_ms_per_batch": fit["hook_seconds"] / max(1, fit["on_batches"]) * 1e3,
        "monitor_hook_fraction": fit["hook_seconds"] / fit["on_seconds"] if fit["on_seconds"] else None,
        "foreign_cores_mean": _mean_of(recording["foreign_cores_mean"], callback["foreign_cores_mean"]),
        "monitor_overhead": callback["overhead"],
    }


def _mean_of(*values) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def _wait_quiet(max_wait: float, window: float = 2.0, threshold: float = 0.2) -> None:
    """Wait up to ``max_wait`` seconds for a ``window`` in which the machine used < ``threshold`` cores."""
    deadline = time.monotonic() + max_wait
    while time.monotonic() < deadline:
        before, start = _machine_busy_seconds(), time.monotonic()
        time.sleep(window)
        after = _machine_busy_seconds()
        if before is None or after is None or (after - before) / (time.monotonic() - start) < threshold:
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in DEFAULTS.items():
        if name == "quick":
            parser.add_argument("--quick", action="store_true", help="small and short: a smoke test")
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(default), default=None,
                                help=f"default {default}")
    args = parser.parse_args()
    out = run(args)
    print("command: python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))
    print("config: " + " ".join(f"{k}={v}" for k, v in out.pop("config").items()))
    monitor_overhead = out.pop("monitor_overhead")
    for name, value in out.items():
        print(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")
    print(f"monitor_overhead: {monitor_overhead:.4f}")


if __name__ == "__main__":
    main()
