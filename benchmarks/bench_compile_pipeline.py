"""``compile=`` through the whole pipeline (issue 23), three figures from one run:

* ``compile_step_ratio``: the main job's model (``examples/train_moe_gpt.py``: byte-level MoE GPT,
  6 blocks, hidden 64, 4 experts, context 64; pp=2 x ep=2, two chunks per rank, combined 1F1B, 4
  microbatches, 16 sequences per step, AdamW) on 4 gloo processes, compiled (``compile=True``,
  inductor) over eager, same weights, steps in alternating blocks after warm-up (step time: max
  over ranks; per round the median of a block; the ratio: the median of the rounds' ratios).
  ``compile_first_step_s``: the first compiled step, compilation included.
* ``ratio_vs_torch_compiled_1f1b``: ours with ``compile=True`` against
  ``torch.distributed.pipelining``'s ``Schedule1F1B`` with every layer of its stages compiled
  (``torch.compile(layer)``, torchtitan's recipe), the model of ``bench_vs_torch.py`` on 2
  processes, alternating blocks, medians; the same four ways eager and compiled side by side
  (``ratio_vs_torch_eager_1f1b``, ``mlp_compile_step_ratio_ours`` / ``_torch``).
* The first two again with glibc's heap kept (``..._heap_kept``): the processes start with
  ``MALLOC_MMAP_THRESHOLD_`` (32 MiB) and ``MALLOC_TRIM_THRESHOLD_`` (1 GiB) set, so blocks up to
  32 MiB come from the heap and freed memory stays in the process. By default glibc serves every
  block above a threshold (128 KiB, raised as such blocks are freed) with fresh pages from the OS
  and returns the heap's free top at each free: a compiled graph, which allocates its buffers at
  every call, pays those page faults again and again (measured on one 512-wide MLP block, fw + bw:
  compiled 1.04-1.45x eager by default, 1.00-1.12x with the heap kept).
* ``recompiles_after_warmup``: 50 steps of a token model (embedding, residual blocks, head) at
  pp=2 under ``zb1p`` with sequence lengths drawn from 16-64 every step and a short last batch
  (10 of 16 sequences, 4 microbatches: 3, 3, 2, 2), counted by the executor's ``compile_watch``
  after its two warm-up steps. The stated bound is 0 here (no microbatch of one sample).

    OMP_NUM_THREADS=1 python benchmarks/bench_compile_pipeline.py [--rounds 12] [--no-heap-kept]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import sys
import time
from pathlib import Path

from common import launch, max_over_ranks

ROOT = Path(__file__).resolve().parents[1]
#: glibc's malloc keeping its heap (see the module docstring); read when a process starts.
HEAP_KEPT = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def main_job_model():
    """The main job's model class (``examples/train_moe_gpt.py``'s ``MoEGPT``)."""
    spec = importlib.util.spec_from_file_location("train_moe_gpt", ROOT / "examples" / "train_moe_gpt.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job.MoEGPT


def _timed(step) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    step()
    return max_over_ranks(time.perf_counter() - start)


def _alternate(steps: dict, rounds: int, block: int) -> tuple:
    """Steps in alternating blocks (the order reversed every round): the medians over all steps,
    and the per-round medians (for ratios paired round by round, which drift on a shared machine
    does not bias)."""
    per_round = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            per_round[name].append(statistics.median(_timed(steps[name]) for _ in range(block)))
    return {name: statistics.median(values) for name, values in per_round.items()}, per_round


def _paired(per_round: dict, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))


def _paired_quartiles(per_round: dict, a: str, b: str) -> tuple:
    """The first and third quartiles of the per-round ratios: how far one run's rounds spread."""
    q = statistics.quantiles([x / y for x, y in zip(per_round[a], per_round[b])], n=4)
    return q[0], q[2]


def _trainer_step(executor, model, batch):
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        executor.train_step(batch)
        opt.step()

    return step


