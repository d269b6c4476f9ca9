"""What the Hugging Face adapters share (``lightning_pp.integrations.hf``): the parts of one model
read from its pipeline plan, its config and its forward's own code (embedding, pre-layer modules,
decoder layers, final modules, head, rotary embeddings, the numbers the forward applies between the
planned modules), and the calls into transformers made with the arguments the installed release's
signatures name."""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
import transformers
from torch import nn
from transformers import masking_utils

IGNORE_INDEX = -100
CACHE_NAMES = ("past_key_values", "past_key_value", "cache", "layer_past")  # what transformers releases call a forward's KV cache
# What a decoder layer is given even where its forward names it only through **kwargs (the rest,
# cache arguments included, only where named).
CORE_NAMES = ("attention_mask", "position_ids", "position_embeddings")
HOW_BY_HAND = (
    "Write the three methods by hand instead: pipeline_layers() returning an embedding adapter, one adapter "
    "per decoder layer (computing the rotary embeddings and the mask the layer needs) and a norm + head "
    "adapter; pipeline_inputs(batch); pipeline_loss(logits, batch) (docs/integrations.md).")


class _Parts:
    """What the adapters share: the base model, its config, and the functions of one forward."""

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config
        prefix = getattr(model, "base_model_prefix", "model")
        self.base = getattr(model, prefix, None)
        plan = getattr(self.config, "base_model_pp_plan", None)
        name = type(model).__name__
        # The head: the model's own output embedding (``lm_head``; GPT-NeoX's ``embed_out``, which
        # some releases' ``_pp_plan`` do not name), whatever its plan calls it.
        getter = getattr(model, "get_output_embeddings", None)
        self.head = getter() if getter is not None else None
        if self.base is None or not plan or not isinstance(self.head, nn.Module):
            missing = "base_model_pp_plan in its config" if not plan else "output embeddings (get_output_embeddings())"
            raise ValueError(f"{name} cannot be pipelined from its plans: it has no {missing}. {HOW_BY_HAND}")
        names = list(plan)
        lists = [i for i, n in enumerate(names) if isinstance(getattr(self.base, n, None), nn.ModuleList)]
        if (plan[names[0]][0] != ["input_ids"] or len(lists) != 1 or lists[0] == 0
                or not all(isinstance(getattr(self.base, n, None), nn.Module) for n in names)):
            raise ValueError(f"{name}'s base_model_pp_plan {plan} is not an embedding, a layer list and the modules "
                             f"around it, which is what this integration drives. {HOW_BY_HAND}")
        if getattr(self.config, "output_router_logits", False):
            raise ValueError(
                f"{name} has config.output_router_logits=True: HF adds the routers' load-balancing loss, "
                f"computed over the whole batch and every layer at once (token fractions times mean "
                f"probabilities, concatenated over layers). A pipeline cannot compute it exactly: its "
                f"backward of the first microbatch starts before the other microbatches' routers have run. "
                f"The pipeline does not add it. Set config.output_router_logits=False (HF's default), or "
                f"use lightning_pp.moe's MoE layers, whose router loss is per layer and microbatch (docs/moe.md).")
        at = lists[0]
        self.embed = getattr(self.base, names[0])
        # Tied embeddings tied as on one device: transformers 5.0 builds a model on the meta device
        # (from_config under torch.device("meta"), as LitHF does) with its head untied, and ties it
        # only when loading weights; a pipeline would then train two matrices where HF trains one.
        weight = getattr(self.head, "weight", None)
        if (getattr(self.config, "tie_word_embeddings", False) and isinstance(weight, nn.Parameter)
                and weight is not getattr(self.embed, "weight", None)):
            model.tie_weights()
        self.pre = [getattr(self.base, n) for n in names[1:at]]  # e.g. GPT-NeoX's emb_dropout
        self.layers = getattr(self.base, names[at])
        self.post = [getattr(self.base, n) for n in names[at + 1:]]  # the final norm
        self.rotary = getattr(self.base, "rotary_emb", None)
        # What the model's forward does between the plan's modules, read from its own code and
        # config: the embedding scaled by sqrt(hidden size) (Gemma 1 and 2 do it in forward, Gemma 3
        # in its embedding module) or by embedding_multiplier (Granite), logits divided by
        # logits_scaling (Granite) or soft-capped (Gemma 2), rotary embeddings chosen per layer type.
        # Any other number the forwards read (a scale this integration does not know) refuses the
        # model by name (unknown_scalars), so nothing is silently left out.
        forward = inspect.getsource(type(self.base).forward)
        self.embed_scale = self.config.hidden_size ** 0.5 if "normalizer" in forward else None
        self.embed_multiplier = getattr(self.base, "embedding_multiplier", None) if "embedding_multiplier" in forward else None
        head_forward = inspect.getsource(type(model).forward)
        self.softcap = getattr(self.config, "final_logit_softcapping", None) if "final_logit_softcapping" in head_forward \
            else None
        self.logits_scaling = getattr(self.config, "logits_scaling", None) if "logits_scaling" in head_forward else None
        unknown = unknown_scalars(model) + unknown_scalars(self.base)
        if unknown:
            raise ValueError(f"{name}'s forward uses {', '.join(unknown)}, which this integration does not reproduce "
                             f"between the planned modules: the pipeline would compute another model. {HOW_BY_HAND}")
        self.rotary_by_type = self.rotary is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters
        types = getattr(self.config, "layer_types", None)
        default = "sliding_attention" if getattr(self.config, "sliding_window", None) is not None and not types \
            else "full_attention"
        self.layer_type = [getattr(layer, "attention_type", None) or (types[i] if types else default)
                           for i, layer in enumerate(self.layers)]

    def layer_kwargs(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                     layer_type: str, accepts: frozenset) -> dict:
        """What the base model's forward passes a decoder layer of ``layer_type`` whose forward
        names ``accepts`` (each release of transformers names its own: ``past_key_values`` or
        ``cache``, with or without ``cache_position``)."""
        values = self.step_values(hidden, attention_mask, position_ids)
        values["attention_mask"] = self.masks(hidden, attention_mask, position_ids)[layer_type]
        if self.rotary_by_type:
            values["position_embeddings"] = self.rotary(hidden, position_ids, layer_type)
        elif self.rotary is not None:
            values["position_embeddings"] = self.rotary(hidden, position_ids)
        core = CORE_NAMES if "**" in accepts else ()  # what a layer taking **kwargs still needs
        return {name: value for name, value in values.items() if name in accepts or name in core}

    @staticmethod
    def accepted(fn) -> frozenset:
        return accepted(fn)

    @staticmethod
    def step_values(hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The arguments of a training forward (no cache), under every name transformers has used."""
        values: dict[str, Any] = dict(inputs_embeds=hidden, input_embeds=hidden, attention_mask=attention_mask,
                                      position_ids=position_ids, use_cache=False, output_attentions=False,
                                      cache_position=torch.arange(hidden.shape[1], device=hidden.device))
        values.update(dict.fromkeys(CACHE_NAMES))
        return values

    def masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The attention mask of every layer type, as the base model builds them for a forward."""
        values = self.step_values(hidden, attention_mask, position_ids)
        values["config"] = self.config
        out = {}
        if "full_attention" in self.layer_type:
            out["full_attention"] = call_with(masking_utils.create_causal_mask, values)
        if "sliding_attention" in self.layer_type:
            out["sliding_attention"] = call_with(masking_utils.create_sliding_window_causal_mask, values)
        return out


# Numbers a model's forward may read besides its modules' own: those the adapters apply (above),
# and the router loss's weight (that loss is refused: output_router_logits).
KNOWN_SCALARS = frozenset({"embedding_multiplier", "logits_scaling", "final_logit_softcapping", "router_aux_loss_coef"})


def unknown_scalars(module: nn.Module) -> list[str]:
    """The floating-point numbers ``module``'s forward reads from itself or its config
    (``self.x``, ``self.config.x``) that the adapters do not apply, as ``"config.x=value"``."""
    source = inspect.getsource(type(module).forward)
    found = []
    for owner, attr in sorted(set(re.findall(r"self\.(config\.)?(\w+)", source))):
        value = getattr(module.config if owner else module, attr, None)
        if isinstance(value, float) and attr not in KNOWN_SCALARS:
            found.append(f"{'config.' if owner else 'self.'}{attr}={value}")
    return found


def accepted(fn) -> frozenset:
    """The keyword arguments ``fn`` names, and ``"**"`` if it takes ``**kwargs``."""
    parameters = inspect.signature(fn).parameters.values()
    return frozenset([p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
                     + ["**" for p in parameters if p.kind == p.VAR_KEYWORD])


def call_with(fn, values: dict) -> Any:
    """``fn`` called with those of ``values`` its signature names; a required argument without a
    value is an error naming it and the installed transformers (a release this integration does not
    know yet)."""
    kwargs = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in values and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            kwargs[name] = values[name]
        elif p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"{fn.__module__}.{fn.__qualname__} of transformers {transformers.__version__} requires "
                            f"{name!r}, which lightning_pp.integrations.hf does not know how to give. {HOW_BY_HAND}")
    return fn(**kwargs)
