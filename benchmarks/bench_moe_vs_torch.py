"""An MoE model whose expert exchanges go over a slow link: lightning_pp (1F1B, combined 1F1B and
DualPipeV) vs ``torch.distributed.pipelining``'s ``Schedule1F1B`` and ``ScheduleDualPipeV``, same
model, processes and batch.

The model is ``bench_a2a_overlap``'s MoE language model cut over 2 pipeline ranks (layout
``[3, 3]``: embedding + 2 MoE blocks | 2 MoE blocks + head; the DualPipeV pair runs 4 virtual
stages in a V, layout ``[2, 1, 1, 2]``: rank 0 holds embedding + block 1 and block 4 + head,
rank 1 blocks 2 and 3). Expert parallel size is 1, so each
expert exchange (dispatch and combine, forward and backward: four per block and microbatch) is
just the emulated link: it completes ``--delay`` seconds after launch and its wait sleeps (burns no
CPU), as a transfer to other GPUs would. torch runs the blocks' plain ``forward`` (it has no way to
overlap an exchange inside a stage with other work; its ``ScheduleDualPipeV`` runs the two halves
of each overlapped step one after the other unless the user registers an ``OVERLAP_F_B``
function); ours runs them plain under ``1f1b`` and node by node under ``combined_1f1b`` and in the
fused ``FB`` steps of ``dualpipev``, where one microbatch's exchanges run under another's compute.

Before timing, one step of each from identical weights: all losses must agree (1e-5 relative),
our 1F1B's local gradients must equal torch's 1F1B's and our DualPipeV's torch's DualPipeV's
(1e-4), or the run aborts. Then the five alternate step by step; a step is ``zero_grad`` + the
schedule + ``SGD.step``, timed after a barrier, max over ranks; medians over ``--steps``.

    python benchmarks/bench_moe_vs_torch.py
    python benchmarks/bench_moe_vs_torch.py --quick

Prints ``ratio_vs_torch_moe_1f1b`` (ours 1F1B / torch 1F1B), ``ratio_vs_torch_moe_combined``
(ours combined 1F1B / torch 1F1B) and ``ratio_vs_torch_moe_dualpipev`` (ours DualPipeV / torch
DualPipeV); below 1 means faster than torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_a2a_overlap import _model  # noqa: E402  (the same MoE language model)
from common import link_args, launch, max_over_ranks, summary  # noqa: E402

PP = 2
LAYOUT = [3, 3]
V_LAYOUT = [2, 1, 1, 2]  # 4 virtual stages in a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
IMPLS = ("torch_1f1b", "ours_1f1b", "ours_combined", "torch_dualpipev", "ours_dualpipev")
# The pairs checked for equal gradients (same schedule table, same layout).
SAME_GRADIENTS = (("ours_1f1b", "torch_1f1b"), ("ours_dualpipev", "torch_dualpipev"))


def _loss(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class _Ours:
    def __init__(self, cfg: dict, schedule: str):
        import torch

        from lightning_pp.runtime import build_pipeline

        self.model = _model(cfg)
        vp = 2 if schedule == "dualpipev" else 1
        self.executor = build_pipeline(self.model, pipeline_parallel_size=PP, virtual_pipeline_size=vp,
                                       num_microbatches=cfg["microbatches"], schedule=schedule,
                                       layout=V_LAYOUT if vp == 2 else LAYOUT)
        self.params = [p for chunk in self.executor.partition.chunks for layer in chunk.layers for p in layer.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=cfg["lr"])

    def step(self, batch) -> Optional[float]:
        self.opt.zero_grad(set_to_none=True)
        loss = float(self.executor.train_step(batch).loss)
        self.opt.step()
        return loss


def _torch_stage(cfg: dict, module, stage: int, num_stages: int):
    """A ``PipelineStage`` with static shapes (routing inside a stage is data-dependent; its
    boundaries are not): token ids into the first stage, hidden states between stages, logits out
    of the last."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    mb, seq, hidden = cfg["batch"] // cfg["microbatches"], cfg["seq"], cfg["hidden"]
    first, last = stage == 0, stage == num_stages - 1
    inputs = torch.zeros(mb, seq, dtype=torch.long) if first else torch.zeros(mb, seq, hidden, requires_grad=True)
    outputs = torch.zeros(mb, seq, cfg["vocab"]) if last else torch.zeros(mb, seq, hidden, requires_grad=True)
    grads = {"input_grads": (None,) if first else inputs}
    if not last:
        grads["output_grads"] = outputs
    return PipelineStage(module, stage, num_stages, torch.device("cpu"), input_args=inputs, output_args=outputs, **grads)


