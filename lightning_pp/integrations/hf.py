"""Hugging Face ``transformers`` causal LMs pipelined from their own pipeline plans.

transformers says how its models cut: the configuration's ``base_model_pp_plan`` (the base model's
``embed_tokens``, ``layers`` and ``norm``, with their inputs and outputs; modules planned between the
embedding and the layers, such as GPT-NeoX's ``emb_dropout``, run after the embedding), and the head
is the model's own ``get_output_embeddings()`` (``lm_head``; GPT-NeoX's ``embed_out``, which not
every release's ``_pp_plan`` names). This module reads them and gives the three protocol methods::

    from transformers import AutoModelForCausalLM
    from lightning_pp.integrations import hf

    class MyLM(L.LightningModule):
        def __init__(self, path):
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(path)   # kept where users keep it

        def pipeline_layers(self):
            return hf.pipeline_layers(self.model)      # embedding, every decoder layer, norm + head

        def pipeline_inputs(self, batch):
            return hf.pipeline_inputs(batch)           # {"input_ids", "attention_mask"?, "labels"?}

        def pipeline_loss(self, logits, batch):
            return hf.pipeline_loss(logits, batch)     # HF's causal-LM loss, token-normalised

The layers are small adapters around the model's own modules, so every parameter keeps HF's name
(``model.model.layers.3.self_attn.q_proj.weight``) and HF state dicts load without a key map. What
crosses a stage boundary is ``(hidden_states, attention_mask, position_ids)``; each stage computes
what its decoder layers need from the model's own functions: the rotary ``position_embeddings``
from the base model's ``rotary_emb``, the mask from ``transformers.masking_utils`` per layer type
(full or sliding-window attention, as the layer's ``attention_type`` says), so a padding
``attention_mask`` works as in HF. ``labels`` default to ``input_ids`` with padded positions set to
``-100``; the loss is HF's (labels shifted by one, ``-100`` ignored), returned as ``(sum, count)``
so the pipeline divides by the whole batch's token count.

What the forwards compute between the planned modules is applied as they apply it: Gemma's
embedding normaliser, Granite's ``embedding_multiplier`` and ``logits_scaling``, Gemma 2's logit
soft-capping. Any other floating-point number the model's or base model's forward reads
(``self.x`` or ``self.config.x``; Cohere's ``logit_scale``) is an error naming it. A model without
plans, or whose own forward computes something else (checked at the first ``pipeline_layers``
call: the adapters' logits must equal the model's on a small batch), is an error naming the class
and what differs, with how to write the three methods by hand.

The mask helpers and decoder layers are called with the arguments the installed transformers'
signatures name (the cache is ``past_key_values``, ``cache`` or ``layer_past`` by release and
family; ``cache_position`` where it is still named), so the integration follows transformers'
releases rather than one release's keywords (tested on 5.0.0 and the newest).
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers  # noqa: F401
    from transformers import masking_utils
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lightning_pp.integrations.hf needs transformers: pip install 'lightning_pp[hf]' (or pip install transformers)."
    ) from error

from lightning_pp.integrations.hf_checkpoint import init_weights, load_pretrained, save_pretrained  # noqa: E402
from lightning_pp.integrations.hf_moe import HFMoEDecoderLayer, is_stacked_moe_layer  # noqa: E402

__all__ = ["HFDecoderLayer", "HFEmbedding", "HFHead", "HFMoEDecoderLayer", "LitHF", "check_adapters", "init_weights", "labels_of",
           "load_pretrained", "pipeline_inputs", "pipeline_layers", "pipeline_loss", "save_pretrained"]

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


class HFEmbedding(nn.Module):
    """The plan's embedding: ``input_ids`` to hidden states (the adapter is not in the user's
    model, so HF's module keeps its name there)."""

    def __init__(self, parts: _Parts) -> None:
        super().__init__()
        self.__dict__["parts"] = parts  # not a child: it refers to every module of the model
        self.embed = parts.embed
        self.pre = nn.ModuleList(parts.pre)

    def forward(self, input_ids, attention_mask, position_ids):
        hidden = self.embed(input_ids)
        if self.parts.embed_scale is not None:  # in the hidden dtype, as the model rounds it
            hidden = hidden * torch.tensor(self.parts.embed_scale, dtype=hidden.dtype)
        if self.parts.embed_multiplier is not None:
            hidden = hidden * self.parts.embed_multiplier
        for module in self.pre:
            hidden = module(hidden)
        return hidden, attention_mask, position_ids


