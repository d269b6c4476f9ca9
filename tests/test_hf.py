"""Hugging Face transformers causal LMs pipelined from their own plans
(``lightning_pp.integrations.hf``): fourteen families, tied and untied embeddings, sliding-window
layers, left-padded batches, under 1F1B and interleaved 1F1B at pp=2, equal to the same HF model
trained on one device (float64, 1e-9: losses and every parameter by its HF name); a local checkpoint
read per rank and written back; the README.md and docs/integrations.md example. Tiny random-weight
models made here; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distributed import run_distributed  # noqa: E402
from hf_models import COMMON, FAMILIES, HFFromPretrained, HFPipe, batches, make_hf, one_device  # noqa: E402

def _pipelined(rank, world, cases):
    from lightning_pp.runtime import build_pipeline

    out = []
    for family, schedule in cases:
        pipe = HFPipe(family)
        executor = build_pipeline(pipe, pipeline_parallel_size=2, virtual_pipeline_size=2 if schedule == "interleaved" else 1,
                                  num_microbatches=4, schedule=schedule)
        names = executor.partition.parameter_names
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        losses = []
        for batch in batches(family=family):
            opt.zero_grad()
            losses.append(float(executor.train_step(batch).loss))
            opt.step()
        out.append((losses, {names[id(p)].removeprefix("model."): p.detach().clone() for p in pipe.parameters()}))
    return out


CASES = [(family, schedule) for family in FAMILIES for schedule in ("1f1b", "interleaved")]


@pytest.mark.timeout(420)
def test_hf_families_pipelined_from_their_plans_equal_one_device():
    per_rank = run_distributed(_pipelined, 2, CASES, timeout=380)
    for i, (family, schedule) in enumerate(CASES):
        ref_losses, ref_params = one_device(family)
        seen = set()
        for rank in range(2):
            losses, params = per_rank[rank][i]
            assert losses == pytest.approx(ref_losses, rel=1e-9), (family, schedule, rank, losses, ref_losses)
            for name, value in params.items():
                torch.testing.assert_close(value, ref_params[name], rtol=1e-9, atol=1e-12,
                                           msg=f"{family} {schedule}: {name} on rank {rank}")
                seen.add(name)
        assert seen == set(ref_params), (family, set(ref_params) - seen)


def test_a_model_without_plans_is_refused_naming_it_and_the_fix():
    from lightning_pp.integrations import hf

    model = make_hf("llama")
    model.config.base_model_pp_plan = None
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot be pipelined from its plans.*by hand"):
        hf.pipeline_layers(model)


def test_a_router_loss_the_pipeline_cannot_add_is_refused_naming_the_field():
    from lightning_pp.integrations import hf

    model = make_hf("qwen3_moe")
    model.config.output_router_logits = True  # HF would add the load-balancing loss over the whole batch
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM has config.output_router_logits=True.*Set "
                                         r"config.output_router_logits=False"):
        hf.pipeline_layers(model)


def test_a_forward_the_plans_do_not_describe_is_refused_before_the_cut():
    from lightning_pp.integrations import hf

    class Scaled(transformers.LlamaForCausalLM):  # a forward that does more than its plans say
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = make_hf("llama")
    model.__class__ = Scaled
    with pytest.raises(ValueError, match="differ from its own forward"):
        hf.pipeline_layers(model)


def test_a_scale_in_the_forward_the_integration_does_not_apply_is_refused_naming_it():
    """Cohere multiplies its logits by ``logit_scale`` in the model's forward, outside the planned
    modules: refused by name before anything runs (on the meta device too, where no batch can be
    compared)."""
    from lightning_pp.integrations import hf

    config = transformers.CohereConfig(**COMMON, logit_scale=0.5)
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = transformers.CohereForCausalLM(config)
        with pytest.raises(ValueError, match=r"CohereForCausalLM's forward uses self.logit_scale=0.5.*by hand"):
            hf.pipeline_layers(model)


# -- checkpoints in HF's format: read per rank, written back whole ----------------------------------
def _from_pretrained(rank, world, src, dst):
    from lightning_pp.integrations import hf
    from lightning_pp.runtime import build_pipeline

    pipe = HFFromPretrained(src)
    executor = build_pipeline(pipe, pipeline_parallel_size=2, num_microbatches=2)
    read = hf.load_pretrained(pipe.model, src)
    held = sum(1 for _ in pipe.model.parameters())
    batch = batches()[0]
    before = executor.eval_step(batch, collect_outputs=True).outputs
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    executor.train_step(batch)
    opt.step()
    after = executor.eval_step(batch, collect_outputs=True).outputs
    hf.save_pretrained(pipe.model, dst)
    join = (lambda outs: torch.cat(outs)) if before else (lambda outs: None)
    return read, held, join(before), join(after)


@pytest.mark.timeout(300)
def test_a_local_hf_checkpoint_loads_per_rank_and_a_trained_pipeline_saves_one_from_pretrained_loads(tmp_path):
    reference = make_hf("qwen2")  # tied embeddings: the head's copy is read from the embedding's tensor
    src, dst = tmp_path / "src", tmp_path / "dst"
    reference.save_pretrained(str(src), max_shard_size="20KB")  # several safetensors files and an index
    assert (src / "model.safetensors.index.json").is_file()
    per_rank = run_distributed(_from_pretrained, 2, str(src), str(dst), timeout=260)
    total = len(list(reference.state_dict()))
    batch = batches()[0]
    with torch.no_grad():
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float64)
    with torch.no_grad():
        trained = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for rank, (read, held, before, after) in enumerate(per_rank):
        assert read["tensors"] == held < total, (rank, read, held, total)  # its own tensors only
        if before is not None:  # the last stage: the pipeline's logits before and after the step
            keep = batch["attention_mask"].bool()
            torch.testing.assert_close(before[keep], expected[keep], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(after[keep], trained[keep], rtol=1e-12, atol=1e-12)
            assert not torch.allclose(after[keep], before[keep])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("yaml_file", ["hf.yaml", "hf_moe.yaml"])
def test_hf_example_makes_a_checkpoint_fine_tunes_it_from_lightningcli_and_saves_it_in_hf_format(tmp_path, yaml_file):
    """examples/hf_finetune.py with examples/hf.yaml (a Llama, pp=2) and examples/hf_moe.yaml (a
    Qwen3-MoE, pp=2 x ep=2, combined 1F1B, 4 processes), as the README and docs/integrations.md
    print them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    checkpoint = tmp_path / "hf" / "pretrained"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(root / "examples" / "hf_finetune.py"), "fit", "--config", str(root / "examples" / yaml_file),
           f"--model.init_args.checkpoint={checkpoint}", "--trainer.max_steps=6", "--trainer.val_check_interval=3",
           "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=260)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (checkpoint / "config.json").is_file() and (checkpoint.parent / "finetuned" / "config.json").is_file()
    assert "validation loss (nats/byte):" in out and "saved in HF's format" in out
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint.parent / "finetuned"))
    original = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint))
    assert type(reloaded).__name__ == ("Qwen3MoeForCausalLM" if "moe" in yaml_file else "LlamaForCausalLM")
    changed = [n for (n, a), (_, b) in zip(reloaded.named_parameters(), original.named_parameters()) if not torch.equal(a, b)]
    assert changed, "fine-tuning changed no weight"
