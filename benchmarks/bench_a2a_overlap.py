"""How much expert all-to-all time combined 1F1B hides, compared with plain 1F1B.

Each expert all-to-all goes over an *emulated* link: it completes no earlier than ``--delay``
seconds after launch, and waiting for it sleeps (burns no CPU), so it behaves like a slow
interconnect whose transfer could run under compute. Same model, processes and microbatches for
both schedules, steps alternated (ABAB...) so machine noise hits both.

    hidden fraction = (median step 1F1B - median step combined) / median exposed all-to-all in 1F1B

where the exposed all-to-all time is the time 1F1B spends waiting for it (``a2a_wait`` spans of
the runtime's timeline; with 1F1B nothing overlaps them). The simulator's ideal for the same
configuration uses the measured per-action compute and all-to-all costs.

    python benchmarks/bench_a2a_overlap.py            # full
    python benchmarks/bench_a2a_overlap.py --quick
    python benchmarks/bench_a2a_overlap.py --model hf # a transformers Qwen3-MoE, its fused experts expert-parallel

``--model hf`` runs the same measurement on a Hugging Face ``Qwen3MoeForCausalLM`` of the same
sizes (4 decoder layers, hidden 128, 4 experts top-2, expert width 256), pipelined from its own
plans by ``lightning_pp.integrations.hf`` (its layers :class:`HFMoEDecoderLayer`), and prints
``hf_moe_a2a_hidden_fraction``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import link_args, launch, max_over_ranks, summary  # noqa: E402


def _hf_model(cfg: dict):
    import torch
    import transformers
    from torch import nn

    from lightning_pp.integrations import hf

    config = transformers.Qwen3MoeConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"], moe_intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["blocks"], num_attention_heads=cfg["heads"], num_key_value_heads=cfg["heads"],
        num_experts=cfg["experts"], num_experts_per_tok=cfg["top_k"], max_position_embeddings=cfg["seq"])

    class HFLM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.Qwen3MoeForCausalLM(config)

        def pipeline_layers(self):
            layers = hf.pipeline_layers(self.model)
            for layer in layers:
                if isinstance(layer, hf.HFMoEDecoderLayer):
                    layer.a2a_delay = cfg["delay"]
            return layers

        def pipeline_inputs(self, batch):
            return hf.pipeline_inputs({"input_ids": batch[0]})

        def pipeline_loss(self, logits, batch):
            return hf.pipeline_loss(logits, {"input_ids": batch[0]})

    return HFLM()


def _model(cfg: dict):
    import torch
    from torch import nn

    if cfg.get("model") == "hf":
        return _hf_model(cfg)

    from lightning_pp.moe import MoEBlock

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.out = nn.LayerNorm(cfg["hidden"]), nn.Linear(cfg["hidden"], cfg["vocab"])

        def forward(self, x):
            return self.out(self.norm(x))

    class MoELM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
            self.blocks = nn.ModuleList(
                MoEBlock(cfg["hidden"], cfg["heads"], cfg["ffn"], cfg["experts"], cfg["top_k"], aux_loss_coeff=0.0,
                         a2a_delay=cfg["delay"]) for _ in range(cfg["blocks"]))
            self.head = Head()

        def pipeline_layers(self):
            return [self.embed, *self.blocks, self.head]

        def pipeline_loss(self, logits, batch):
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    torch.manual_seed(0)
    return MoELM()


def _measure(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_pp.runtime import build_pipeline

    schedules = ["1f1b", "combined_1f1b"]
    executors = {}
    for schedule in schedules:
        model = _model(cfg)
        executors[schedule] = (model, build_pipeline(
            model, pipeline_parallel_size=cfg["pp"], expert_parallel_size=cfg["ep"], num_microbatches=cfg["microbatches"],
            schedule=schedule))
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g),
             torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g))
    times = {s: [] for s in schedules}
    exposed = {s: [] for s in schedules}
    for step in range(cfg["warmup"] + cfg["steps"]):
        for schedule in schedules:
            model, executor = executors[schedule]
            dist.barrier()
            start = time.perf_counter()
            executor.train_step(batch)
            for p in model.parameters():
                p.grad = None
            elapsed = max_over_ranks(time.perf_counter() - start)
            if step < cfg["warmup"]:
                continue
            spans = executor.timeline.spans
            times[schedule].append(elapsed)
            exposed[schedule].append(max_over_ranks(sum(s.end - s.start for s in spans if s.kind == "a2a_wait")))
    # Per-action costs from 1F1B: a forward (backward) action minus its all-to-all waits.
    spans = executors["1f1b"][1].timeline.spans
    waits_in = {"F": 0.0, "B": 0.0}
    actions = [s for s in spans if s.kind in ("F", "B")]
    for w in (s for s in spans if s.kind == "a2a_wait"):
        for a in actions:
            if a.start <= w.start <= a.end:
                waits_in[a.kind] += w.end - w.start
                break
    count = {k: sum(1 for a in actions if a.kind == k) for k in ("F", "B")}
    busy = {k: sum(a.end - a.start for a in actions if a.kind == k) for k in ("F", "B")}
    return {
        "times": times,
        "exposed": exposed,
        "cost_f": (busy["F"] - waits_in["F"]) / max(1, count["F"]),
        "cost_b": (busy["B"] - waits_in["B"]) / max(1, count["B"]),
        "a2a_f": waits_in["F"] / max(1, count["F"]),
        "a2a_b": waits_in["B"] / max(1, count["B"]),
    }


def _ideal(cfg: dict, r: dict) -> dict:
    from lightning_pp.schedules import CostModel, make_config, simulate

    costs = CostModel(forward=r["cost_f"], backward=r["cost_b"], a2a_forward=r["a2a_f"], a2a_backward=r["a2a_b"])
    plain = simulate(make_config("1f1b", cfg["pp"], 1, cfg["microbatches"]), costs)
    combined = simulate(make_config("combined_1f1b", cfg["pp"], 1, cfg["microbatches"]), costs)
    total_a2a = sum(plain.exposed_a2a) / cfg["pp"]
    return {"plain": plain.pipeline_makespan, "combined": combined.pipeline_makespan,
            "hidden": (plain.pipeline_makespan - combined.pipeline_makespan) / total_a2a if total_a2a else 0.0}


def run(args: Any = None) -> dict:
    args = args or parse_args([])
    cfg = dict(pp=1, ep=2, microbatches=16, batch=32, seq=32, vocab=64, hidden=128, heads=4, ffn=256, experts=4,
               top_k=2, blocks=4, delay=args.delay, warmup=2, steps=6 if args.quick else 20,
               model=getattr(args, "model", "builtin"))
    world = cfg["pp"] * cfg["ep"]
    r = launch(_measure, world, cfg)[0]
    plain, combined = summary(r["times"]["1f1b"]), summary(r["times"]["combined_1f1b"])
    exposed_plain = summary(r["exposed"]["1f1b"])
    exposed_combined = summary(r["exposed"]["combined_1f1b"])
    hidden = (plain["median"] - combined["median"]) / exposed_plain["median"]
    ideal = _ideal(cfg, r)
    return {"config": cfg, "step_1f1b": plain, "step_combined": combined, "a2a_exposed_1f1b": exposed_plain,
            "a2a_exposed_combined": exposed_combined, "a2a_hidden_fraction": hidden,
            "a2a_hidden_fraction_by_waits": 1 - exposed_combined["median"] / exposed_plain["median"],
            "a2a_hidden_fraction_ideal": ideal["hidden"], "costs": {k: r[k] for k in ("cost_f", "cost_b", "a2a_f", "a2a_b")}}


def format_report(res: dict) -> str:
    c = res["config"]
    lines = [
        f"MoE LM: {c['blocks']} MoE blocks, hidden {c['hidden']}, {c['experts']} experts top-{c['top_k']}, "
        f"pp={c['pp']} ep={c['ep']}, {c['microbatches']} microbatches, emulated link {c['delay'] * 1e3:.1f} ms per all-to-all",
        f"{'':24}{'median':>10}{'q1':>10}{'q3':>10}   (seconds, {res['step_1f1b']['n']} steps each)",
    ]
    for name, key in (("step 1f1b", "step_1f1b"), ("step combined_1f1b", "step_combined"),
                      ("a2a exposed 1f1b", "a2a_exposed_1f1b"), ("a2a exposed combined", "a2a_exposed_combined")):
        s = res[key]
        lines.append(f"{name:24}{s['median']:10.4f}{s['q1']:10.4f}{s['q3']:10.4f}")
    if c.get("model") == "hf":
        lines[0] = "transformers Qwen3MoeForCausalLM (fused experts, expert-parallel): " + lines[0].removeprefix("MoE LM: ")
        return "\n".join(lines + [f"hf_moe_a2a_hidden_fraction: {res['a2a_hidden_fraction']:.3f}",
                                   f"hf_moe_a2a_hidden_fraction_ideal: {res['a2a_hidden_fraction_ideal']:.3f}"])
    lines += [
        f"a2a_hidden_fraction: {res['a2a_hidden_fraction']:.3f}",
        f"a2a_hidden_fraction_by_waits: {res['a2a_hidden_fraction_by_waits']:.3f}",
        f"a2a_hidden_fraction_ideal: {res['a2a_hidden_fraction_ideal']:.3f}",
    ]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    model = "builtin"
    if "--model" in argv:
        i = argv.index("--model")
        model = argv[i + 1]
        del argv[i:i + 2]
    args = link_args(__doc__, argv)
    args.model = model
    return args


if __name__ == "__main__":
    print(format_report(run(parse_args())))