class _Torch:
    def __init__(self, cfg: dict, rank: int, schedule: str = "1f1b"):
        import torch
        from torch import nn
        from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV

        layers = _model(cfg).pipeline_layers()
        layout = V_LAYOUT if schedule == "dualpipev" else LAYOUT
        num_stages = len(layout)
        local = [rank, num_stages - 1 - rank] if schedule == "dualpipev" else [rank]
        modules = [nn.Sequential(*layers[sum(layout[:s]):sum(layout[:s + 1])]) for s in local]
        stages = [_torch_stage(cfg, module, s, num_stages) for module, s in zip(modules, local)]
        self.params = [p for module in modules for p in module.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=cfg["lr"])
        self.n_mb = cfg["microbatches"]
        if schedule == "dualpipev":
            self.schedule = ScheduleDualPipeV(stages, self.n_mb, loss_fn=_loss, scale_grads=True)
        else:
            self.schedule = Schedule1F1B(stages[0], self.n_mb, loss_fn=_loss, scale_grads=True)
        self.is_first, self.is_last = 0 in local, num_stages - 1 in local

    def step(self, batch) -> Optional[float]:
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        losses: list = []
        self.schedule.step(*((x,) if self.is_first else ()), **({"target": y, "losses": losses} if self.is_last else {}))
        self.opt.step()
        return sum(float(loss.detach()) for loss in losses) / self.n_mb if losses else None


