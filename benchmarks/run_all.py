"""Run the benchmarks in turn and print one ``name: value`` line per figure of BENCHMARKS.md's table
(benchmarks/README.md: the contract, and the benchmarks this does not run, with why).

    python benchmarks/run_all.py --quick     # every figure, fewer steps: about 13 minutes on 2 cores
    python benchmarks/run_all.py             # the full runs

Runs each benchmark in turn (each spawns its own gloo processes), prints its table, then the
summary lines: ratio_vs_torch_<schedule> for 1f1b, interleaved, zb1p, zb1p_vp2, zbv and dualpipev,
ratio_best_vs_torch_best, bubble_measured_over_simulated_<schedule> (and ``_calibrated``, with the
measured transfer cost; ``_per_stage`` and ``_per_stage_calibrated``, with each stage's own costs),
a2a_hidden_fraction, hf_moe_a2a_hidden_fraction, ratio_vs_torch_moe_combined,
ratio_vs_torch_moe_dualpipev, peak_memory_ratio_vs_torch (and peak_memory_carried_over_chain),
sharded_state_bytes_ratio,
sharded_peak_memory_ratio, sharded_step_ratio, ratio_vs_torch_fsdp_1f1b (and its peak memory),
reduce_scatter_hidden_fraction, zb_compiled_backward_ratio, monitor_overhead, batch_check_bound,
rng_streams_bound, auto_layout_step_ratio, auto_layout_vs_best, auto_layout_vs_torch,
auto_layout_predicted_over_measured (and auto_layout_measure_over_epoch), schedule_generate_simulate_seconds,
and the supporting figures.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _schedule_seconds(quick: bool) -> float:
    from lightning_pp.schedules import make_config, rank_actions, simulate

    def once() -> float:
        start = time.perf_counter()
        cfg = make_config("interleaved", 64, 4, 1024)
        simulate(cfg, actions=[rank_actions(cfg, r) for r in range(cfg.pp)])
        return time.perf_counter() - start

    return statistics.median(once() for _ in range(3 if quick else 5))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    q = args.quick
    figures: dict = {}
    started = time.perf_counter()

    def section(title: str, module: str, options: dict, keys: dict) -> None:
        mod = importlib.import_module(module)
        t0 = time.perf_counter()
        res = mod.run(options)
        print(f"\n## {title}  ({module}.py, {time.perf_counter() - t0:.0f}s)")
        report = getattr(mod, "format_report", None)
        if report is not None:
            print(report(res))
        else:
            for name, value in res.items():
                if isinstance(value, (int, float, str)):
                    print(f"{name}: {value:.4f}" if isinstance(value, float) else f"{name}: {value}")
        for name, path in keys.items():
            value = res
            for part in path.split("/"):
                value = value[part]
            figures[name] = value

    vs_torch = ("1f1b", "interleaved", "zb1p", "zb1p_vp2", "zbv", "dualpipev")
    section("Runtime vs torch.distributed.pipelining", "bench_vs_torch",
            {"quick": None, "steps": 16 if q else 30, "warmup": 2, "wait_quiet": 30.0},
            {f"ratio_vs_torch_{s}": f"ratio_vs_torch_{s}" for s in vs_torch}
            | {"ratio_best_vs_torch_best": "ratio_best_vs_torch_best", "best_ours": "best_ours", "best_torch": "best_torch"})
    bubble = ("1f1b", "interleaved", "zb1p", "zbv")
    section("Measured vs simulated bubble", "bench_bubble", argparse.Namespace(
        hidden=512, microbatches=8, steps=10 if q else 20, quick=False, schedules=",".join(bubble)),
        {"bubble_measured_over_simulated": "bubble_measured_over_simulated"}
        | {f"bubble_measured_over_simulated_{s}{c}": f"bubble_measured_over_simulated_{s}{c}"
           for s in bubble for c in ("", "_calibrated", "_per_stage", "_per_stage_calibrated")}
        | {f"bubble_measured_over_{ref}_{s}": f"bubble_measured_over_{ref}_{s}"
           for ref in ("rank_means", "replayed") for s in bubble})
    section("All-to-all hidden by combined 1F1B (emulated link)", "bench_a2a_overlap",
            argparse.Namespace(delay=0.0015, quick=False),
            {"a2a_hidden_fraction": "a2a_hidden_fraction", "a2a_hidden_fraction_ideal": "a2a_hidden_fraction_ideal"})
    if importlib.util.find_spec("transformers") is not None:
        section("All-to-all hidden by combined 1F1B: a transformers Qwen3-MoE, fused experts expert-parallel",
                "bench_a2a_overlap", argparse.Namespace(delay=0.0015, quick=q, model="hf"),
                {"hf_moe_a2a_hidden_fraction": "a2a_hidden_fraction"})
    else:
        print("\n## hf_moe_a2a_hidden_fraction skipped: transformers is not installed (pip install 'lightning_pp[hf]')")
    section("MoE over a slow expert link vs torch.distributed.pipelining", "bench_moe_vs_torch",
            argparse.Namespace(delay=0.0015, quick=q),
            {"ratio_vs_torch_moe_1f1b": "ratio_vs_torch_moe_1f1b", "ratio_vs_torch_moe_combined": "ratio_vs_torch_moe_combined",
             "ratio_vs_torch_moe_dualpipev": "ratio_vs_torch_moe_dualpipev",
             "ratio_moe_dualpipev_vs_torch_1f1b": "ratio_moe_dualpipev_vs_torch_1f1b"})
    section("Peak memory per rank", "bench_memory", argparse.Namespace(
        hidden=512, batch=256, microbatches=8, steps=4, quick=q, diagnose_sends=True, carried=True),
        {"peak_memory_ratio_vs_torch": "peak_memory_ratio_vs_torch",
         "peak_memory_carried_over_chain": "peak_memory_carried_over_chain",
         "peak_memory_ratio_vs_torch_sends_waited": "peak_memory_ratio_vs_torch_sends_waited",
         "peak_memory_over_1f1b_bound": "peak_memory_over_1f1b_bound",
         "peak_memory_checkpointed_over_plain": "peak_memory_checkpointed_over_plain"})
    section("Sharded data parallelism inside the stages (FSDP2)", "bench_sharding", argparse.Namespace(
        hidden=768, blocks=8, microbatches=4, batch=128, steps=10, quick=q),
        {name: name for name in ("sharded_state_bytes_ratio", "sharded_peak_memory_ratio", "sharded_step_ratio",
                                 "ratio_vs_torch_fsdp_1f1b", "peak_memory_ratio_vs_torch_fsdp_1f1b",
                                 "reduce_scatter_hidden_fraction")})
    section("Compiled layers under the zero-bubble split", "bench_compile",
            argparse.Namespace(width=1024, batch=512, repeats=6 if q else 10),
            {name: name for name in ("zb_compiled_backward_ratio", "zb_torch_compiled_backward_ratio",
                                     "zb_eager_backward_ratio")})
    section("compile= through the pipeline: the main job, vs torch's compiled stages, recompiles", "bench_compile_pipeline",
            argparse.Namespace(warmup=2, rounds=8 if q else 16, block=3, hidden=512, batch=64, heap_kept=True),
            {name: name for name in ("compile_step_ratio", "compile_first_step_s", "ratio_vs_torch_compiled_1f1b",
                                     "recompiles_after_warmup", "compile_step_ratio_heap_kept",
                                     "ratio_vs_torch_compiled_1f1b_heap_kept", "mlp_compile_step_ratio_ours",
                                     "mlp_compile_step_ratio_torch", "mlp_compile_step_ratio_ours_heap_kept",
                                     "mlp_compile_step_ratio_torch_heap_kept")})
    section("Timeline recording and monitor overhead", "bench_monitor_overhead", {"wait_quiet": 0.0},
            {"monitor_overhead": "monitor_overhead", "timeline_overhead": "timeline_overhead"})
    section("Exactness guards: batch check, batch broadcast, random streams", "bench_exactness_overhead",
            argparse.Namespace(hidden=512, blocks=6, batch=256, microbatches=4, rounds=6 if q else 12, block_size=3),
            {"batch_check_bound": "fingerprint_bound", "rng_streams_bound": "rng_bound",
             "batch_check_overhead": "check_overhead", "batch_broadcast_overhead": "broadcast_overhead"})
    auto_configs = [f"pp{pp}_{s}" for pp in (2, 4) for s in ("1f1b", "zb1p")]
    section("layout='auto' vs the even split, the best measured layout and torch's pipeline", "bench_auto_layout",
            {"quick": q},
            {name: name for name in ("auto_layout_step_ratio", "auto_layout_vs_best", "auto_layout_vs_torch",
                                     "auto_layout_predicted_over_measured", "auto_layout_measure_seconds",
                                     "auto_layout_measure_over_epoch")}
            | {f"auto_layout_{figure}_{c}": f"auto_layout_{figure}_{c}" for figure in
               ("step_ratio", "vs_best", "vs_torch", "predicted_over_measured") for c in auto_configs})
    figures["schedule_generate_simulate_seconds"] = _schedule_seconds(q)

    print(f"\n## Summary ({'--quick, ' if q else ''}{time.perf_counter() - started:.0f}s in all)")
    for name, value in figures.items():
        print(f"{name}: {value:.4f}" if isinstance(value, float) else f"{name}: {value}")
    return figures


if __name__ == "__main__":
    main()
