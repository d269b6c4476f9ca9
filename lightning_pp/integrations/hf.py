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

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lightning_pp.integrations.hf needs transformers: pip install 'lightning_pp[hf]' (or pip install transformers)."
    ) from error

from lightning_pp.integrations.hf_checkpoint import init_weights, load_pretrained, save_pretrained  # noqa: E402
from lightning_pp.integrations.hf_moe import HFMoEDecoderLayer, is_stacked_moe_layer  # noqa: E402
from lightning_pp.integrations.hf_parts import HOW_BY_HAND, IGNORE_INDEX, _Parts  # noqa: E402
from lightning_pp.runtime.process import HF_LAYERS, fact, facts  # noqa: E402

__all__ = ["HFDecoderLayer", "HFEmbedding", "HFHead", "HFMoEDecoderLayer", "LitHF", "check_adapters", "init_weights", "labels_of",
           "load_pretrained", "pipeline_inputs", "pipeline_layers", "pipeline_loss", "save_pretrained"]


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
    cached = fact(model, HF_LAYERS)
    if cached is not None:
        return cached
    parts = _Parts(model)
    layers: list[nn.Module] = [HFEmbedding(parts), HFHead(parts)]
    layers[1:1] = [HFMoEDecoderLayer(parts, layer, i) if is_stacked_moe_layer(layer) else HFDecoderLayer(parts, layer, i)
                   for i, layer in enumerate(parts.layers)]
    if check and not any(p.is_meta for p in model.parameters()):
        check_adapters(model, layers)
    facts(model)[HF_LAYERS] = layers  # the layers refer to the model's parts, not to the model
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