class HFDecoderLayer(nn.Module):
    """One decoder layer of the plan, given what the base model's forward would give it."""

    def __init__(self, parts: _Parts, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.__dict__["parts"] = parts
        self.layer = layer
        self.layer_type = parts.layer_type[index]
        self.accepts = parts.accepted(layer.forward)

    def forward(self, hidden, attention_mask, position_ids):
        kwargs = self.parts.layer_kwargs(hidden, attention_mask, position_ids, self.layer_type, self.accepts)
        out = self.layer(hidden, **kwargs)
        return (out[0] if isinstance(out, tuple) else out), attention_mask, position_ids


class HFHead(nn.Module):
    """The plan's modules after the decoder layers (the final norm) and the model's output
    embedding (``lm_head``): hidden states to logits."""

    def __init__(self, parts: _Parts) -> None:
        super().__init__()
        self.__dict__["parts"] = parts
        self.post, self.head = nn.ModuleList(parts.post), parts.head

    def forward(self, hidden, attention_mask, position_ids):
        for module in self.post:
            hidden = module(hidden)
        logits = self.head(hidden)
        if self.parts.logits_scaling is not None:
            logits = logits / self.parts.logits_scaling
        if self.parts.softcap is not None:
            logits = torch.tanh(logits / self.parts.softcap) * self.parts.softcap
        return logits


def pipeline_layers(model: nn.Module, check: bool = True) -> list[nn.Module]:
    """The embedding, every decoder layer and the norm + head of ``model`` (a transformers causal
    LM), as the pipeline's layers. ``check``: verify once, on a small batch, that the adapters
    compute the model's own logits (skipped for a model on the meta device)."""
    cached = model.__dict__.get("_lpp_hf_layers")
    if cached is not None:
        return cached
    parts = _Parts(model)
    layers: list[nn.Module] = [HFEmbedding(parts), HFHead(parts)]
    layers[1:1] = [HFMoEDecoderLayer(parts, layer, i) if is_stacked_moe_layer(layer) else HFDecoderLayer(parts, layer, i)
                   for i, layer in enumerate(parts.layers)]
    if check and not any(p.is_meta for p in model.parameters()):
        check_adapters(model, layers)
    model.__dict__["_lpp_hf_layers"] = layers
    return layers


def pipeline_inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)`` of a batch dict (``input_ids``, optionally
    ``attention_mask``), each with the batch on dim 0 (the pipeline splits it into microbatches)."""
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return input_ids, mask, positions


def labels_of(batch: Any) -> torch.Tensor:
    labels = batch.get("labels")
    if labels is None:
        labels = batch["input_ids"].clone()
        mask = batch.get("attention_mask")
        if mask is not None:
            labels[mask == 0] = IGNORE_INDEX
    return labels


def pipeline_loss(logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's causal-LM loss as ``(sum, count)``: each position predicts the next label, ``-100``
    ignored, the cross-entropy computed in float32 or wider (as HF upcasts)."""
    labels = labels_of(batch)
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    total = F.cross_entropy(logits.flatten(0, 1), shifted.flatten().to(logits.device), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total, (shifted != IGNORE_INDEX).sum()


def check_adapters(model: nn.Module, layers: Optional[list[nn.Module]] = None, tolerance: float = 1e-5) -> None:
    """Raise ``ValueError`` unless the adapters' logits equal ``model``'s own on a small padded
    batch (run once, before the cut, on every rank alike)."""
    layers = layers if layers is not None else pipeline_layers(model, check=False)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    input_ids = torch.randint(0, vocab, (2, 6), generator=g).to(device)
    mask = torch.ones_like(input_ids)
    mask[1, :2] = 0  # left padding in one row
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(input_ids=input_ids, attention_mask=mask).logits
            x: Any = pipeline_inputs({"input_ids": input_ids, "attention_mask": mask})
            for layer in layers:
                x = layer(*x) if isinstance(x, tuple) else layer(x)
    finally:
        model.train(was_training)
    keep = mask.bool()
    scale = expected[keep].abs().max().clamp(min=1.0)
    diff = float((x[keep] - expected[keep]).abs().max() / scale)
    if diff > tolerance:
        raise ValueError(
            f"{type(model).__name__} cannot be driven from its pipeline plans: run layer by layer from "
            f"base_model_pp_plan, its logits differ from its own forward's by {diff:.2e} (relative), so its "
            f"forward computes something the plans do not name (an embedding scale, a logit transform, "
            f"per-layer rotary choices). {HOW_BY_HAND}")


# -- a ready LightningModule --------------------------------------------------------------------
class LitHF(L.LightningModule):
    """A transformers causal LM as a LightningModule, for the pipeline strategies (and any other),
    configurable from LightningCLI.

    Args:
        checkpoint: a local ``save_pretrained`` directory (its config and safetensors weights): each
            pipeline rank reads only its own tensors.
        model_type, config: without a checkpoint, a new model of ``model_type`` (a transformers
            model type, e.g. ``"llama"``) with these config fields; with one, overrides of its config.
        optimizer, optimizer_args: a ``torch.optim`` class name and its arguments besides the
            parameters (default AdamW, ``lr=3e-4``).
        dtype: the parameters' dtype (e.g. ``"bfloat16"``); default the config's.

    Batches are dicts with ``input_ids`` and optionally ``attention_mask`` and ``labels``. The model
    is built on the meta device in ``configure_model``; a pipeline strategy materialises on each
    rank only the layers it keeps (HF's ``_init_weights``, a seed per module), any other strategy
    the whole model the same way. :meth:`save_hf` writes the trained model as a directory
    ``from_pretrained`` loads.
    """

    def __init__(self, checkpoint: Optional[str] = None, model_type: Optional[str] = None,
                 config: Optional[dict] = None, optimizer: str = "AdamW", optimizer_args: Optional[dict] = None,
                 dtype: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        if checkpoint is None and model_type is None:
            raise ValueError("LitHF needs checkpoint (a save_pretrained directory) or model_type (e.g. 'llama').")
        if checkpoint is not None:
            self.hf_config = transformers.AutoConfig.from_pretrained(checkpoint, **(config or {}))
        else:
            self.hf_config = transformers.AutoConfig.for_model(model_type, **(config or {}))
        self.model: Optional[nn.Module] = None
        self._loaded = checkpoint is None

    def configure_model(self) -> None:
        from lightning_pp.runtime.cut.meta import materialize

        if self.model is not None:
            return
        dtype = getattr(torch, self.hparams.dtype) if self.hparams.dtype else None
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(self.hf_config, dtype=dtype)
        strategy = self.trainer.strategy if self._trainer is not None else None
        if not getattr(strategy, "materializes_meta_modules", False):
            device = strategy.root_device if strategy is not None else torch.device("cpu")
            materialize(self, device, torch.initial_seed(), self.pipeline_init_weights)

    def on_fit_start(self) -> None:
        if not self._loaded:
            load_pretrained(self.model, self.hparams.checkpoint)
            self._loaded = True

    on_validation_start = on_test_start = on_predict_start = on_fit_start

    def save_hf(self, path) -> None:
        """The model as a ``from_pretrained`` directory (collective under a pipeline strategy)."""
        save_pretrained(self.model, path)

    # -- the pipeline protocol ----------------------------------------------------------------
    def pipeline_layers(self) -> list[nn.Module]:
        return pipeline_layers(self.model)

    def pipeline_inputs(self, batch: Any):
        return pipeline_inputs(batch)

    def pipeline_loss(self, logits: torch.Tensor, batch: Any):
        return pipeline_loss(logits, batch)

    def pipeline_init_weights(self, module: nn.Module) -> None:
        init_weights(self.model, module)

    # -- one device (any other strategy) ------------------------------------------------------
    def _step_loss(self, batch: Any) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        loss_sum, count = pipeline_loss(logits, batch)
        return loss_sum / count

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._step_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._step_loss(batch), prog_bar=True)

    def configure_optimizers(self):
        optimizer = getattr(torch.optim, self.hparams.optimizer)
        return optimizer([p for p in self.parameters() if p.requires_grad], **(self.hparams.optimizer_args or {"lr": 3e-4}))