def _main_job(rank, world, args):
    import torch

    from lightning_pp.runtime import build_pipeline, build_topology

    torch.set_num_threads(1)
    topology = build_topology(2, 2)
    torch.manual_seed(0)
    eager = main_job_model()()
    compiled = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (16, 65), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    steps = {}
    for name, model, option in (("eager", eager, False), ("compiled", compiled, True)):
        executor = build_pipeline(model, pipeline_parallel_size=2, expert_parallel_size=2, virtual_pipeline_size=2,
                                  num_microbatches=4, schedule="combined_1f1b", topology=topology, compile=option)
        steps[name] = _trainer_step(executor, model, batch)
    first = _timed(steps["compiled"])
    for _ in range(args.warmup):
        steps["eager"](), steps["compiled"]()
    medians, rounds = _alternate(steps, args.rounds, args.block)
    q1, q3 = _paired_quartiles(rounds, "compiled", "eager")
    return {"compile_step_ratio": _paired(rounds, "compiled", "eager"), "compile_first_step_s": first,
            "compile_step_ratio_q1": q1, "compile_step_ratio_q3": q3,
            "eager_step_ms": 1e3 * medians["eager"], "compiled_step_ms": 1e3 * medians["compiled"]}


def _vs_torch(rank, world, args):
    import torch
    from torch import nn

    import bench_vs_torch as vs
    from lightning_pp.runtime import build_topology

    torch.set_num_threads(1)
    cfg = dict(seed=0, hidden=args.hidden, blocks=8, ffn_mult=4, microbatches=4, lr=1e-3, batch=args.batch)
    topology = build_topology(world)
    impls = {}
    for compiled in (False, True):
        ours = vs._Ours(cfg, "1f1b", topology, compile=compiled)
        theirs = vs._Torch(cfg, "1f1b", ours.layout, rank)
        if compiled:
            for stage in theirs.stage_modules.values():  # every layer compiled, as torchtitan compiles blocks
                for i, layer in enumerate(list(stage)):
                    stage[i] = torch.compile(layer)
        suffix = "_compiled" if compiled else "_eager"
        impls["ours" + suffix], impls["torch" + suffix] = ours, theirs
    assert all(isinstance(m, nn.Sequential) for m in theirs.stage_modules.values())
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g))
    steps = {name: (lambda impl=impl: impl.step(batch)) for name, impl in impls.items()}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    m, rounds = _alternate(steps, args.rounds, args.block)
    q1, q3 = _paired_quartiles(rounds, "ours_compiled", "torch_compiled")
    return {"ratio_vs_torch_compiled_1f1b": _paired(rounds, "ours_compiled", "torch_compiled"),
            "ratio_vs_torch_compiled_1f1b_q1": q1, "ratio_vs_torch_compiled_1f1b_q3": q3,
            "ratio_vs_torch_eager_1f1b": _paired(rounds, "ours_eager", "torch_eager"),
            "mlp_compile_step_ratio_ours": _paired(rounds, "ours_compiled", "ours_eager"),
            "mlp_compile_step_ratio_torch": _paired(rounds, "torch_compiled", "torch_eager"),
            **{f"{name}_1f1b_ms": 1e3 * value for name, value in m.items()}}


def _recompiles(rank, world, args):
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from models import TiedLM
    from lightning_pp.runtime import build_pipeline

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TiedLM(vocab=64, hidden=32, blocks=4)
    executor = build_pipeline(model, pipeline_parallel_size=2, num_microbatches=4, schedule="zb1p", compile=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for step in range(50):
        seq = int(torch.randint(16, 65, (1,), generator=g))
        rows = 10 if step % 10 == 9 else 16  # the last batch of every "epoch" of 10 steps is short
        tokens = torch.randint(0, 64, (rows, seq + 1), generator=g)
        executor.train_step((tokens[:, :-1], tokens[:, 1:]))
        opt.step()
        opt.zero_grad()
    metrics = executor.compile_watch.metrics("")
    return {"recompiles_after_warmup": float(max_over_ranks(metrics["recompiles_after_warmup"])),
            "compiled_graphs": float(max_over_ranks(metrics["compiled_graphs"]))}


def run(args) -> dict:
    out = {}
    out.update(launch(_main_job, 4, args, timeout=1800)[0])
    out.update(launch(_vs_torch, 2, args, timeout=1800)[0])
    if getattr(args, "heap_kept", True):
        for job, world in ((_main_job, 4), (_vs_torch, 2)):
            kept = launch(job, world, args, timeout=1800, env=HEAP_KEPT)[0]
            out.update({f"{name}_heap_kept": value for name, value in kept.items() if name != "compile_first_step_s"})
    out.update(launch(_recompiles, 2, args, timeout=1800)[0])
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=12, help="alternating rounds of --block steps each")
    p.add_argument("--block", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512, help="the bench_vs_torch model's width")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--no-heap-kept", dest="heap_kept", action="store_false",
                   help="skip the runs with glibc's heap kept")
    return p.parse_args(argv)


def main(argv=None) -> int:
    for name, value in run(parse_args(argv)).items():
        print(f"{name}: {value:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
