"""Sharded data parallelism inside the stages (``data_parallel_sharding="full"``): memory, step time,
reduce-scatter overlap, and torch.distributed.pipelining with FSDP2 stages (torchtitan's recipe).

pp=2 x dp=2 (4 gloo processes, one thread each), the residual-MLP model of ``bench_vs_torch.py``
made big enough that parameters, gradients and AdamW state dominate (``--hidden 768``: about 20 M
parameters, 80 MB in float32, per stage), the same weights in every implementation. Each
implementation runs in its own fresh processes, one after the other:

* ``unsharded``: ours, ``data_parallel_sharding="none"``, 1F1B;
* ``sharded``: ours, ``"full"``, 1F1B;
* ``sharded_vp2``: ours, ``"full"``, interleaved 1F1B with two chunks per rank (what the overlap
  figure is about: a chunk's reduce-scatter runs under the other chunk's backward);
* ``torch_fsdp``: ``torch.distributed.pipelining.Schedule1F1B`` over ``PipelineStage`` s whose
  modules are FSDP2 units (each block ``fully_shard``-ed over the stage's data-parallel mesh with
  ``reshard_after_forward=False``, then the stage module itself, as torchtitan does under
  pipelining); torch's stage turns off gradient sync until the last microbatch and reduce-scatters
  the stage's gradients after its last backward.

Figures (per rank, the maximum over ranks; times are medians over ``--steps`` steps after two
warm-up steps, each step timed between barriers as the slowest rank's):

* ``sharded_state_bytes_ratio``: bytes of parameters + gradients + optimizer state held after a
  step (the local shards' bytes), sharded over unsharded;
* ``sharded_peak_memory_ratio``: the process's peak resident memory over the timed steps
  (``VmHWM`` after ``/proc/self/clear_refs``, ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors
  leave), sharded over unsharded. What is gathered when: every chunk's parameters from the start
  of the step until that chunk's last backward, its gradients whole until then (as unsharded), so
  the peak keeps one whole copy of the stage's parameters and gradients; what sharding removes is
  the optimizer state's and the between-step copies;
* ``sharded_step_ratio``: step time sharded over unsharded;
* ``ratio_vs_torch_fsdp_1f1b`` and ``peak_memory_ratio_vs_torch_fsdp_1f1b``: ours sharded over
  torch's FSDP2 stages, step time and peak;
* ``reduce_scatter_hidden_fraction`` (at vp=2): ``1 - exposed / alone``, where ``exposed`` is the
  time the step is blocked waiting for its reduce-scatters (the timeline's ``reduce_scatter_wait``
  spans) and ``alone`` the time the same reduce-scatters take when run by themselves, blocking,
  right after the timed steps (same group, same sizes, median of 3).

    python benchmarks/bench_sharding.py
    python benchmarks/bench_sharding.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import launch  # noqa: E402

WORLD, PP = 4, 2
IMPLS = ("unsharded", "sharded", "sharded_vp2", "torch_fsdp")


def _model(cfg: dict):
    import torch
    import bench_vs_torch as peer

    torch.manual_seed(cfg["seed"])
    return peer._model_classes()(cfg["hidden"], cfg["blocks"], cfg["ffn_mult"])


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None or not hasattr(t, "numel"):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _state_bytes(params, opt) -> int:
    state = [v for s in opt.state.values() for v in s.values() if hasattr(v, "numel") and v.dim() > 0]
    return _local_bytes(params) + _local_bytes(p.grad for p in params) + _local_bytes(state)


class _Ours:
    def __init__(self, cfg: dict, topology, sharding: str, vp: int):
        import torch
        from lightning_pp.runtime import build_pipeline

        model = _model(cfg)
        self.executor = build_pipeline(model, pipeline_parallel_size=PP, virtual_pipeline_size=vp,
                                       num_microbatches=cfg["microbatches"], schedule="1f1b" if vp == 1 else "interleaved",
                                       topology=topology, data_parallel_sharding=sharding)
        self.params = [p for p in model.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.topology = topology

    def step(self, batch) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = float(self.executor.train_step(batch).loss)
        self.opt.step()
        return loss

    def exposed_and_alone(self) -> tuple[float, float]:
        """(mean seconds the last step waited for its reduce-scatters, the same ones alone)."""
        import torch.distributed as dist

        spans = self.executor.timeline.spans
        exposed = sum(s.end - s.start for s in spans if s.kind == "reduce_scatter_wait")
        buckets = [b for b in self.executor.grad_sync.buckets if getattr(b, "segment_elements", 0)]
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            for b in buckets:
                b.run_alone()
            times.append(time.perf_counter() - start)
        return exposed, statistics.median(times)


class _TorchFSDP:
    def __init__(self, cfg: dict, topology, rank: int):
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.distributed import pipelining
        from torch.distributed.fsdp import fully_shard

        import bench_vs_torch as peer

        layers = _model(cfg).pipeline_layers()
        layout = peer.stage_layout(dict(cfg, blocks=cfg["blocks"]), "1f1b")
        pp_rank = topology.pp_rank
        start = sum(layout[:pp_rank])
        stage = nn.Sequential(*layers[start:start + layout[pp_rank]])
        mesh = topology.dp_mesh
        for layer in stage:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(stage, mesh=mesh, reshard_after_forward=False)
        self.params = list(stage.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.stage = pipelining.PipelineStage(stage, pp_rank, PP, torch.device("cpu"), group=topology.pp_group)
        self.schedule = pipelining.Schedule1F1B(self.stage, cfg["microbatches"], loss_fn=F.mse_loss, scale_grads=True)
        self.first, self.last, self.n = pp_rank == 0, pp_rank == PP - 1, cfg["microbatches"]

    def step(self, batch) -> Optional[float]:
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        losses: list = []
        self.schedule.step(*((x,) if self.first else ()), **({"target": y, "losses": losses} if self.last else {}))
        self.opt.step()
        return sum(float(v.detach()) for v in losses) / self.n if self.last else None


def _measure(rank: int, world: int, cfg: dict, impl_name: str) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_pp.runtime import build_topology

    topology = build_topology(PP)
    if impl_name == "torch_fsdp":
        impl = _TorchFSDP(cfg, topology, rank)
    else:
        impl = _Ours(cfg, topology, "none" if impl_name == "unsharded" else "full", 2 if impl_name == "sharded_vp2" else 1)
    g = torch.Generator().manual_seed(cfg["seed"] + topology.dp_rank)
    batch = (torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g))
    losses = [impl.step(batch) for _ in range(2)]  # warm-up: optimizer state, FSDP's lazy init
    state = _state_bytes(impl.params, impl.opt)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    times, exposed, alone = [], [], 0.0
    for _ in range(cfg["steps"]):
        dist.barrier()
        start = time.perf_counter()
        losses.append(impl.step(batch))
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
        if isinstance(impl, _Ours) and impl_name != "unsharded":
            exposed.append(impl.exposed_and_alone()[0])
    peak = _status_kb("VmHWM") / 1024
    if isinstance(impl, _Ours) and impl_name != "unsharded":
        alone = impl.exposed_and_alone()[1]
    figures = torch.tensor([state / 2**20, peak, statistics.median(exposed) if exposed else 0.0, alone], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    first_loss = next((v for v in losses if v is not None), None)
    return {"state_mb": float(figures[0]), "peak_mb": float(figures[1]), "rs_exposed_s": float(figures[2]),
            "rs_alone_s": float(figures[3]), "step_s": statistics.median(times), "first_loss": first_loss}


def run(args: Any = None) -> dict:
    args = args if args is not None else parse_args([])
    cfg = dict(hidden=args.hidden, blocks=args.blocks, ffn_mult=4, microbatches=args.microbatches, batch=args.batch,
               steps=args.steps if not args.quick else min(args.steps, 5), seed=0)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    per_impl = {}
    for name in IMPLS:
        results = launch(_measure, WORLD, cfg, name, timeout=900)
        losses = [r["first_loss"] for r in results if r["first_loss"] is not None]
        per_impl[name] = dict(results[0], first_loss=losses[0] if losses else None)
    u, s, v, t = (per_impl[n] for n in IMPLS)
    out = {
        "config": cfg,
        "impls": per_impl,
        "sharded_state_bytes_ratio": s["state_mb"] / u["state_mb"],
        "sharded_peak_memory_ratio": s["peak_mb"] / u["peak_mb"],
        "sharded_step_ratio": s["step_s"] / u["step_s"],
        "ratio_vs_torch_fsdp_1f1b": s["step_s"] / t["step_s"],
        "peak_memory_ratio_vs_torch_fsdp_1f1b": s["peak_mb"] / t["peak_mb"],
        "reduce_scatter_hidden_fraction": max(0.0, 1.0 - v["rs_exposed_s"] / v["rs_alone_s"]) if v["rs_alone_s"] else 0.0,
        "reduce_scatter_hidden_fraction_vp1": max(0.0, 1.0 - s["rs_exposed_s"] / s["rs_alone_s"]) if s["rs_alone_s"] else 0.0,
        "first_loss_sharded_minus_unsharded": abs(s["first_loss"] - u["first_loss"]),
    }
    return out


def format_report(res: dict) -> str:
    lines = [f"pp={PP} x dp={WORLD // PP}, config {res['config']}",
             "| implementation | step (s) | state held (MB/rank) | peak resident (MB/rank) | RS waited / alone (ms) |",
             "|---|---:|---:|---:|---:|"]
    for name, r in res["impls"].items():
        rs = f"{r['rs_exposed_s'] * 1e3:.1f} / {r['rs_alone_s'] * 1e3:.1f}" if r["rs_alone_s"] else "-"
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['state_mb']:.0f} | {r['peak_mb']:.0f} | {rs} |")
    for key in ("sharded_state_bytes_ratio", "sharded_peak_memory_ratio", "sharded_step_ratio", "ratio_vs_torch_fsdp_1f1b",
                "peak_memory_ratio_vs_torch_fsdp_1f1b", "reduce_scatter_hidden_fraction",
                "reduce_scatter_hidden_fraction_vp1", "first_loss_sharded_minus_unsharded"):
        lines.append(f"{key}: {res[key]:.4g}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=128, help="samples per data-parallel replica")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    print(format_report(run(parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
