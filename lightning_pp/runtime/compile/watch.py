"""What torch.compile did on this rank, step by step, for ``compile=`` (issue 23): the compiled
graphs, the recompilations (with the guard that failed, per compiled function) and the graph
breaks; :class:`CompileWatch` counts them after warm-up and warns when a function keeps
recompiling, and :class:`~lightning_pp.callbacks.PipelineMonitor` logs them."""

from __future__ import annotations

import os
import warnings


def compile_counts() -> dict:
    """What torch.compile did in this process so far: ``graphs`` compiled, ``recompiles`` (guard
    failures, over every compiled function: a recompile lists one per cached entry it missed),
    ``graph_breaks``, and ``guards_failed``: each compiled function's (``Block.forward (model.py:40)``) failed
    guards, in order."""
    from torch._dynamo.utils import counters, guard_failures

    failures = {f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})": list(reasons)
                for code, reasons in guard_failures.items() if reasons}
    return {"graphs": counters["stats"]["unique_graphs"], "recompiles": sum(map(len, failures.values())),
            "graph_breaks": sum(counters["graph_break"].values()), "guards_failed": failures}


class CompileWatch:
    """Counts torch.compile's work on this rank step by step (the executor calls
    :meth:`pipeline_step_end` after every training step when a layer is compiled). The first
    ``warmup_steps`` steps compile; a recompilation after them (a guard that failed: a shape, a
    dtype, a flag that changed) is counted in ``recompiles_after_warmup``. Up to three per function
    are expected: the first change of a batch or sequence size (the symbolic graph), a size of 1 (a
    last microbatch of one sample: torch specialises sizes 0 and 1 even when marked dynamic), and
    the first forward without gradients (validation: torch guards on the grad mode). When a
    function keeps recompiling (at ``warn_after`` steps after warm-up) a warning names it (the
    layer class's ``forward``) and the guard that failed last.
    :class:`~lightning_pp.callbacks.PipelineMonitor` logs :meth:`metrics`."""

    def __init__(self, warmup_steps: int = 2, warn_after: int = 4) -> None:
        self.warmup_steps, self.warn_after = warmup_steps, warn_after
        self._after: dict = {}
        self.start = compile_counts()
        self.counts = self.start
        self.recompiles_after_warmup = 0
        self._warned: set = set()

    def pipeline_step_end(self, steps_done: int) -> None:
        counts = compile_counts()
        if steps_done > self.warmup_steps:
            self.recompiles_after_warmup += counts["graphs"] - self.counts["graphs"]
            previous = self.counts["guards_failed"]
            for name, reasons in counts["guards_failed"].items():
                new = reasons[len(previous.get(name, [])):]  # a recompile lists each cached entry's failure
                self._after[name] = self._after.get(name, 0) + bool(new)  # steps at which it recompiled
                if new and self._after[name] >= self.warn_after and name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(
                        f"lightning_pp: compiled {name} recompiled at step {steps_done}, at {self._after[name]} steps after "
                        f"the {self.warmup_steps} warm-up steps; the guard that failed last: "
                        f"{new[-1].splitlines()[0]}. Each costs a compilation: keep what the guard names fixed "
                        f"(a shape: pad to a few sizes, or torch._dynamo.mark_dynamic on that dimension).", stacklevel=2)
        self.counts = counts

    def metrics(self, prefix: str = "pipeline/") -> dict:
        counts, start = self.counts, self.start
        return {f"{prefix}compiled_graphs": counts["graphs"] - start["graphs"],
                f"{prefix}recompiles": counts["recompiles"] - start["recompiles"],
                f"{prefix}recompiles_after_warmup": self.recompiles_after_warmup,
                f"{prefix}graph_breaks": counts["graph_breaks"] - start["graph_breaks"]}
