"""Tiny litgpt models of every architecture family, and litgpt's own one-device training loop
(``GPT.forward`` + ``chunked_cross_entropy``) that the pipelined runs are compared with."""

from __future__ import annotations

import copy

import torch
from torch import nn

from litgpt.config import Config
from litgpt.model import GPT
from litgpt.utils import chunked_cross_entropy

# One config name per architecture family of litgpt's config list.
FAMILIES = [
    "pythia-14m",              # GPT-NeoX: LayerNorm, parallel residual, GELU MLP
    "Llama-2-7b-hf",           # RMSNorm, SwiGLU
    "Llama-3.2-1B",            # grouped queries, Llama 3 rotary scaling
    "Mistral-7B-v0.1",         # sliding-window attention
    "gemma-2b",                # scaled embeddings, GeGLU
    "gemma-2-2b",              # + logit softcapping, post norms, alternating sliding windows
    "gemma-3-1b-it",           # + per-layer local/global rotary frequencies, q/k norms
    "phi-2",                   # partial rotary, parallel residual, lm_head bias
    "Phi-3-mini-4k-instruct",
    "Qwen2.5-0.5B",            # attention bias
    "Qwen3-0.6B",              # q/k norms
    "Mixtral-8x7B-v0.1",       # LLaMAMoE (dense here: every rank holds every expert)
    "Qwen3-30B-A3B",           # LLaMAMoE with q/k norms
]
VOCAB, LAYERS = 64, 6


def tiny_config(name: str, **overrides) -> Config:
    """``name``'s architecture at a size a test runs in milliseconds (6 blocks of width 32)."""
    base = Config.from_name(name)
    kw = dict(n_layer=LAYERS, n_embd=32, n_head=4, head_size=8, block_size=32, padded_vocab_size=VOCAB,
              vocab_size=VOCAB, intermediate_size=48)
    kw["n_query_groups"] = {base.n_head: 4, 1: 1}.get(base.n_query_groups, 2)
    if base.mlp_class_name == "LLaMAMoE":
        kw.update(n_expert=4, n_expert_per_token=2, moe_intermediate_size=24)
    if base.sliding_window_size is not None:
        kw["sliding_window_size"] = 5
    if base.rope_adjustments and "original_max_seq_len" in base.rope_adjustments:
        kw["rope_adjustments"] = dict(base.rope_adjustments, original_max_seq_len=16)
    kw.update(overrides)
    return Config.from_name(name, **kw)


class Holder(nn.Module):
    """What a user writes: the litgpt model kept as ``self.model``, the integration's three methods."""

    def __init__(self, config: Config, tie: bool = False):
        super().__init__()
        self.model = GPT(config)
        if tie:  # embedding and head share one matrix (across the first and the last stage)
            self.model.lm_head.weight = self.model.transformer.wte.weight

    def pipeline_layers(self):
        from lightning_pp.integrations.litgpt import pipeline_layers

        return pipeline_layers(self.model)

    def pipeline_inputs(self, batch):
        from lightning_pp.integrations.litgpt import pipeline_inputs

        return pipeline_inputs(batch)

    def pipeline_loss(self, logits, batch):
        from lightning_pp.integrations.litgpt import pipeline_loss

        return pipeline_loss(logits, batch)


def make(name: str, tie: bool = False, **overrides) -> Holder:
    torch.manual_seed(11)
    return Holder(tiny_config(name, **overrides), tie).double()


def token_batches(seed: int, batch: int = 6, seq: int = 12, steps: int = 3):
    """litgpt's two batch forms in turn: pretraining (a tensor of ``seq + 1`` tokens per sample)
    and fine-tuning (``{"input_ids", "labels"}`` with prompt and padding labels ignored, -100, so
    that token counts differ between microbatches)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        if step % 2 == 0:
            out.append(tokens)
        else:
            labels = tokens[:, :seq].clone()
            labels[torch.rand(batch, seq, generator=g) < 0.3] = -100
            out.append({"input_ids": tokens[:, :seq], "labels": labels})
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)


def litgpt_reference(holder: Holder, batches, microbatches: int = 1):
    """litgpt on one device: ``GPT.forward`` and litgpt's token cross-entropy; AdamW. Returns the
    losses (litgpt's ``chunked_cross_entropy`` of the whole batch) and the final parameters.

    With ``microbatches > 1`` the gradient is accumulated over that many slices of each batch
    (litgpt's loss summed over the slices' tokens, divided by the batch's token count), as gradient
    accumulation on one device does. litgpt's RMSNorm computes in float32 whatever the model's
    dtype, so for the families that use it a whole-batch pass and a sliced one differ in float32's
    last bits (about 1e-8, which AdamW's first steps magnify for near-zero gradients): compared
    with slices, the pipeline's result is exact in float64."""
    holder = copy.deepcopy(holder)
    gpt = holder.model
    opt = adamw(gpt.parameters())
    losses = []
    for batch in batches:
        inputs, targets, shift = _inputs_targets(batch)
        with torch.no_grad():
            logits = gpt(inputs)
            losses.append(float(chunked_cross_entropy(logits[..., :-1, :] if shift else logits,
                                                      targets[..., 1:] if shift else targets)))
        count = 0
        for x, y in zip(torch.tensor_split(inputs, microbatches), torch.tensor_split(targets, microbatches)):
            logits = gpt(x)
            if shift:
                logits, y = logits[..., :-1, :], y[..., 1:]
            torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum").backward()
            count += int((y != -100).sum())
        for p in gpt.parameters():
            if p.grad is not None:
                p.grad /= count
        opt.step()
        opt.zero_grad()
    return losses, {f"model.{n}": p.detach().clone() for n, p in gpt.named_parameters()}


def _inputs_targets(batch):
    if isinstance(batch, dict):  # litgpt's fine-tuning batch: output n predicts label n + 1
        return batch["input_ids"], batch["labels"], True
    return batch[:, :-1], batch[:, 1:], False  # litgpt's pretraining batch
