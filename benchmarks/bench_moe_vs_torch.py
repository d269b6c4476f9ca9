"""An MoE model whose expert exchanges go over a slow link: lightning_pp (1F1B and combined 1F1B)
vs ``torch.distributed.pipelining``'s ``Schedule1F1B``, same model, processes and batch.

The model is ``bench_a2a_overlap``'s MoE language model cut over 2 pipeline ranks (layout
``[3, 3]``: embedding + 2 MoE blocks | 2 MoE blocks + head). Expert parallel size is 1, so each
expert exchange (dispatch and combine, forward and backward: four per block and microbatch) is
just the emulated link: it completes ``--delay`` seconds after launch and its wait sleeps (burns no
CPU), as a transfer to other GPUs would. torch runs the blocks' plain ``forward`` (it has no way to
overlap an exchange inside a stage with other work); ours runs them plain under ``1f1b`` and node by
node under ``combined_1f1b``, where one microbatch's exchanges run under another's compute.

Before timing, one step of each from identical weights: the three losses must agree (1e-5
relative) and our 1F1B's local gradients must equal torch's (1e-4), or the run aborts. Then the
three alternate step by step; a step is ``zero_grad`` + the schedule + ``SGD.step``, timed after
a barrier, max over ranks; medians over ``--steps``.

    python benchmarks/bench_moe_vs_torch.py
    python benchmarks/bench_moe_vs_torch.py --quick

Prints ``ratio_vs_torch_moe_1f1b`` (ours 1F1B / torch 1F1B) and ``ratio_vs_torch_moe_combined``
(ours combined 1F1B / torch 1F1B); below 1 means faster than torch.
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
IMPLS = ("torch_1f1b", "ours_1f1b", "ours_combined")


def _loss(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class _Ours:
    def __init__(self, cfg: dict, schedule: str):
        import torch

        from lightning_pp.runtime import build_pipeline

        self.model = _model(cfg)
        self.executor = build_pipeline(self.model, pipeline_parallel_size=PP, num_microbatches=cfg["microbatches"],
                                       schedule=schedule, layout=LAYOUT)
        self.params = [p for chunk in self.executor.partition.chunks for layer in chunk.layers for p in layer.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=cfg["lr"])

    def step(self, batch) -> Optional[float]:
        self.opt.zero_grad(set_to_none=True)
        loss = float(self.executor.train_step(batch).loss)
        self.opt.step()
        return loss


class _Torch:
    def __init__(self, cfg: dict, rank: int):
        import torch
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        layers = _model(cfg).pipeline_layers()
        start = sum(LAYOUT[:rank])
        self.module = nn.Sequential(*layers[start:start + LAYOUT[rank]])
        mb, seq, hidden = cfg["batch"] // cfg["microbatches"], cfg["seq"], cfg["hidden"]
        # Static stage shapes (routing inside a stage is data-dependent; its boundaries are not).
        inputs = torch.zeros(mb, seq, dtype=torch.long) if rank == 0 else torch.zeros(mb, seq, hidden, requires_grad=True)
        outputs = torch.zeros(mb, seq, hidden, requires_grad=True) if rank == 0 else torch.zeros(mb, seq, cfg["vocab"])
        grads = dict(output_grads=outputs, input_grads=(None,)) if rank == 0 else dict(input_grads=inputs)
        stage = PipelineStage(self.module, rank, PP, torch.device("cpu"), input_args=inputs, output_args=outputs, **grads)
        self.params = list(self.module.parameters())
        self.opt = torch.optim.SGD(self.params, lr=cfg["lr"])
        self.n_mb = cfg["microbatches"]
        self.schedule = Schedule1F1B(stage, self.n_mb, loss_fn=_loss, scale_grads=True)
        self.rank = rank

    def step(self, batch) -> Optional[float]:
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        losses: list = []
        if self.rank == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=losses)
        self.opt.step()
        return sum(float(loss.detach()) for loss in losses) / self.n_mb if losses else None


def _measure(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    impls = {"torch_1f1b": _Torch(cfg, rank), "ours_1f1b": _Ours(cfg, "1f1b"), "ours_combined": _Ours(cfg, "combined_1f1b")}
    g = torch.Generator().manual_seed(7)
    batch = (torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g),
             torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g))
    # Equivalence from identical weights (the SGD step of this check is applied to every copy).
    losses = {}
    for name, impl in impls.items():
        losses[name] = impl.step(batch)
        if name == "ours_1f1b":
            grads_ours = [p.grad.clone() for p in impl.params]
        if name == "torch_1f1b":
            grads_torch = [p.grad.clone() for p in impl.params]
    for a, b in zip(grads_ours, grads_torch):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
            raise AssertionError(f"rank {rank}: our 1F1B gradient differs from torch's by "
                                 f"{float((a - b).abs().max()):.3g} (largest {float(b.abs().max()):.3g}, "
                                 f"shape {tuple(b.shape)})")
    if rank == PP - 1:
        ref = losses["torch_1f1b"]
        for name, value in losses.items():
            if abs(value - ref) > 1e-5 * abs(ref):
                raise AssertionError(f"step-1 loss of {name} is {value}, torch's is {ref}")
    times = {name: [] for name in impls}
    for step in range(cfg["warmup"] + cfg["steps"]):
        for name, impl in impls.items():
            dist.barrier()
            start = time.perf_counter()
            impl.step(batch)
            elapsed = max_over_ranks(time.perf_counter() - start)
            if step >= cfg["warmup"]:
                times[name].append(elapsed)
    return {"times": times, "losses": losses if rank == PP - 1 else None}


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
    return {"config": cfg, "steps": stats, "losses": results[PP - 1]["losses"], "link_seconds_per_rank": link,
            "link_hidden_vs_torch": (torch_median - stats["ours_combined"]["median"]) / link,
            "ratio_vs_torch_moe_1f1b": stats["ours_1f1b"]["median"] / torch_median,
            "ratio_vs_torch_moe_combined": stats["ours_combined"]["median"] / torch_median}


def format_report(res: dict) -> str:
    c = res["config"]
    lines = [
        f"MoE LM: {c['blocks']} MoE blocks, hidden {c['hidden']}, {c['experts']} experts top-{c['top_k']}, pp={PP} "
        f"(layout {LAYOUT}), {c['microbatches']} microbatches, emulated link {c['delay'] * 1e3:.1f} ms per expert exchange",
        "step-1 losses (equal by check): " + ", ".join(f"{k} {v:.6f}" for k, v in res["losses"].items()),
        f"{'':18}{'median s':>10}{'q1':>10}{'q3':>10}   ({res['steps']['torch_1f1b']['n']} steps each)",
    ]
    for name in IMPLS:
        s = res["steps"][name]
        lines.append(f"{name:18}{s['median']:10.4f}{s['q1']:10.4f}{s['q3']:10.4f}")
    lines += [f"link time per rank and step if nothing overlaps it: {res['link_seconds_per_rank']:.3f} s; "
              f"combined 1F1B saves {res['link_hidden_vs_torch']:.0%} of it against torch",
              f"ratio_vs_torch_moe_1f1b: {res['ratio_vs_torch_moe_1f1b']:.3f}",
              f"ratio_vs_torch_moe_combined: {res['ratio_vs_torch_moe_combined']:.3f}"]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    return link_args(__doc__, argv)


if __name__ == "__main__":
    print(format_report(run(parse_args())))
