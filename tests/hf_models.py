"""Hugging Face transformers models as users keep them (tiny random configs of every family the
tests cover, made here: nothing is downloaded), the three methods of the integration around them,
and HF's own model trained on one device as the reference. Import only where transformers is
installed (the tests ``pytest.importorskip`` it first)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

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
