"""litgpt's mixture-of-experts blocks (``Block`` whose ``mlp`` is ``LLaMAMoE``: Mixtral, the Qwen3
mixtures, ...) run expert-parallel, with litgpt's maths and litgpt's parameter names.

:func:`lightning_pp.integrations.litgpt.pipeline_layers` gives every such block a
:class:`MoEBlockLayer` (and every other block a ``BlockLayer``). The layer computes what
``Block.forward`` and ``LLaMAMoE.forward`` compute, in the same order, from the block's own modules
(``block.norm_1``, ``block.attn``, ``block.mlp.gate``, ``block.mlp.experts``, ...), which stay where
litgpt put them. With ``expert_parallel_size=E`` each expert-parallel rank keeps ``n_expert / E`` of
``block.mlp.experts`` (the others become placeholders, so a rank's names are a subset of litgpt's:
``model.transformer.h.3.mlp.experts.5.fc_1.weight``); tokens travel to their experts' ranks and
back by all-to-all, and under ``schedule="combined_1f1b"`` those all-to-alls run under another
microbatch's compute (see :mod:`lightning_pp.moe.parallel`). The shared experts
(``n_shared_expert``) are dense: every rank runs them on its own tokens.

Routing is litgpt's: ``topk`` of the gate's logits, softmax over the chosen ones in float32, cast
back, times ``routed_scaling_factor``; or DeepSeek's ``GroupedTopkRouter`` (``n_expert_groups``),
whose weights and indices are used as litgpt uses them. Each token's output is its experts'
weighted outputs summed from zero in ascending expert order, as litgpt's loop over the experts
does. (With ``GroupedTopkRouter``, whose weights are float32, in a bfloat16 or float16 model litgpt
adds each weighted output in float32 before rounding into the bf16 sum; here the weight is cast to
the model's dtype first, so such runs may differ from litgpt in the last bits. Float32 and float64
models match.)
"""

from __future__ import annotations

import torch

from lightning_pp.integrations.litgpt_rope import Rope
from lightning_pp.moe.parallel import ExpertParallelMoE
from lightning_pp.moe.state import MoERouting

from litgpt.model import GPT, LLaMAMoE


def is_moe_block(block: torch.nn.Module) -> bool:
    """Whether ``block`` (a litgpt ``Block``) has a mixture-of-experts MLP."""
    return isinstance(getattr(block, "mlp", None), LLaMAMoE)


class MoEBlockLayer(ExpertParallelMoE):
    """One litgpt ``Block`` with an ``LLaMAMoE`` MLP, as ``GPT.forward`` calls it in training (no KV
    cache), expert-parallel. Holds the block (not a copy): parameters keep litgpt's names."""

    num_experts_field = "config.n_expert"

    def __init__(self, gpt: GPT, block_idx: int) -> None:
        block = gpt.transformer.h[block_idx]
        if not is_moe_block(block):
            raise TypeError(
                f"block {block_idx} of the GPT has a {type(block.mlp).__name__} MLP, not litgpt's LLaMAMoE: "
                f"use BlockLayer for it."
            )
        config = block.config
        super().__init__(config.n_expert, config.n_expert_per_token)
        self.block = block
        self.block_idx = block_idx
        self.rope = Rope(gpt)

    def extra_repr(self) -> str:
        return f"block_idx={self.block_idx}, n_expert={self.num_experts}, top_k={self.top_k}"

    def expert_list(self) -> torch.nn.ModuleList:
        return self.block.mlp.experts

    def moe_pre(self, x: torch.Tensor) -> MoERouting:
        """``Block.forward`` up to the MLP, then ``LLaMAMoE.forward``'s routing."""
        block = self.block
        config = block.config
        cos, sin = self.rope.cos_sin(x.size(1), self.block_idx)
        x_normed = block.norm_1(x)
        attention_output = block.post_attention_norm(block.attn(x_normed, cos, sin))
        if config.parallel_residual:
            if not config.shared_attention_norm:
                x_normed = block.norm_2(x)
            x = attention_output + x
        else:
            x = attention_output + x
            x_normed = block.norm_2(x)

        moe = block.mlp
        tokens = x_normed.view(-1, x_normed.size(-1))  # (B*T, C)
        if not getattr(config, "n_expert_groups", None):
            router = moe.gate(tokens)
            probs, indices = torch.topk(router, config.n_expert_per_token)
            probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=tokens.dtype)
        else:
            probs, indices = moe.gate(tokens)  # GroupedTopkRouter: (weights, indices)
        scaling = getattr(config, "routed_scaling_factor", 1.0)  # (litgpt < 0.5.13 has none)
        if scaling != 1.0:
            probs = probs * scaling
        carry = (x,) if not getattr(config, "n_shared_expert", None) else (x, moe.shared_experts(x_normed))
        return MoERouting(carry, tokens, probs, indices)

    def moe_post(self, carry: tuple, mixed: torch.Tensor) -> torch.Tensor:
        """The rest of ``LLaMAMoE.forward`` (the shared experts' output added to the routed sum) and
        of ``Block.forward`` (``post_mlp_norm`` and the residual)."""
        x = carry[0]
        y = mixed.view(x.shape)
        if len(carry) > 1:
            y = y + carry[1]
        return self.block.post_mlp_norm(y) + x


__all__ = ["MoEBlockLayer", "is_moe_block"]
