"""Where a compiled step goes on this CPU (issue 23): single-process probes, forward and backward.

* ``moe_block_*``: one MoE block of the main job (``lightning_pp.moe.MoEBlock``, hidden 64, 4
  heads, 4 experts of 128, top 2; 2 x 64 tokens), eager, with every part compiled as ``compile=True``
  compiles it (``compile_targets``: norms, attention, router, each expert), and with one kind of part
  compiled alone. Also ``--mode`` (e.g. ``max-autotune-no-cudagraphs``).
* ``mlp_block_*``: one block of ``bench_vs_torch.py``'s model (LayerNorm, 512 -> 2048 -> 512 with a
  GELU, residual; 16 rows), eager, ``compile_layer`` and ``torch.compile(module)``, gradients set to
  None every step as in training; each in a process of its own with glibc's defaults and with the
  heap kept (``bench_compile_pipeline.HEAP_KEPT``), since glibc reads those settings at start.

Figures are microseconds per forward + backward, medians of ``--repeats`` timings of ``--calls``
calls, one thread; the variants alternate so drift on a shared machine reaches them alike.

    OMP_NUM_THREADS=1 python benchmarks/bench_compile_parts.py [--mode max-autotune-no-cudagraphs]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _timed(calls: dict, repeats: int, per: int) -> dict:
    """Microseconds per call of each of ``calls``, alternating them; medians over ``repeats``."""
    for call in calls.values():
        for _ in range(10):
            call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(per):
                call()
            times[name].append((time.perf_counter() - start) / per * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def _train_call(module, x):
    def call():
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()

    return call


def moe_block(args) -> dict:
    import torch

    from lightning_pp.moe import MoEBlock
    from lightning_pp.runtime.compile.layers import compile_layer, compile_targets

    torch.manual_seed(0)
    block = MoEBlock(64, 4, 128, 4, 2)
    x = torch.randn(2, 64, 64, requires_grad=True)
    variants = {"eager": block, "all_parts": copy.deepcopy(block)}
    for part in compile_targets(variants["all_parts"]):
        compile_layer(part, "inductor", split=False, mode=args.mode)
    for kind in ("attn", "experts", "router", "ln"):
        variant = variants[f"{kind}_only"] = copy.deepcopy(block)
        for name, child in variant.named_children():
            if name.startswith(kind):
                for part in (list(child) if isinstance(child, torch.nn.ModuleList) else [child]):
                    compile_layer(part, "inductor", split=False, mode=args.mode)
    result = _timed({name: _train_call(m, x) for name, m in variants.items()}, args.repeats, args.calls)
    return {f"moe_block_{name}_us": value for name, value in result.items()}


def mlp_block(args) -> dict:
    import torch

    import bench_vs_torch as vs
    from lightning_pp.runtime.compile.layers import compile_layer

    torch.manual_seed(0)
    block = vs._model_classes()(512, 1, 4).blocks[0]
    x = torch.randn(16, 512, requires_grad=True)
    ours = copy.deepcopy(block)
    compile_layer(ours, "inductor", split=False)
    variants = {"eager": block, "ours": ours, "torch": torch.compile(copy.deepcopy(block))}
    result = _timed({name: _train_call(m, x) for name, m in variants.items()}, args.repeats, args.calls)
    return {f"mlp_block_{name}_us": value for name, value in result.items()}


def _in_process(part: str, args, env: dict) -> dict:
    command = [sys.executable, __file__, "--part", part, "--repeats", str(args.repeats), "--calls", str(args.calls)]
    if args.mode:
        command += ["--mode", args.mode]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    from bench_compile_pipeline import HEAP_KEPT

    out = _in_process("moe", args, {})
    out.update(_in_process("mlp", args, {}))
    out.update({f"{name}_heap_kept": value for name, value in _in_process("mlp", args, HEAP_KEPT).items()})
    for suffix in ("", "_heap_kept"):
        eager = out[f"mlp_block_eager_us{suffix}"]
        out[f"mlp_block_compiled_over_eager{suffix}"] = out[f"mlp_block_ours_us{suffix}"] / eager
        out[f"mlp_block_torch_compiled_over_eager{suffix}"] = out[f"mlp_block_torch_us{suffix}"] / eager
    out["moe_block_compiled_over_eager"] = out["moe_block_all_parts_us"] / out["moe_block_eager_us"]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--mode", default=None, help="inductor's mode for the MoE block's parts")
    p.add_argument("--part", choices=("moe", "mlp"), default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part is not None:  # one probe in this process, its figures as one JSON line
        import torch

        torch.set_num_threads(1)
        print(json.dumps((moe_block if args.part == "moe" else mlp_block)(args)))
        return 0
    for name, value in run(args).items():
        print(f"{name}: {value:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
