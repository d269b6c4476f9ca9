"""GPU figures of the fine-grained path, on one CUDA device (run by ``scripts/gpu_check.sh``).

1. ``plan_overhead``: a step of a dense model (``--layers`` residual MLP blocks of width
   ``--width``, batch ``--batch``) run node by node through the runtime's schedule plan (what
   combined 1F1B does), over the same step in plain autograd: the cost of the node machinery
   (detaching, events, the comm stream's waits) on the device.
2. ``comm_overlap``: two microbatches through a layer whose communication nodes run on the
   comm stream (a fixed device-side delay, ``torch.cuda._sleep``, stands for an all-to-all) while
   the other microbatch's compute nodes run on the compute stream. The fused step
   (``ChunkSchedulePlan.run(f, b)``) against the two run one after the other: the fraction of the
   emulated communication hidden behind compute (1 = all of it).
3. ``gpu_compile_step_ratio``: the main job's model (``examples/train_moe_gpt.py``'s defaults,
   16 sequences of 64 bytes) on the one device, forward and backward, with every pipeline layer
   compiled as ``compile=True`` compiles it (an MoE block by its parts) over eager: the figure that
   does not pay on a 2-core CPU (BENCHMARKS.md, issue 23), measured where each eager kernel is a
   launch. ``gpu_compile_first_step_s``: the first compiled step, compilation included.

Medians of ``--steps`` CUDA-event-timed repetitions after a warm-up. Prints ``name: value`` lines.
Not measured yet (no CUDA device has been available to this project); ``scripts/gpu_check.sh`` runs
it on the first machine with one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_compile_pipeline's main-job model

import torch  # noqa: E402
from torch import nn  # noqa: E402


DEVICE = "cuda"


def _timed(fn, steps: int) -> float:
    times = []
    for _ in range(steps + 2):
        if DEVICE != "cuda":  # --dry-run: the code paths on the CPU, host-timed
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[2:])


def _sleep(cycles: int) -> None:
    if DEVICE == "cuda":
        torch.cuda._sleep(cycles)


def plan_overhead(args) -> float:
    from lightning_pp.runtime.plans.nodes import ChunkSchedulePlan
    from lightning_pp.runtime.plans.plan import set_streams

    set_streams(high_priority=True)
    layers = [nn.Sequential(nn.Linear(args.width, 4 * args.width), nn.GELU(), nn.Linear(4 * args.width, args.width))
              .to(DEVICE) for _ in range(args.layers)]
    x = torch.randn(args.batch, args.width, device=DEVICE)

    def plain():
        h = x
        for layer in layers:
            h = h + layer(h)
        h.sum().backward()

    def nodes():
        plan = ChunkSchedulePlan([_Residual(layer) for layer in layers])
        (h,) = plan.forward((x,))
        plan.backward((torch.ones_like(h),))

    return _timed(nodes, args.steps) / _timed(plain, args.steps) - 1


class _Residual(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h):
        return h + self.layer(h)


class _SleepyExchange(nn.Module):
    """Compute (a matmul) around two emulated exchanges on the comm stream."""

    def __init__(self, width: int, cycles: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width, device=DEVICE) / width ** 0.5)
        self.cycles = cycles

    def schedule_nodes(self, event):
        from lightning_pp.runtime.plans.nodes import LayerNodes
        from lightning_pp.runtime.plans.plan import ScheduleNode, get_comm_stream, get_comp_stream

        def compute(x):
            return torch.tanh(x @ self.w)

        def exchange(x):
            _sleep(self.cycles)
            return x.detach().clone()

        def exchange_back(g):
            _sleep(self.cycles)
            return g.clone()

        comm = lambda name: ScheduleNode(exchange, get_comm_stream, event, exchange_back, name=name)  # noqa: E731
        return LayerNodes(ScheduleNode(compute, get_comp_stream, event, name="attn"), comm("dispatch"),
                          ScheduleNode(compute, get_comp_stream, event, name="mlp"), comm("combine"),
                          ScheduleNode(compute, get_comp_stream, event, name="post"))


def comm_overlap(args) -> float:
    from lightning_pp.runtime.plans.nodes import ChunkSchedulePlan
    from lightning_pp.runtime.plans.plan import set_streams

    set_streams(high_priority=True)
    layers = [_SleepyExchange(args.width, args.sleep_cycles) for _ in range(args.layers)]
    x = torch.randn(args.batch, args.width, device=DEVICE)

    def prepare():
        first = ChunkSchedulePlan(layers)
        (y,) = first.forward((x,))
        return first, torch.ones_like(y)

    def sequential():
        first, g = prepare()
        second = ChunkSchedulePlan(layers)
        second.forward((x,))
        first.backward((g,))

    def fused():
        first, g = prepare()
        second = ChunkSchedulePlan(layers)
        ChunkSchedulePlan.run(second, first, grad=(g,), pre_forward=lambda: (x,))

    def comm_only():
        for _ in range(4 * args.layers):
            _sleep(args.sleep_cycles)

    t_seq, t_fused, t_comm = _timed(sequential, args.steps), _timed(fused, args.steps), _timed(comm_only, args.steps)
    return max(0.0, min(1.0, (t_seq - t_fused) / t_comm)) if t_comm > 0 else 0.0


def compile_step(args) -> dict:
    import copy

    from bench_compile_pipeline import main_job_model
    from lightning_pp.runtime.compile.layers import compile_layer, compile_targets

    torch.manual_seed(0)
    eager = main_job_model()().to(DEVICE)
    compiled = copy.deepcopy(eager)
    for layer in compiled.pipeline_layers():
        for part in compile_targets(layer):  # as compile=True does: an MoE block by its parts
            compile_layer(part, "aot_eager" if DEVICE == "cpu" else "inductor", split=False)
    tokens = torch.randint(0, 256, (16, 65), device=DEVICE)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model.pipeline_loss(model(batch[0]), batch).backward()

        return run

    begin = time.perf_counter()
    step(compiled)()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - begin
    ratios = [_timed(step(compiled), args.steps) / _timed(step(eager), args.steps) for _ in range(3)]
    return {"gpu_compile_step_ratio": statistics.median(ratios), "gpu_compile_first_step_s": first}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sleep-cycles", type=int, default=2_000_000)
    p.add_argument("--dry-run", action="store_true", help="run the code paths on the CPU, tiny sizes (no figures)")
    args = p.parse_args(argv)
    global DEVICE
    if args.dry_run:
        DEVICE, args.width, args.batch, args.layers, args.steps = "cpu", 16, 8, 2, 1
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA device, nothing measured")
        return {}
    figures = {}
    for name, fn in (("plan_overhead", plan_overhead), ("comm_overlap", comm_overlap), ("gpu_compile_step_ratio", compile_step)):
        try:
            value = fn(args)
        except Exception as exc:  # report and go on: the other figures may still be measurable
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        for key, number in (value.items() if isinstance(value, dict) else [(name, value)]):
            figures[key] = number
            print(f"{key}: {number:.4f}", flush=True)
    return figures


if __name__ == "__main__":
    main()
