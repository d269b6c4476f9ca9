"""Hugging Face mixture-of-experts decoder layers (Qwen3-MoE, Mixtral, OLMoE, ...: experts fused
in one module, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj``
``[E, H, I]``) run expert-parallel, under HF's own parameter names.

:func:`lightning_pp.integrations.hf.pipeline_layers` gives such a layer an
:class:`HFMoEDecoderLayer`. With ``expert_parallel_size=E`` each expert-parallel rank keeps rows
``[r * n / E, (r + 1) * n / E)`` of every fused expert tensor (its experts) under the same name
(``model.layers.3.mlp.experts.gate_up_proj``, shape ``[n / E, 2I, H]`` on the rank); in checkpoints
the rows appear at their offset in the global tensor, so sharded checkpoints re-shard across
expert-parallel sizes, a one-device state dict loads, each rank reads only its rows of a
``save_pretrained`` directory, and :func:`~lightning_pp.integrations.hf.save_pretrained` writes
the whole tensors (:mod:`lightning_pp.runtime.cut.stacked`). Tokens travel to their experts' ranks
and back by all-to-all; under ``schedule="combined_1f1b"`` those run under another microbatch's
compute, as for lightning_pp's own MoE layer (:mod:`lightning_pp.moe.parallel`).

What the layer computes is the decoder layer's forward, from its own modules: ``input_layernorm``,
``self_attn`` (with the rotary embeddings and mask the base model would pass), the residual,
``post_attention_layernorm``, the model's router (``mlp.gate``, GPT-OSS's ``mlp.router``: its softmax, top-k and
normalisation, e.g. ``norm_topk_prob``), each chosen expert as HF's experts module computes it
(gate/up projection, ``_apply_gate`` or the activation, down projection, biases and transposed
layouts as the module declares), each token's weighted expert outputs summed in ascending expert
order from zeros (as HF's loop over the experts does), and the residual. Mixtral's
``router_jitter_noise`` is applied in training as HF applies it. In a float32 or float64 model
this is HF's arithmetic; in bfloat16 the routing weight (float32 in HF's routers) is cast to the
model's dtype before it multiplies an expert's output, where HF multiplies in float32 and rounds
after, so bf16 runs may differ from HF in the last bits.

The router's auxiliary load-balancing loss (``config.output_router_logits=True``) is refused at
setup: HF computes it over the whole batch and every layer at once, which a pipeline cannot.

A decoder layer is driven this way when it has that structure (``self_attn``, the two norms, an
``mlp`` holding ``gate`` and a fused ``experts`` module, and possibly more modules, such as
Qwen2-MoE's gated shared expert: what those add is computed by the block's own forward with its
experts giving zeros and its router the routing already made, then added to the routed experts'
sum as the block adds it); anything else (extra norms) stays a plain
:class:`~lightning_pp.integrations.hf.HFDecoderLayer` (correct, but its experts are dense:
replicated, not expert-parallel). The first ``pipeline_layers`` call checks the layers against the
model's own forward either way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pp.moe.parallel import ExpertParallelMoE
from lightning_pp.moe.state import MoERouting

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _stacked(experts: nn.Module, name: str) -> bool:
    p = getattr(experts, name, None)
    return isinstance(p, nn.Parameter) and p.dim() == 3


_ROUTER_NAMES = ("gate", "router")  # what transformers' MoE blocks call their router (GPT-OSS: router)


def _router_name(mlp: nn.Module) -> str:
    return next((name for name in _ROUTER_NAMES if isinstance(getattr(mlp, name, None), nn.Module)), "gate")


def is_stacked_moe_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` (an HF decoder layer) is a pre-norm attention + mixture-of-experts layer
    whose experts are fused in one module, which :class:`HFMoEDecoderLayer` drives."""
    children = {name for name, child in layer.named_children() if any(True for _ in child.parameters())}
    mlp = getattr(layer, "mlp", None)
    if children != _LAYER_PARTS or mlp is None:
        return False
    router = _router_name(mlp)
    if not {router, "experts"} <= {name for name, _ in mlp.named_children()} or list(mlp.parameters(recurse=False)):
        return False
    experts, gate = mlp.experts, getattr(mlp, router)
    up = "gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj"
    return (isinstance(getattr(experts, "num_experts", None), int) and isinstance(getattr(gate, "top_k", None), int)
            and _stacked(experts, up) and _stacked(experts, "down_proj"))


class _Given(nn.Module):
    """Stands in for an MoE block's router or experts while the block's own forward computes its
    dense part: the router gives the routing already computed, the experts nothing (zeros)."""

    def __init__(self, routing: Any = None) -> None:
        super().__init__()
        self.routing = routing

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.routing if self.routing is not None else torch.zeros_like(hidden_states)


