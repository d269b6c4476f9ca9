"""Peak memory per rank during training: ours vs torch.distributed.pipelining, and vs the 1F1B bound;
and ours with ``activation_checkpointing=True`` (every layer recomputed in backward).

Same model, batch, microbatches and 2 processes as ``bench_vs_torch.py`` (whose model and
implementation wrappers this reuses). Each implementation runs in its own fresh processes, so
neither inherits the other's heap. On every rank, after one warm-up step, the kernel's peak
resident-set counter is reset (``/proc/self/clear_refs``) and ``--steps`` steps run; the figure
is ``VmHWM - VmRSS`` at the reset: the most memory the steps added on top of what was resident.
The processes run with ``MALLOC_MMAP_THRESHOLD_=65536`` so every tensor of 64 KiB or more is its
own mapping, returned to the kernel when freed: resident memory then follows live tensors instead
of the allocator's cached heap.

What the figure includes: saved activations, the received and sent stage tensors, and transient
temporaries of forward/backward; not parameters, optimizer state or gradients (resident from the
warm-up step when the counter is reset).

``--carried`` adds ``ours_carried``: the same sizes, but a model whose blocks take and return
``(x, c)``, a conditioning tensor ``c`` made by the first layer and read by every block through
``SiLU(c)`` (as a diffusion transformer's class embedding): the runtime keeps only the autograd edge of
what a stage sends, so ``c``, which the sending stage's ``SiLU`` saved, stays alive until the backward
that reads it, as on one device, while the hidden states ``x`` are freed as in the chain. Reported as
``peak_memory_carried_over_chain`` (ours on this model / ours on the chain).

``--diagnose-sends`` adds a diagnostic variant, ``ours_sends_waited``: ours with the runtime's
pending sends waited for (and their buffers dropped) as soon as two newer sends are queued,
patched into ``PointToPoint._reap_sends`` inside the benchmark's processes. On gloo a send's
``is_completed()`` stays False until ``wait()`` is called, so the runtime holds every sent
activation and input gradient of a step until ``PointToPoint.finish``; the variant measures what
that costs (BENCHMARKS.md, "Peak memory"). Not a supported mode: it blocks on sends, which the
runtime avoids by design.

The 1F1B bound: rank ``r`` holds at most ``min(pp - r, m)`` microbatches of its stage's saved
activations. One microbatch's saved activations are counted exactly with
``torch.autograd.graph.saved_tensors_hooks`` (distinct storages) on a single-process forward of
the stage's layers.

    python benchmarks/bench_memory.py
    python benchmarks/bench_memory.py --quick
    python benchmarks/bench_memory.py --quick --carried
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_torch as peer  # noqa: E402
from common import launch  # noqa: E402


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _wait_for_sends_early(keep: int = 2) -> None:
    """Diagnostic (``--diagnose-sends``): make the runtime wait for its pending sends, all but the
    newest ``keep``, at every send, so that a sent buffer is dropped soon after its receiver has it."""
    from lightning_pp.runtime.transport.p2p import PointToPoint

    def reap(self) -> None:
        for work, *_ in self.pending_sends[:-keep]:
            work.wait()
        self.pending_sends = self.pending_sends[-keep:]

    PointToPoint._reap_sends = reap


def _carried_model(cfg: dict):
    """The benchmark's chain with a conditioning tensor carried through every block (``--carried``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Embed(nn.Module):
        def __init__(self, hidden: int):
            super().__init__()
            self.proj, self.cond = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

        def forward(self, x):
            return self.proj(x), self.cond(x)

    class ConditionedMLP(nn.Module):
        def __init__(self, hidden: int, mult: int):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.up, self.down = nn.Linear(hidden, mult * hidden), nn.Linear(mult * hidden, hidden)
            self.scale = nn.Linear(hidden, hidden)

        def forward(self, x, c):
            return x + self.down(F.gelu(self.up(self.norm(x)))) * self.scale(F.silu(c)), c

    class Head(nn.Module):
        def __init__(self, hidden: int):
            super().__init__()
            self.out = nn.Linear(hidden, hidden)

        def forward(self, x, c):
            return self.out(x)

    class CarriedModel(nn.Module):
        def __init__(self, hidden: int, blocks: int, mult: int):
            super().__init__()
            self.embed = Embed(hidden)
            self.blocks = nn.ModuleList(ConditionedMLP(hidden, mult) for _ in range(blocks))
            self.head = Head(hidden)

        def pipeline_layers(self):
            return [self.embed, *self.blocks, self.head]

        def pipeline_loss(self, output, batch):
            return F.mse_loss(output, batch[1])

    torch.manual_seed(cfg["seed"])
    return CarriedModel(cfg["hidden"], cfg["blocks"], cfg["ffn_mult"])


class _OursCarried:
    def __init__(self, cfg: dict, topology):
        import torch
        from lightning_pp.runtime import build_pipeline

        # nonfinite="ignore": the code before issue 32 freed c's storage while SiLU still needed it
        # and its gradients came out non-finite; its memory figure is measured all the same.
        self.executor = build_pipeline(_carried_model(cfg), pipeline_parallel_size=peer.WORLD_SIZE,
                                       num_microbatches=cfg["microbatches"], schedule="1f1b", topology=topology,
                                       nonfinite="ignore")
        self.opt = torch.optim.SGD([p for c in self.executor.partition.chunks for p in c.parameters()], lr=cfg["lr"])

    def step(self, batch) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.executor.train_step(batch)
        self.opt.step()


