"""zb_compiled_backward_ratio: a compiled block's zero-bubble B + W time over its whole backward
(issue 23). The block: three 1024-wide linears with GELUs, batch 512, one thread, inductor. Both
compiled ways side by side in one run: ``split`` (lightning_pp.runtime.compile.layers.compile_layer, whose
backward graph is cut into input- and weight-gradient parts) and ``torch`` (a plain
``Module.compile()``, donated buffers off so the retained graph runs: its W reruns the whole
compiled backward). Medians over repeated steps.

    OMP_NUM_THREADS=1 python benchmarks/bench_compile.py
"""

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from lightning_pp.runtime.compile.layers import compile_layer
from lightning_pp.runtime.plans.weight_grad import backward_input


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.c(nn.functional.gelu(self.b(nn.functional.gelu(self.a(x)))))


def _times(block: nn.Module, x0: torch.Tensor, g: torch.Tensor, repeats: int):
    b_times, w_times, full_times = [], [], []
    params = list(block.parameters())
    for _ in range(repeats):
        x = x0.clone().requires_grad_()
        y = block(x)
        t0 = time.perf_counter()
        _, weights = backward_input([y], [g], [x], params)
        t1 = time.perf_counter()
        weights.run()
        t2 = time.perf_counter()
        b_times.append(t1 - t0)
        w_times.append(t2 - t1)
        y = block(x0.clone().requires_grad_())
        t0 = time.perf_counter()
        y.backward(g)
        full_times.append(time.perf_counter() - t0)
    return statistics.median(b_times), statistics.median(w_times), statistics.median(full_times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    return run(parser.parse_args(argv))


def run(args) -> dict:
    """The figures by name (``zb_compiled_backward_ratio`` and the same ratio for torch's compiled
    layer and for eager), for ``run_all.py``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    eager = Block(args.width)
    split, plain = copy.deepcopy(eager), copy.deepcopy(eager)
    compile_layer(split)  # also turns torch's donated buffers off, which the plain one needs too
    plain.compile()
    x0, g = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    figures = {}
    for name, block in (("split", split), ("torch", plain), ("eager", eager)):
        _times(block, x0, g, 2)  # compile and warm up
        b, w, full = _times(block, x0, g, args.repeats)
        figures[name] = (b + w) / full
        print(f"{name:6s} B {b * 1e3:7.1f} ms  W {w * 1e3:7.1f} ms  whole backward {full * 1e3:7.1f} ms  "
              f"(B + W) / whole {figures[name]:.3f}")
    print(f"zb_compiled_backward_ratio {figures['split']:.3f} (target <= 1.10; torch's compiled layer "
          f"{figures['torch']:.3f}, eager {figures['eager']:.3f})")
    return {"zb_compiled_backward_ratio": figures["split"], "zb_torch_compiled_backward_ratio": figures["torch"],
            "zb_eager_backward_ratio": figures["eager"]}


if __name__ == "__main__":
    main()
