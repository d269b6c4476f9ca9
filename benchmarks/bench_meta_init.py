"""Host memory per rank when a model larger than a rank's share is pipelined: building it whole on
every rank (the path before meta-device support) against building it on the meta device and
materialising only the rank's layers, and loading a one-device litgpt checkpoint into the shards.

Model: litgpt's GPT-NeoX architecture (``pythia-14m``'s family) with ``--layers`` blocks of width
``--width`` and a ``--vocab``-token vocabulary, float32; ``--ranks`` gloo processes, one pipeline
stage each (pp = ranks), the same number of blocks on every stage (the embedding on the first, the
head on the last). Per rank, after ``import torch`` and the process group: the kernel's
peak-RSS counter is reset (``/proc/self/clear_refs``), then

* ``whole``: ``GPT(config)`` on the CPU (litgpt's default init), then ``build_pipeline`` cuts it;
* ``meta``: ``GPT(config)`` under ``torch.device("meta")``, then ``build_pipeline`` cuts it and
  materialises this rank's part (``lightning_pp.runtime.cut.meta``);
* ``meta+load``: as ``meta``, then ``model.load_state_dict(torch.load(file, mmap=True))`` of a
  one-device checkpoint (written beforehand by the launching process): each rank reads only its
  own tensors.

Each in fresh processes. The figure is the peak RSS the path added (``VmHWM`` minus the RSS before
it), over the rank's share (bytes of the parameters it holds after the cut), and what stays added
at the end. Mapped checkpoint pages that a rank reads count in its RSS while the file stays mapped
(they are page cache: clean, reclaimable), hence the load's extra share at its peak.

    python benchmarks/bench_meta_init.py              # 8 ranks, 16 blocks of 1024: 0.8 GB of weights
    python benchmarks/bench_meta_init.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch  # noqa: E402

PATHS = ("whole", "meta", "meta+load")


def _config(args):
    from litgpt.config import Config

    return Config.from_name("pythia-14m", n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                            padded_vocab_size=args.vocab, vocab_size=args.vocab, block_size=256,
                            intermediate_size=4 * args.width)


def _rss_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")




def _measure(rank, world, args, path, checkpoint):
    import torch
    from litgpt.model import GPT
    from torch import nn

    from lightning_pp.integrations import litgpt as lpp_litgpt
    from lightning_pp.runtime import build_pipeline

    class Holder(nn.Module):
        def __init__(self, gpt):
            super().__init__()
            self.model = gpt

        def pipeline_layers(self):
            return lpp_litgpt.pipeline_layers(self.model)

        def pipeline_loss(self, logits, batch):
            return lpp_litgpt.pipeline_loss(logits, batch)

    config = _config(args)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    before = _rss_kb("VmRSS")
    torch.manual_seed(0)
    if path == "whole":
        holder = Holder(GPT(config))
    else:
        with torch.device("meta"):
            holder = Holder(GPT(config))
    blocks = args.layers // world  # the same number of blocks per stage; embedding and head at the ends
    layout = [blocks + (r == 0) + (r == world - 1) for r in range(world)]
    executor = build_pipeline(holder, pipeline_parallel_size=world, num_microbatches=world, watchdog=False,
                              layout=layout)
    if path == "meta+load":
        state = torch.load(checkpoint, mmap=True, weights_only=True)
        holder.model.load_state_dict(state)
        del state  # unmaps the file
    share = sum(p.numel() * p.element_size() for p in holder.parameters())
    peak, end = _rss_kb("VmHWM") - before, _rss_kb("VmRSS") - before
    executor.close()
    return {"share_mb": share / 2**20, "peak_mb": peak / 1024, "end_mb": end / 1024}


def run(args) -> dict:
    import torch
    from litgpt.model import GPT

    config = _config(args)
    torch.manual_seed(0)
    whole = GPT(config)
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, "lit_model.pth")
        torch.save(whole.state_dict(), checkpoint)
        del whole
        results = {path: launch(_measure, args.ranks, args, path, checkpoint, timeout=600) for path in PATHS}
    figures = {"full_model_mb": total / 2**20}
    for path, per_rank in results.items():
        figures.update(share_figures(path.replace("+", "_"), per_rank))
    figures["full_over_largest_share"] = figures["full_model_mb"] / max(s for s, _ in figures["meta_per_rank"])
    return figures


def share_figures(key: str, per_rank: list) -> dict:
    """A path's figures from each rank's ``share_mb`` / ``peak_mb`` / ``end_mb``: the largest peak
    and end over the share, and (share, peak) per rank."""
    return {f"{key}_peak_over_share_max": max(r["peak_mb"] / r["share_mb"] for r in per_rank),
            f"{key}_end_over_share_max": max(r["end_mb"] / r["share_mb"] for r in per_rank),
            f"{key}_per_rank": [(round(r["share_mb"], 1), round(r["peak_mb"], 1)) for r in per_rank]}


def model_size_main(doc: str, run, argv=None) -> dict:
    """The command line of the model-size memory benchmarks (this one, ``bench_hf_load.py``): parse,
    ``run``, print every figure."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--layers", type=int, default=16, help="a multiple of --ranks")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.vocab = 256, 1024
    figures = run(args)
    for name, value in figures.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")
    return figures


def main(argv=None) -> dict:
    return model_size_main(__doc__, run, argv)


if __name__ == "__main__":
    main()