class HFMoEDecoderLayer(ExpertParallelMoE):
    """One HF decoder layer with fused experts, as the base model's forward calls it in training,
    expert-parallel (see the module docstring). Holds the layer (not a copy)."""

    stacked_experts = True

    def __init__(self, parts: Any, layer: nn.Module, index: int) -> None:
        self.router_name = _router_name(layer.mlp)
        experts, gate = layer.mlp.experts, getattr(layer.mlp, self.router_name)
        super().__init__(experts.num_experts, gate.top_k)
        self.__dict__["parts"] = parts  # not a child: it refers to every module of the model
        self.layer = layer
        self.index = index
        self.layer_type = parts.layer_type[index]
        self.accepts = parts.accepted(layer.forward)
        # What the MoE block adds besides its routed experts (Qwen2-MoE's gated shared expert).
        self.dense_parts = [child for name, child in layer.mlp.named_children() if name not in (self.router_name, "experts")]
        field = next((f for f in _EXPERT_COUNT_FIELDS if getattr(parts.config, f, None) == experts.num_experts), None)
        self.num_experts_field = f"config.{field}" if field else f"{type(experts).__name__}.num_experts"

    def extra_repr(self) -> str:
        return f"index={self.index}, num_experts={self.num_experts}, top_k={self.top_k}"

    def expert_list(self) -> nn.ModuleList:
        return nn.ModuleList([self.layer.mlp.experts])

    def compile_parts(self) -> list[nn.Module]:
        """What ``compile=`` compiles (the modules ``moe_pre`` calls; the experts are indexed rows of
        the fused tensors, computed eagerly, and the all-to-alls stay outside)."""
        layer = self.layer
        return [layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                getattr(layer.mlp, self.router_name), *self.dense_parts]

    def moe_pre(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> MoERouting:
        """The decoder layer up to its MLP, then the MoE block's routing."""
        layer = self.layer
        kwargs = self.parts.layer_kwargs(hidden, attention_mask, position_ids, self.layer_type, self.accepts)
        attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden), **kwargs)
        hidden = hidden + attended
        normed = layer.post_attention_layernorm(hidden)
        mlp = layer.mlp
        jitter = getattr(mlp, "jitter_noise", 0) or 0
        if mlp.training and jitter > 0:
            normed = normed * torch.empty_like(normed).uniform_(1.0 - jitter, 1.0 + jitter)
        tokens = normed.reshape(-1, normed.shape[-1])
        routing = getattr(mlp, self.router_name)(tokens)
        _, probs, indices = routing
        carry = (hidden, attention_mask, position_ids)
        if self.dense_parts:
            carry += (self._dense(normed, routing),)
        return MoERouting(carry, tokens, probs, indices)

    def _dense(self, normed: torch.Tensor, routing: Any) -> torch.Tensor:
        """The MoE block's own forward with its experts giving zeros and its router the routing
        already made: what the block adds to the routed experts' sum (a shared expert's gated
        output), computed as the block computes it."""
        mlp = self.layer.mlp
        name = self.router_name
        experts, gate = mlp._modules["experts"], mlp._modules[name]
        mlp._modules["experts"], mlp._modules[name] = _Given(), _Given(routing)
        try:
            out = mlp(normed)
        finally:
            mlp._modules["experts"], mlp._modules[name] = experts, gate
        return out[0] if isinstance(out, tuple) else out  # (GPT-OSS's block also returns its scores)

    def expert_forward(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` as HF's experts module computes it, from this rank's rows of the fused tensors."""
        experts = self.layer.mlp.experts
        i = e - self.ep_rank * self.num_local_experts if self.ep_size > 1 else e
        transposed, bias = getattr(experts, "is_transposed", False), getattr(experts, "has_bias", False)

        def project(x: torch.Tensor, name: str) -> torch.Tensor:
            weight = getattr(experts, name)[i]
            b = getattr(experts, f"{name}_bias")[i] if bias else None
            if transposed:
                return x @ weight + b if b is not None else x @ weight
            return F.linear(x, weight, b)

        if getattr(experts, "has_gate", True):
            h = experts._apply_gate(project(rows, "gate_up_proj"))
        else:
            h = experts.act_fn(project(rows, "up_proj"))
        return project(h, "down_proj")

    def moe_post(self, carry: tuple, mixed: torch.Tensor) -> tuple:
        """The residual after the MLP; the mask and positions travel on to the next layer."""
        hidden, attention_mask, position_ids = carry[:3]
        routed = mixed.view(hidden.shape).to(hidden.dtype)
        if len(carry) > 3:  # the block's sum: its routed experts' output, then its dense part added
            routed = routed + carry[3]
        return hidden + routed, attention_mask, position_ids


__all__ = ["HFMoEDecoderLayer", "is_stacked_moe_layer"]
