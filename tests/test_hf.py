"""Hugging Face transformers causal LMs pipelined from their own plans
(``lightning_pp.integrations.hf``): fourteen families, tied and untied embeddings, sliding-window
layers, left-padded batches, under 1F1B and interleaved 1F1B at pp=2, equal to the same HF model
trained on one device (float64, 1e-9: losses and every parameter by its HF name); a local checkpoint
read per rank and written back; the README.md and docs/integrations.md example. Tiny random-weight
models made here; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from distributed import run_distributed  # noqa: E402

COMMON = dict(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {  # name: (config class, model class, what the family adds)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=3)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=4)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=4, sliding_window=3)),  # tied, soft-capped
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=4, sliding_window=3)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                 moe_intermediate_size=8, head_dim=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,  # a shared expert
                                                                 moe_intermediate_size=8, shared_expert_intermediate_size=16)),
    # attention sinks, sliding windows, a router named router, transposed experts with biases and their own gate
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=4,
                                                          sliding_window=3)),
    # an embedding multiplier and a logits scaling in the model's forward, outside the planned modules
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                            logits_scaling=8.0, attention_multiplier=0.25)),
    # a head the plan does not name on every release (embed_out), a dropout planned between embedding and layers
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
}
STEPS = 3


def make_hf(family: str) -> nn.Module:
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    config._experts_implementation = "eager"  # the grouped kernel has no float64
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).double()


class HFPipe(nn.Module):
    """What a user writes: the HF model kept as it is, the three methods from the integration."""

    def __init__(self, family: str):
        super().__init__()
        self.model = make_hf(family)

    def pipeline_layers(self):
        from lightning_pp.integrations import hf

        return hf.pipeline_layers(self.model)

    def pipeline_inputs(self, batch):
        from lightning_pp.integrations import hf

        return hf.pipeline_inputs(batch)

    def pipeline_loss(self, logits, batch):
        from lightning_pp.integrations import hf

        return hf.pipeline_loss(logits, batch)


# Right padding for these: on recent transformers (seen on 5.23 and 5.24), Gemma 2's eager attention
# (the only one with its soft-capping) gives NaN for a query that may attend to nothing, as a
# left-padded row's padding positions are, and the NaN reaches every gradient through the backward:
# HF's own model on one device is then not finite either (5.0 to 5.3 gave those rows finite values).
RIGHT_PADDED = {"gemma2"}


def batches(batch=8, seq=7, family=None):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, COMMON["vocab_size"], (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        for row in range(0, batch, 3):  # left padding of varying length in some rows
            if family in RIGHT_PADDED:
                mask[row, seq - 1 - row % 3:] = 0
            else:
                mask[row, : 1 + row % 3] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def one_device(family: str, microbatches: int = 4):
    """The HF model on one device: its own forward on each of the step's microbatches (gradient
    accumulation), HF's causal-LM loss in float64 (labels shifted, padding ignored; HF's ``labels=``
    path upcasts logits to float32, so it is written out), the gradients divided by the batch's
    token count.

    Why microbatches and a summed loss: HF's norms and rotary embeddings compute in float32 even in
    a float64 model (Gemma's norms multiply their weights in float32 too), so a gradient depends,
    at float32's rounding (1e-7 relative), on how the batch is split and on the scale of the loss a
    backward starts from. The pipeline splits the batch into these microbatches and divides by the
    whole batch's count when the step ends; so does this loop, and then the two agree to 1e-9."""
    model = make_hf(family)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches(family=family):
        opt.zero_grad()
        total, count = 0.0, 0
        for part in zip(*(torch.tensor_split(batch[k], microbatches) for k in ("input_ids", "attention_mask"))):
            ids, mask = part
            labels = ids.masked_fill(mask == 0, -100)
            logits = model(input_ids=ids, attention_mask=mask).logits
            shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            loss_sum = nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100,
                                                   reduction="sum")
            loss_sum.backward()
            total += float(loss_sum.detach())
            count += int((shifted != -100).sum())
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / count)
        opt.step()
        losses.append(total / count)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


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
class HFFromPretrained(HFPipe):
    """The model built on the meta device from a local checkpoint's config: each rank materialises
    its layers, then reads only its own tensors from the safetensors files."""

    def __init__(self, path: str):
        nn.Module.__init__(self)
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)

    def pipeline_init_weights(self, module):
        from lightning_pp.integrations import hf

        hf.init_weights(self.model, module)


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