def _global_loss(loss: Optional[float]) -> float:
    """The step's loss on every rank: torch keeps it only on the rank of the last stage."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([loss or 0.0, float(loss is not None)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def _check_equivalence(impls: dict, batch, rank: int) -> dict:
    """One step of each from identical weights (its SGD step is applied to every copy): equal
    losses, and equal local gradients within each pair of ``SAME_GRADIENTS``."""
    import torch

    losses, grads = {}, {}
    for name, impl in impls.items():
        losses[name] = _global_loss(impl.step(batch))
        grads[name] = [p.grad.clone() for p in impl.params]
    for ours, theirs in SAME_GRADIENTS:
        for a, b in zip(grads[ours], grads[theirs], strict=True):
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"rank {rank}: {ours}'s gradient differs from {theirs}'s by "
                                     f"{float((a - b).abs().max()):.3g} (largest {float(b.abs().max()):.3g}, "
                                     f"shape {tuple(b.shape)})")
    ref = losses["torch_1f1b"]
    for name, value in losses.items():
        if abs(value - ref) > 1e-5 * abs(ref):
            raise AssertionError(f"step-1 loss of {name} is {value}, torch's 1F1B's is {ref}")
    return losses


def _measure(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    impls = {"torch_1f1b": _Torch(cfg, rank), "ours_1f1b": _Ours(cfg, "1f1b"), "ours_combined": _Ours(cfg, "combined_1f1b"),
             "torch_dualpipev": _Torch(cfg, rank, "dualpipev"), "ours_dualpipev": _Ours(cfg, "dualpipev")}
    g = torch.Generator().manual_seed(7)
    batch = (torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g),
             torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g))
    losses = _check_equivalence(impls, batch, rank)
    times = {name: [] for name in impls}
    for step in range(cfg["warmup"] + cfg["steps"]):
        # Rotate the order so that no implementation always follows the same one.
        names = list(impls)[step % len(impls):] + list(impls)[:step % len(impls)]
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            impls[name].step(batch)
            elapsed = max_over_ranks(time.perf_counter() - start)
            if step >= cfg["warmup"]:
                times[name].append(elapsed)
    return {"times": times, "losses": losses}


def run(args: Any = None) -> dict:
    args = args or parse_args([])
    cfg = dict(microbatches=16, batch=32, seq=32, vocab=64, hidden=128, heads=4, ffn=256, experts=4, top_k=2,
               blocks=4, delay=args.delay, lr=0.05, warmup=2, steps=5 if args.quick else 15)
    results = launch(_measure, PP, cfg)
    times = results[0]["times"]
    stats = {name: summary(times[name]) for name in IMPLS}
    torch_median = stats["torch_1f1b"]["median"]
    # Time a rank spends on the emulated link per step when nothing overlaps it: four exchanges
    # per block and microbatch.
    link = 4 * (cfg["blocks"] // PP) * cfg["microbatches"] * cfg["delay"]
    return {"config": cfg, "steps": stats, "losses": results[0]["losses"], "link_seconds_per_rank": link,
            "link_hidden_vs_torch": (torch_median - stats["ours_combined"]["median"]) / link,
            "link_hidden_dualpipev_vs_torch": (stats["torch_dualpipev"]["median"] - stats["ours_dualpipev"]["median"]) / link,
            "ratio_vs_torch_moe_1f1b": stats["ours_1f1b"]["median"] / torch_median,
            "ratio_vs_torch_moe_combined": stats["ours_combined"]["median"] / torch_median,
            "ratio_vs_torch_moe_dualpipev": stats["ours_dualpipev"]["median"] / stats["torch_dualpipev"]["median"],
            "ratio_moe_dualpipev_vs_torch_1f1b": stats["ours_dualpipev"]["median"] / torch_median}


def format_report(res: dict) -> str:
    c = res["config"]
    lines = [
        f"MoE LM: {c['blocks']} MoE blocks, hidden {c['hidden']}, {c['experts']} experts top-{c['top_k']}, pp={PP} "
        f"(layout {LAYOUT}; DualPipeV: {V_LAYOUT} in a V), {c['microbatches']} microbatches, emulated link "
        f"{c['delay'] * 1e3:.1f} ms per expert exchange",
        "step-1 losses (equal by check): " + ", ".join(f"{k} {v:.6f}" for k, v in res["losses"].items()),
        f"{'':18}{'median s':>10}{'q1':>10}{'q3':>10}   ({res['steps']['torch_1f1b']['n']} steps each)",
    ]
    for name in IMPLS:
        s = res["steps"][name]
        lines.append(f"{name:18}{s['median']:10.4f}{s['q1']:10.4f}{s['q3']:10.4f}")
    lines += [f"link time per rank and step if nothing overlaps it: {res['link_seconds_per_rank']:.3f} s; "
              f"combined 1F1B saves {res['link_hidden_vs_torch']:.0%} of it against torch's 1F1B, our DualPipeV "
              f"{res['link_hidden_dualpipev_vs_torch']:.0%} against torch's DualPipeV",
              f"ratio_vs_torch_moe_1f1b: {res['ratio_vs_torch_moe_1f1b']:.3f}",
              f"ratio_vs_torch_moe_combined: {res['ratio_vs_torch_moe_combined']:.3f}",
              f"ratio_moe_dualpipev_vs_torch_1f1b: {res['ratio_moe_dualpipev_vs_torch_1f1b']:.3f}",
              f"ratio_vs_torch_moe_dualpipev: {res['ratio_vs_torch_moe_dualpipev']:.3f}"]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    return link_args(__doc__, argv)


if __name__ == "__main__":
    print(format_report(run(parse_args())))