def _measure(rank: int, world: int, cfg: dict, impl_name: str) -> dict:
    import torch

    from lightning_pp.runtime import build_topology

    if impl_name == "ours_sends_waited":
        _wait_for_sends_early()
    topology = build_topology(world)
    if impl_name == "ours_carried":
        impl = _OursCarried(cfg, topology)
    else:
        ours = peer._Ours(cfg, "1f1b", topology, activation_checkpointing=impl_name == "ours_checkpointed")
        impl = ours if impl_name.startswith("ours") else peer._Torch(cfg, "1f1b", ours.layout, rank)
        if impl is not ours:
            del ours
    g = torch.Generator().manual_seed(cfg["seed"])
    batch = (torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g))
    impl.step(batch)  # warm-up: optimizer state, buffers
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kb("VmRSS")
    for _ in range(cfg["steps"]):
        impl.step(batch)
    return {"peak_added_mb": (_status_kb("VmHWM") - base) / 1024}


def _activation_bound(cfg: dict, world: int) -> list[float]:
    """Per rank: min(pp - r, m) x one microbatch's saved activations of that rank's stage (MB)."""
    import torch

    from lightning_pp.runtime.cut.layout import resolve_layout

    model = peer._make_model(cfg)
    layers = model.pipeline_layers()
    layout = resolve_layout(None, len(layers), world)
    mb = cfg["batch"] // cfg["microbatches"]
    x = torch.randn(mb, cfg["hidden"])
    bounds, start = [], 0
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for rank, count in enumerate(layout):
        seen: dict[int, int] = {}

        def pack(t, seen=seen):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:  # weights saved for backward are not activations
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = x.requires_grad_(rank > 0)
            for layer in layers[start:start + count]:
                h = layer(h)
        x = h.detach()
        start += count
        bounds.append(min(world - rank, cfg["microbatches"]) * sum(seen.values()) / 2**20)
    return bounds


def run(args: Any = None) -> dict:
    args = args or parse_args([])
    cfg = dict(peer.DEFAULTS, hidden=args.hidden, batch=args.batch, microbatches=args.microbatches,
               steps=2 if args.quick else args.steps)
    world = peer.WORLD_SIZE
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    names = ["ours", "torch", "ours_checkpointed"] + (["ours_sends_waited"] if getattr(args, "diagnose_sends", False) else []) \
        + (["ours_carried"] if getattr(args, "carried", False) else [])
    measured = {name: [r["peak_added_mb"] for r in launch(_measure, world, cfg, name, timeout=600)] for name in names}
    bound = _activation_bound(cfg, world)
    extra = {}
    if "ours_carried" in measured:
        extra["peak_memory_carried_over_chain"] = max(measured["ours_carried"]) / max(measured["ours"])
    if "ours_sends_waited" in measured:
        extra["peak_memory_ratio_vs_torch_sends_waited"] = max(measured["ours_sends_waited"]) / max(measured["torch"])
    return extra | {
        "config": {k: cfg[k] for k in ("hidden", "blocks", "batch", "microbatches", "steps")},
        "peak_added_mb": measured,
        "bound_1f1b_mb": bound,
        "peak_memory_ratio_vs_torch": max(measured["ours"]) / max(measured["torch"]),
        "peak_memory_over_1f1b_bound": max(o / b for o, b in zip(measured["ours"], bound)),
        "peak_memory_checkpointed_over_plain": max(measured["ours_checkpointed"]) / max(measured["ours"]),
    }


def format_report(res: dict) -> str:
    c = res["config"]
    lines = [f"1F1B, 2 ranks, hidden {c['hidden']}, {c['blocks']} blocks, batch {c['batch']}, {c['microbatches']} microbatches",
             f"{'rank':>6}{'ours MB':>12}{'torch MB':>12}{'1F1B bound MB':>16}{'ours, checkpointed MB':>24}"]
    peaks = res["peak_added_mb"]
    for r, (o, t, b, c) in enumerate(zip(peaks["ours"], peaks["torch"], res["bound_1f1b_mb"], peaks["ours_checkpointed"])):
        lines.append(f"{r:>6}{o:12.1f}{t:12.1f}{b:16.1f}{c:24.1f}")
    lines += [f"peak_memory_ratio_vs_torch: {res['peak_memory_ratio_vs_torch']:.3f}",
              f"peak_memory_over_1f1b_bound: {res['peak_memory_over_1f1b_bound']:.3f}",
              f"peak_memory_checkpointed_over_plain: {res['peak_memory_checkpointed_over_plain']:.3f}"]
    if "ours_sends_waited" in peaks:
        lines += ["diagnostic, ours with sends waited early (MB per rank): "
                  + " / ".join(f"{v:.2f}" for v in peaks["ours_sends_waited"]),
                  f"peak_memory_ratio_vs_torch_sends_waited: {res['peak_memory_ratio_vs_torch_sends_waited']:.3f}"]
    if "ours_carried" in peaks:
        lines += ["ours, carried-tensor model (MB per rank): " + " / ".join(f"{v:.2f}" for v in peaks["ours_carried"]),
                  f"peak_memory_carried_over_chain: {res['peak_memory_carried_over_chain']:.3f}"]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--carried", action="store_true",
                   help="also measure ours on the model with a conditioning tensor carried through every block")
    p.add_argument("--diagnose-sends", dest="diagnose_sends", action="store_true",
                   help="also measure ours with pending sends waited early (a diagnostic patch, see above)")
    return p.parse_args(argv)


if __name__ == "__main__":
    print(format_report(run(parse_args())))
